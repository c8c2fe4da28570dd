"""Optimizers and learning-rate schedules, defined per optimizer step so they are world-size independent."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.optim.lr_scheduler import LRScheduler

from accel_train.config import TrainConfig


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module, sharded: bool = False) -> torch.optim.Optimizer:
    """The fused implementation: one kernel per step, and it applies the non-finite guard's decision on the
    device (`found_inf`, as GradScaler uses it), so no step waits for the host to read a flag. `sharded` (FSDP):
    SGD's fused kernel has no rule for sharded parameters (DTensor), so its for-each implementation steps them, and
    the guard reads its decision on the host."""
    groups = parameter_groups(model, cfg.weight_decay, cfg.decay_norm_and_bias)
    if cfg.optimizer == "sgd" and sharded:
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=True)
    if cfg.optimizer == "sgd":
        optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=True)
        if cfg.momentum:
            # Fused SGD creates its momentum buffers uninitialised (empty_like) on its first step and fills them
            # only if that step is applied; zeros make a skipped first step harmless and the first applied
            # step identical (buffer = 0 * momentum + gradient, as dampening is 0).
            for param in (param for group in groups for param in group["params"]):
                optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)
        return optimizer
    optimizer_class = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return optimizer_class(groups, lr=cfg.lr, fused=True)


def parameter_groups(model: torch.nn.Module, weight_decay: float, decay_norm_and_bias: bool) -> list[dict]:
    """The trainable parameters with weight decay, and (timm's convention) biases and normalisation weights, the
    parameters of fewer than 2 dimensions, without: decaying them towards 0 only hurts. Empty groups are left out."""
    params = [p for p in model.parameters() if p.requires_grad]
    if decay_norm_and_bias:
        return [{"params": params, "weight_decay": weight_decay}]
    decayed = [p for p in params if p.ndim >= 2]
    kept = [p for p in params if p.ndim < 2]
    return [group for group in ({"params": decayed, "weight_decay": weight_decay},
                                {"params": kept, "weight_decay": 0.0}) if group["params"]]


class LRFactor:
    """LR multiplier at an applied optimizer step: optional linear warmup times step / exponential / cosine decay.

    An object of plain settings rather than a lambda so the scheduler's state_dict (checkpoints) keeps it.
    """

    def __init__(self, cfg: TrainConfig, steps_per_epoch: int) -> None:
        self.schedule, self.gamma, self.step_epochs = cfg.schedule, cfg.lr_gamma, cfg.lr_step_epochs
        self.warmup_steps, self.steps_per_epoch = cfg.warmup_steps, steps_per_epoch
        self.total_steps = total_steps(cfg, steps_per_epoch)

    def __call__(self, step: int) -> float:
        return float(self.factors(np.array([step]))[0])

    def factors(self, steps: np.ndarray) -> np.ndarray:
        """The multiplier at each of `steps` (integers), in float64: a whole schedule in one go."""
        warmup = np.minimum(1.0, (steps + 1) / self.warmup_steps) if self.warmup_steps else np.ones(len(steps))
        epoch = steps // self.steps_per_epoch
        if self.schedule == "step":
            decay = np.power(self.gamma, epoch // self.step_epochs, dtype=np.float64)
        elif self.schedule == "exponential":
            decay = np.power(self.gamma, epoch, dtype=np.float64)
        elif self.schedule == "cosine":
            decay = 0.5 * (1 + np.cos(math.pi * np.minimum(steps, self.total_steps) / max(1, self.total_steps)))
        else:
            decay = np.ones(len(steps))
        return warmup * decay


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """Optimizer steps the run will take: train.epochs worth, capped by train.max_steps."""
    steps = steps_per_epoch * cfg.epochs
    return min(steps, cfg.max_steps) if cfg.max_steps else steps


def log_every_steps(cfg: TrainConfig, total: int) -> int:
    """Steps between train lines: train.log_every_steps, or unset every 50, often enough for 10 in a short run."""
    return cfg.log_every_steps or max(1, min(50, total // 10))


def schedule_overruns(cfg: TrainConfig, steps_per_epoch: int) -> str | None:
    """A schedule phase longer than the run (a warmup, the epochs before the first decay), so the run never gets
    past it: a line to warn with, or None."""
    total = total_steps(cfg, steps_per_epoch)
    if cfg.warmup_steps > total:
        return (f"train.warmup_steps={cfg.warmup_steps} is longer than the run ({total} optimizer steps): the LR never "
                f"reaches train.lr={cfg.lr:g}; lower train.warmup_steps (e.g. to {max(1, total // 10)})")
    decay_epochs = {"step": cfg.lr_step_epochs, "exponential": 1}.get(cfg.schedule)
    if decay_epochs and decay_epochs * steps_per_epoch > total:
        return (f"train.schedule={cfg.schedule} decays the LR every {decay_epochs} epoch(s) of {steps_per_epoch} "
                f"steps, but the run ends after {total}: the LR never decays")
    return None


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int,
                    device: torch.device | None = None) -> AppliedStepsLR:
    """`device`: where training runs (unset: the parameters' device; before prepare they may not be there yet)."""
    return AppliedStepsLR(optimizer, LRFactor(cfg, steps_per_epoch), device)


class AppliedStepsLR(LRScheduler):
    """The schedule of LRFactor, advanced by applied optimizer steps only, and decided on the device.

    A step the non-finite guard skips (an fp16 overflow, a non-finite loss with train.on_nonfinite=skip) must not
    advance the schedule, but whether it was skipped is known only on the device: reading it would stop the host at
    every step. So the schedule's position (`applied`) is a device counter, and each parameter group's LR a device
    tensor picked from a table of the schedule's LRs, which the fused optimizers read on the device. The table holds
    LRFactor's floats (float64; float32 on CUDA, whose fused kernels read no other), computed in one go with numpy
    (450,000 steps, ImageNet's 90 epochs at batch 256, in milliseconds). A constant schedule without warmup keeps
    plain float LRs: it has nothing to advance.

    Its state (the position, LRFactor's settings, the base LRs) is saved with each checkpoint; LambdaLR's state, as
    checkpoints of earlier versions hold it, loads too.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, factor: LRFactor, device: torch.device | None = None) -> None:
        # LRScheduler.__init__ is not called: it would step once, the way LambdaLR's host counter does.
        self.optimizer, self.factor = optimizer, factor
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        # the device of the guard's decision: a counter elsewhere would read it across devices at every step
        self.device = device or next((param.device for group in optimizer.param_groups for param in group["params"]),
                                     torch.device("cpu"))
        self.last_epoch = 0  # steps taken, applied or skipped (LRScheduler's name for it)
        self.applied = torch.zeros((), dtype=torch.long, device=self.device)
        self._make_table(factor.total_steps)

    def _make_table(self, steps: int) -> None:
        """The LR of every group at each schedule position up to `steps`; None when the LR never changes."""
        factor = self.factor
        if factor.schedule == "constant" and not factor.warmup_steps:
            self.table = None
        else:
            dtype = torch.float32 if self.device.type == "cuda" else torch.float64
            rows = np.outer(factor.factors(np.arange(steps + 1)), self.base_lrs)  # 8 bytes a position and group
            self.table = torch.from_numpy(rows).to(device=self.device, dtype=dtype)
        self._set_lrs()

    def _set_lrs(self) -> None:
        if self.table is None:
            for group, base in zip(self.optimizer.param_groups, self.base_lrs):
                group["lr"] = base
            return
        # Past the table's end (a resumed run longer than the saved schedule) the last LR holds.
        # index_select, not table[applied]: a 0-dim index tensor is read on the host like a Python int
        lrs = self.table.index_select(0, self.applied.clamp(max=len(self.table) - 1).reshape(1))[0]
        for group, lr in zip(self.optimizer.param_groups, lrs.unbind()):
            group["lr"] = lr

    def step(self, skipped: torch.Tensor | None = None) -> None:
        """After an optimizer step; `skipped` (a device flag, 1 = skipped) leaves the schedule where it was."""
        self.last_epoch += 1
        self.applied += 1 if skipped is None else (skipped == 0).long()
        self._set_lrs()

    def get_last_lr(self) -> list[float | torch.Tensor]:
        """The LR each group applies at the next step: device tensors while the schedule varies (read at log steps
        only), floats otherwise."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"applied": self.applied, "last_epoch": self.last_epoch, "base_lrs": self.base_lrs,
                "factor": dict(vars(self.factor))}

    def load_state_dict(self, state: dict) -> None:
        if "lr_lambdas" in state:  # LambdaLR's: it counted every step, skipped or not
            state = {"applied": torch.tensor(state["last_epoch"]), "last_epoch": state["last_epoch"],
                     "base_lrs": state["base_lrs"], "factor": state["lr_lambdas"][0]}
        vars(self.factor).update(state["factor"])  # the schedule continues as saved (the resume says so)
        self.base_lrs, self.last_epoch = list(state["base_lrs"]), state["last_epoch"]
        self.applied = torch.as_tensor(state["applied"], dtype=torch.long).to(self.device)
        self._make_table(max(self.factor.total_steps, self.last_epoch))
