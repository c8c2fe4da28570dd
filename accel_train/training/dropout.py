"""Dropout keyed by sample: the mask a training sample gets in a layer is a function of (seed, the optimizer step, the
sample's index in the training set, the layer) and of nothing else: not the process that holds the sample, nor its
place in a micro-batch. A run with dropout then trains the same at any world size, any micro_batch_size and across a
resume at another world size, as augmentation does (data/keyed.py); torch's own dropout draws from each process's
stream, so a sample's mask changed with all three.

Every nn.Dropout (1d, 2d, 3d, AlphaDropout, FeatureAlphaDropout) of the model becomes a KeyedDropout before it is
prepared; the loop hands each micro-batch's sample indices over (`DropoutKeys.keyed`) and each layer draws its mask on
the device from a counter-based hash (splitmix64 for the sample, lowbias32 for its elements) of those integers and
the element's position: batched int32 tensor operations in place, no per-sample Python, no host read. The keys and
the step live in device tensors updated in place, so torch.compile traces the layers once. Dropout a model draws
inside its forward (F.dropout, scaled_dot_product_attention's dropout_p) cannot be keyed: the first training step
finds such calls and says once, in one line, which layers make them (their masks stay torch's, drawn per process).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from accel_train.console import warn
from accel_train.workloads.models import DROPOUT_LAYERS

logger = logging.getLogger(__name__)

# splitmix64 (Steele, Lea and Flood 2014; Vigna's public-domain code) for a sample's 64-bit base, and Wellons's
# lowbias32 for its elements: int32 arithmetic that wraps, in place, a quarter of splitmix64's bytes per element (on
# a 2-core CPU 21 ms for a (8, 197, 3072) mask, torch's 23 ms; int64 in place 97 ms)
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX_1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX_2 = 0x94D049BB133111EB - 2**64
_LOWBIAS_1, _LOWBIAS_2 = 0x7FEB352D, 0x846CA68B - 2**32
_INT32_MIN = -2**31
_MASKS = {bits: (1 << (64 - bits)) - 1 for bits in (27, 30, 31)}  # a logical shift right of a signed int64
_SELU_ALPHA_PRIME = -1.7580993408473766  # -SELU's lambda * alpha: what alpha dropout sets dropped units to


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & _MASKS[bits]


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors: each value to one that looks uniformly random."""
    x = x ^ _shift(x, 30)
    x = x * _MIX_1
    x = x ^ _shift(x, 27)
    x = x * _MIX_2
    return x ^ _shift(x, 31)


def _lowbias32_(x: torch.Tensor) -> torch.Tensor:
    """Wellons's lowbias32 on an int32 tensor, in place (logical shifts as arithmetic ones masked)."""
    x ^= (x >> 16) & 0xFFFF
    x *= _LOWBIAS_1
    x ^= (x >> 15) & 0x1FFFF
    x *= _LOWBIAS_2
    x ^= (x >> 16) & 0xFFFF
    return x


def keyed_bits(keys: torch.Tensor, step: torch.Tensor, salt: int, count: int) -> torch.Tensor:
    """(len(keys), count) int32 words of uniformly random bits: element j of sample i a function of (keys[i], step,
    salt, j) alone."""
    base = mix(mix(keys.to(torch.int64) * _GOLDEN + mix(step.to(torch.int64) + salt)))
    high, low = (base >> 32).to(torch.int32), ((base << 32) >> 32).to(torch.int32)  # both exact in int32
    # positions added, not multiplied by a 64-bit constant: inductor's range analysis of that overflowed. Two samples
    # whose high words lie within `count` of each other share a run of first-round words; the second round, keyed by
    # the low word, sets them apart
    words = high[:, None] + torch.arange(count, device=keys.device, dtype=torch.int32)[None, :]
    words = _lowbias32_(words)
    words ^= low[:, None]
    return _lowbias32_(words)


def kept_where(bits: torch.Tensor, p: float) -> torch.Tensor:
    """True where the unsigned word `bits` is at least p * 2**32: each element kept with probability 1 - p."""
    return (bits ^ _INT32_MIN) >= round(p * 2**32) + _INT32_MIN  # the sign bit flipped: unsigned order as signed


class DropoutKeys:
    """The micro-batch's sample indices and the optimizer step, on the device, which every KeyedDropout reads; and
    the layers that draw dropout the keys cannot reach, found at the first keyed forward pass."""

    def __init__(self, is_main_process: bool, device: torch.device) -> None:
        # not the accelerator: the model's layers hold this, and the accelerator holds the model and its loaders, whose
        # workers a cycle would keep running after the run until the garbage collector came by
        self.is_main_process, self.device = is_main_process, device
        self.keys: torch.Tensor | None = None  # this micro-batch's sample indices; None outside a keyed step
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        self.layers = 0  # KeyedDropout layers of the model: none, and batches need not carry their indices
        self.looked_for_unkeyed = False

    @contextlib.contextmanager
    def keyed(self, indices: torch.Tensor | None, step: int, model: nn.Module):
        """The forward pass of a micro-batch of these samples (None: the model has no keyed layer), at optimizer step
        `step` (its backward reuses the masks the forward made)."""
        if indices is not None:
            indices = indices.to(self.device, non_blocking=True).to(torch.int64)
            if self.keys is None or self.keys.shape != indices.shape:
                self.keys = torch.empty_like(indices)
            self.keys.copy_(indices)  # in place: compiled layers read the same tensor every step
            self.step.fill_(step)
        finder = None if self.looked_for_unkeyed else _UnkeyedFinder(model)
        with finder if finder is not None else contextlib.nullcontext():
            yield
        if finder is not None:  # the first keyed pass: every layer has run once
            self.looked_for_unkeyed = True
            if finder.found:
                self._say(finder.found)

    def _say(self, found: dict[str, str]) -> None:
        listed = "; ".join(f"{name} ({how})" for name, how in list(found.items())[:6])
        more = f" and {len(found) - 6} more" if len(found) > 6 else ""
        warn(logger, self,
             f"dropout that cannot be keyed by sample: {len(found)} layer(s) draw it inside their forward, "
             f"{listed}{more}; their masks are torch's, drawn per process, so a run with them trains alike at "
             "another world size only within their noise (docs/contracts.md; model.dropout=false removes "
             "the layers' own dropout, a model's config its attention dropout)")


class KeyedDropout(nn.Module):
    """nn.Dropout's (or its 1d/2d/3d and alpha variants') effect, its mask drawn from the sample keys."""

    def __init__(self, original: nn.Module, keys: DropoutKeys, salt: int) -> None:
        super().__init__()
        self.p, self.inplace = float(original.p), bool(getattr(original, "inplace", False))
        self.alpha = isinstance(original, (nn.AlphaDropout, nn.FeatureAlphaDropout))
        # Dropout1d/2d/3d and FeatureAlphaDropout drop whole channels: a mask per (sample, channel)
        self.channels = {nn.Dropout1d: 2, nn.Dropout2d: 3, nn.Dropout3d: 4, nn.FeatureAlphaDropout: 2}.get(
            type(original))
        self.kind = type(original).__name__
        self.dropout_keys, self.salt = keys, salt

    def extra_repr(self) -> str:
        return f"p={self.p}, keyed by sample ({self.kind})"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = self.dropout_keys.keys
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x * 0.0
        samples = x.shape[0] if x.dim() > 0 else 0
        if keys is None or samples != keys.shape[0]:
            # outside a keyed step (micro_batch_size=auto's search: the same memory, masks by position), or an input
            # whose first dimension is not the batch's: masks by position in the batch
            keys = torch.arange(samples, device=x.device, dtype=torch.int64)
        per_sample = x[0].numel() if self.channels is None else x.shape[1] if x.dim() >= 2 else 1
        bits = keyed_bits(keys, self.dropout_keys.step, self.salt, per_sample)
        shape = x.shape if self.channels is None else (x.shape[0], x.shape[1] if x.dim() >= 2 else 1,
                                                      *([1] * (x.dim() - 2)))
        kept = kept_where(bits, self.p).reshape(shape)
        if self.alpha:  # as F.alpha_dropout: dropped units at SELU's negative saturation, then back to unit variance
            a = ((1 - self.p) * (1 + self.p * _SELU_ALPHA_PRIME ** 2)) ** -0.5
            b = -a * _SELU_ALPHA_PRIME * self.p
            return torch.where(kept, x, torch.full_like(x, _SELU_ALPHA_PRIME)) * a + b
        return x * kept.to(x.dtype) * (1.0 / (1.0 - self.p))


def key_dropout(model: nn.Module, seed: int, accelerator) -> DropoutKeys:
    """Every dropout layer of `model` that drops anything made a KeyedDropout (in place, before it is prepared); the
    keys they read (`layers`: how many). A layer's salt is (seed, its qualified name): the same model keys alike
    everywhere."""
    keys = DropoutKeys(accelerator.is_main_process, accelerator.device)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) in DROPOUT_LAYERS and float(child.p) > 0:
                setattr(module, child_name, KeyedDropout(child, keys, layer_salt(seed, f"{name}.{child_name}")))
                keys.layers += 1
    return keys


def layer_salt(seed: int, name: str) -> int:
    """A layer's constant in its masks' hash: (seed, its qualified name), as a signed 64-bit integer."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little", signed=True)


class _UnkeyedFinder(TorchFunctionMode):
    """During one training forward pass: the modules that call functional dropout, or attention with a dropout
    probability, themselves (which no KeyedDropout stands for)."""

    FUNCTIONS = {F.dropout: "F.dropout", F.dropout1d: "F.dropout1d", F.dropout2d: "F.dropout2d",
                 F.dropout3d: "F.dropout3d", F.alpha_dropout: "F.alpha_dropout",
                 F.feature_alpha_dropout: "F.feature_alpha_dropout"}

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model, self.found, self.stack, self.hooks = model, {}, [], []
        self.root = f"{type(model).__name__}'s forward"

    def __enter__(self):
        for name, module in self.model.named_modules():
            if not isinstance(module, KeyedDropout):  # hooks return None: a value would replace the output
                self.hooks.append(module.register_forward_pre_hook(self._entered(name or self.root)))
                self.hooks.append(module.register_forward_hook(self._left))
        return super().__enter__()

    def _entered(self, name: str):
        def entered(module, args) -> None:
            self.stack.append(name)
        return entered

    def _left(self, module, args, output) -> None:
        if self.stack:
            self.stack.pop()

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        where = self.stack[-1] if self.stack else self.root
        if func in self.FUNCTIONS:
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training and p and not math.isclose(float(p), 0.0):
                self.found.setdefault(where, f"{self.FUNCTIONS[func]}, p={float(p):g}")
        elif func is F.scaled_dot_product_attention:
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if p:
                self.found.setdefault(where, f"scaled_dot_product_attention, dropout_p={float(p):g}")
        return func(*args, **kwargs)
