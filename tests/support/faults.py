"""Faults injected through the package's hooks (accel_train.hooks), as a machine, a library or a user's code would
cause them: a NaN, running out of device memory, a crash after a checkpoint, signals, a launch that forms no group,
FSDP forced onto the CPU, an older accelerate's loading error. The launched probe (tests/launched_probe.py) turns
PROBE_* variables into these; in-process tests add them directly."""

from __future__ import annotations

import math
import os
import signal
import sys
import time

import torch
from accelerate import PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import find_batch_size

from accel_train import hooks


def out_of_memory(size: int, name: str) -> torch.OutOfMemoryError:
    """torch's own error, as a device that filled up would raise it."""
    return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} samples ({name})")


def this_process() -> int:
    return PartialState().process_index


class NonFinite(hooks.Hooks):
    """The loss of training forward pass number `call` (micro-batches counted from 1) on `process` becomes NaN before
    backward, so the NaN crosses the gradient all-reduce as in life; `where="grad"` leaves the loss finite and makes
    one gradient inf instead; `where="value"` makes only the loss's value NaN (a NaN constant added to it), so every
    gradient stays finite and the other processes learn of it through the guard's own reduction alone."""

    def __init__(self, call: int, process: int, where: str = "loss") -> None:
        self.call, self.process, self.where, self.calls = call, process, where, 0

    def after_forward(self, phase, step, model, batch, outputs):
        if phase != "train":
            return outputs
        self.calls += 1
        if self.calls != self.call or this_process() != self.process:
            return outputs
        if self.where == "loss":
            return {**outputs, "loss": outputs["loss"] * math.nan}
        if self.where == "value":  # the constant has no gradient: backward gives the finite gradients of the loss
            return {**outputs, "loss": outputs["loss"] + torch.tensor(math.nan, device=outputs["loss"].device)}
        infinite_gradient_once(model)
        return outputs


class OverflowFrom(hooks.Hooks):
    """Every training micro-batch from forward pass number `call` on gets an inf gradient (its loss stays finite):
    gradients that overflow at any loss scale, as a diverging fp16 run's do."""

    def __init__(self, call: int) -> None:
        self.call, self.calls = call, 0

    def after_forward(self, phase, step, model, batch, outputs):
        if phase == "train":
            self.calls += 1
            if self.calls >= self.call:
                infinite_gradient_once(model)
        return outputs


def infinite_gradient_once(model) -> None:
    """The next backward pass makes one gradient inf, before the all-reduce: an overflow in this process's backward."""
    param, fired = next(p for p in model.parameters() if p.requires_grad), []

    def infinite_once(grad):
        if not fired:
            fired.append(True)
            return torch.full_like(grad, math.inf)
        return None
    param.register_hook(infinite_once)


class Fp16OnCpu(hooks.Hooks):
    """fp16 mixed precision as Accelerate runs it on a GPU (autocast to float16, a GradScaler scaling the loss,
    unscaling and checking the gradients, and updating its scale), on the CPU, where Accelerate itself has no fp16:
    torch's GradScaler runs on CPU tensors. The process's AcceleratorState says fp16 from then on (reset it)."""

    def __init__(self, init_scale: float = 2.0**16) -> None:
        self.init_scale = init_scale

    def accelerator_options(self, options):
        return {**options, "mixed_precision": "fp16"}

    def accelerator_made(self, accelerator):
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=self.init_scale)


class OutOfMemoryAbove(hooks.Hooks):
    """micro_batch_size=auto's search before training runs out of memory with more than `limit` samples (as a GPU
    with room for `limit` would)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def after_forward(self, phase, step, model, batch, outputs):
        if phase == "search" and find_batch_size(batch) > self.limit:
            raise out_of_memory(find_batch_size(batch), "PROBE_OOM_ABOVE")
        return outputs


class OutOfMemoryAt(hooks.Hooks):
    """`process`'s training forward passes run out of memory (at their end, as a device that filled up there would)
    from optimizer step `step` on, whenever they hold more than `samples` samples. The search before training is
    left alone."""

    def __init__(self, step: int, process: int, samples: int = 0) -> None:
        self.step, self.process, self.samples = step, process, samples

    def after_forward(self, phase, step, model, batch, outputs):
        size = find_batch_size(batch)
        if phase == "train" and step >= self.step and size > self.samples and this_process() == self.process:
            raise out_of_memory(size, "PROBE_OOM_AT")
        return outputs


class EvalOutOfMemory(hooks.Hooks):
    """`process`'s evaluation forward passes of more than `samples` samples run out of memory, at every evaluation."""

    def __init__(self, process: int, samples: int) -> None:
        self.process, self.samples = process, samples

    def after_forward(self, phase, step, model, batch, outputs):
        size = find_batch_size(batch)
        if phase == "eval" and size > self.samples and this_process() == self.process:
            raise out_of_memory(size, "PROBE_EVAL_OOM")
        return outputs


class FsdpOnCpu(hooks.Hooks):
    """Accelerate forms FSDP only on GPUs (on CPU a FSDP profile trains with DDP); this takes the FSDP path anyway,
    with the plugin the profile describes, so the loop, checkpoints and export run through FSDP2's fully_shard on a
    gloo group."""

    def accelerator_made(self, accelerator):
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        # Both states: AcceleratorState copies PartialState's when made, and an Accelerator made before this reads
        # its own copy (prepare would wrap the model with DDP, and only a later AcceleratorState() say FSDP)
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the profile's FSDP_* variables
        assert accelerator.is_fsdp2, "the FSDP profile's plugin is not FSDP2"


class CrashAfterSave(hooks.Hooks):
    """Every process ends (exit 1, no clean-up) right after the checkpoint of `step`, as a machine failure would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def checkpoint_saved(self, progress, folder):
        if progress.step == self.step:
            sys.stdout.flush()
            os._exit(1)


class SlowSaved(hooks.Hooks):
    """The checkpoint of `step` takes `seconds` longer to end on `process` (its checkpoint_saved hook waits): a
    commit that outlasts the other processes, which may end meanwhile."""

    def __init__(self, step: int, process: int, seconds: int) -> None:
        self.step, self.process, self.seconds = step, process, seconds

    def checkpoint_saved(self, progress, folder):
        if progress.step == self.step and this_process() == self.process:
            time.sleep(self.seconds)


class WaitForSignal(hooks.Hooks):
    """After optimizer step `step`, every process waits until it receives SIGTERM or SIGINT (at most `timeout_s`):
    a script that signals the launcher once a line is logged then stops the run at a known step, the first where
    the processes agree on a signal after it (an evaluation agrees at once: train.eval_every_steps).

    The run's own handler still receives the signal: this one, set at the first micro-batch (training has started
    and the run's handlers are in place), notes it and calls that handler. A run that starts past step 0 (a resume)
    never waits."""

    def __init__(self, step: int | None, timeout_s: float = 120) -> None:
        self.step, self.timeout_s, self.received, self.listening = step, timeout_s, [], False

    def micro_batch_loaded(self, progress, batch):
        if not self.listening:
            self.listening = True
            if progress.step > 0:
                self.step = None
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._chain(signum, signal.getsignal(signum))

    def _chain(self, signum, handler):
        def note(number, frame):
            self.received.append(number)
            if callable(handler):
                handler(number, frame)

        signal.signal(signum, note)

    def optimizer_stepped(self, progress, terms, skipped, lr):
        if progress.step != self.step:
            return
        deadline = time.monotonic() + self.timeout_s
        while not self.received:
            if time.monotonic() > deadline:
                sys.exit(f"no SIGTERM or SIGINT within {self.timeout_s} s of step {self.step}")
            time.sleep(0.02)


class Crash(Exception):
    pass


class RaiseAfterSave(hooks.Hooks):
    """`Crash` is raised right after the checkpoint of `step`: a run in the test's own process that fails there."""

    def __init__(self, step: int) -> None:
        self.step = step

    def checkpoint_saved(self, progress, folder):
        if progress.step == self.step:
            raise Crash


class NoProcessGroup(hooks.Hooks):
    """accel-train believes a GPU is present on this CPU-only machine and does not tell Accelerate to use the CPU:
    Accelerate then forms no process group and every process runs alone, the silent failure the world-size check
    stops."""

    def accelerator_options(self, options):
        return {**options, "cpu": False}


class SignalsAt(hooks.Hooks):
    """Process 0 sends itself SIGTERM during optimizer step `step`, then (`second`) SIGINT, as a launcher forwarding
    Ctrl-C again, as soon as the checkpoint that the first one asked for starts."""

    def __init__(self, step: int, second: bool = True) -> None:
        self.step, self.steps, self.signalled, self.second = step, 0, False, second

    def optimizer_stepped(self, progress, terms, skipped, lr):
        self.steps += 1
        if self.steps == self.step and this_process() == 0:
            self.signalled = True
            os.kill(os.getpid(), signal.SIGTERM)

    def checkpoint_saving(self, progress):
        if self.signalled and self.second:
            os.kill(os.getpid(), signal.SIGINT)


class LoadApiError(hooks.Hooks):
    """Accelerator.load_state raises the TypeError accelerate 1.2 raised for an argument it did not know yet: a
    library that differs, with every checkpoint file whole."""

    def accelerator_made(self, accelerator):
        def older_load_state(input_dir=None, **kwargs):
            raise TypeError("load_model() got an unexpected keyword argument 'load_kwargs'")

        accelerator.load_state = older_load_state  # this Accelerator object is accelerate's, not the package's
