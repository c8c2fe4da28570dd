"""The non-finite guard: a NaN or inf loss or gradient norm on any process stops (or skips) the step on all.

A process that exits alone on NaN leaves the others blocked in their next collective; here every process
takes the same decision from one all-reduce, so they stop together at the same step, before the
optimizer step and before any model or checkpoint is written, or all skip that step.
"""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator

from accel_train.config import Config
from accel_train.distributed import any_process, injected_nonfinite_step
from accel_train.errors import NonFiniteError
from accel_train.hooks import RunState


def clip_gradients(accelerator: Accelerator, model: torch.nn.Module, max_norm: float) -> torch.Tensor | None:
    """The global gradient norm before clipping; clips to max_norm when it is above 0 (train.clip_grad_norm)."""
    # max_norm=inf measures without clipping; Accelerate unscales fp16 gradients first either way.
    return accelerator.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)


class NonFiniteGuard:
    def __init__(self, config: Config, accelerator: Accelerator) -> None:
        self.accelerator, self.policy = accelerator, config.train.on_nonfinite
        self.poison_step = injected_nonfinite_step(accelerator)

    def allows_step(self, run: RunState, terms: dict[str, torch.Tensor], grad_norm: torch.Tensor | None) -> bool:
        """False when every process must skip this step; raises NonFiniteError on every process to stop."""
        step = run.step + 1
        if step == self.poison_step:
            terms = {**terms, "loss": terms["loss"] * math.nan}
        values = self._values(terms, grad_norm)
        checked = values if self.accelerator.scaler is None else values[:-1]
        # Under fp16 an inf gradient is routine: the GradScaler skips that step and lowers its scale.
        if not any_process(~torch.isfinite(checked).all(), self.accelerator):
            return True
        report = self._report(terms, grad_norm, step, run.epoch)
        if self.policy == "stop":
            raise NonFiniteError(f"{report}; every process stopped before updating the weights, files written before are "
                                 "untouched. Lower train.lr, set train.clip_grad_norm, or set train.on_nonfinite=skip")
        if self.accelerator.is_main_process:
            print(f"accel-train: warning: {report}; step skipped on every process (train.on_nonfinite=skip)", flush=True)
        return False

    def _values(self, terms: dict[str, torch.Tensor], grad_norm: torch.Tensor | None) -> torch.Tensor:
        norm = grad_norm if grad_norm is not None else torch.zeros((), device=self.accelerator.device)
        return torch.stack([*(value.detach().float() for value in terms.values()), norm.detach().float().reshape(())])

    def _report(self, terms: dict[str, torch.Tensor], grad_norm: torch.Tensor | None, step: int, epoch: int) -> str:
        """One line with every process's terms: the process that went wrong is usually not the main one."""
        names = [*terms, "grad_norm"] if grad_norm is not None else list(terms)
        table = self.accelerator.gather(self._values(terms, grad_norm)[None]).tolist()
        per_process = "; ".join(f"process {index}: " + " ".join(f"{name}={value:.6g}" for name, value in zip(names, row))
                                for index, row in enumerate(table))
        return f"non-finite loss or gradient norm at step {step} (epoch {epoch}): {per_process}"
