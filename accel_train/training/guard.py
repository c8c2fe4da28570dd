"""The non-finite guard: a NaN or inf loss term or gradient norm on any process skips that optimizer step on all.

A process that exits alone on NaN leaves the others blocked in their next collective, and a host read of a
device flag at every step would serialise the CPU and the GPU. So each step is decided and applied on the
device: the flag is reduced across processes there and handed to the fused optimizer as `found_inf`, the
way GradScaler skips a step, and no non-finite update reaches the weights. The host reads the outcome only
where the loop needs every process to agree anyway (a train line, a checkpoint, an evaluation): there every
process stops together (`train.on_nonfinite=stop`, before anything is saved) or reports the skipped steps
(`skip`), in one line naming each process's terms at the first non-finite step.
"""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator

from accel_train.console import warn
from accel_train.errors import NonFiniteError
from accel_train.state import Progress


def clip_gradients(accelerator: Accelerator, model: torch.nn.Module, max_norm: float) -> torch.Tensor | None:
    """The global gradient norm before clipping; clips to max_norm when it is above 0 (train.clip_grad_norm)."""
    # max_norm=inf measures without clipping; Accelerate unscales fp16 gradients first either way.
    return accelerator.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)


class NonFiniteGuard:
    def __init__(self, policy: str, accelerator: Accelerator) -> None:
        self.policy, self.accelerator = policy, accelerator
        self.names: list[str] = []
        self.checked_step = -1
        self._reset()

    def _reset(self) -> None:
        device = self.accelerator.device
        self.bad_steps = torch.zeros((), device=device)  # since the last check; equal on every process
        self.first_step = torch.zeros((), dtype=torch.long, device=device)  # the first of them
        self.first_values: torch.Tensor | None = None  # this process's terms and gradient norm at that step

    def step(self, optimizer, terms: dict[str, torch.Tensor], grad_norm: torch.Tensor | None,
             step: int) -> torch.Tensor:
        """optimizer.step(), unless a term or the gradient norm is non-finite on some process: then no process
        updates anything. Returns that decision as a device tensor (1. = skipped), without reading it."""
        self.names = [*terms, "grad_norm"]
        norm = grad_norm if grad_norm is not None else torch.zeros((), device=self.accelerator.device)
        values = torch.stack([*(value.detach().float() for value in terms.values()), norm.detach().float().reshape(())])
        # Under fp16 an inf gradient is routine: the GradScaler skips that step and lowers its scale.
        checked = values if self.accelerator.scaler is None else values[:-1]
        bad = self.accelerator.reduce((~torch.isfinite(checked)).any().float(), reduction="max")
        first = (self.bad_steps == 0) & (bad > 0)
        self.first_step = torch.where(first, step, self.first_step)
        self.first_values = torch.where(first, values, values if self.first_values is None else self.first_values)
        self.bad_steps += bad
        self._apply(optimizer, bad)
        return bad

    def _apply(self, optimizer, bad: torch.Tensor) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)  # under Accelerate's AcceleratedOptimizer
        if self.accelerator.scaler is not None:
            optimizer.step()  # fp16: GradScaler skips steps with non-finite gradients itself
        elif getattr(inner, "_step_supports_amp_scaling", False):  # fused optimizers read found_inf on the device
            inner.found_inf = bad
            try:
                optimizer.step()
            finally:
                del inner.found_inf
        elif not bad.item():  # an optimizer without found_inf: the host has to decide, one read per step
            optimizer.step()

    def check(self, progress: Progress) -> None:
        """Called by the loop on every process at the same step: one host read. On a non-finite step since the
        last check, stops every process (NonFiniteError) or warns that steps were skipped."""
        step = progress.step
        if step == self.checked_step:  # e.g. the last step's train line, then its evaluation
            return
        self.checked_step = step
        bad_steps, first_step = torch.stack([self.bad_steps.long(), self.first_step]).tolist()
        if not bad_steps:
            return
        # a collective: every process read the same bad_steps
        report = self._report(first_step, progress.steps_per_epoch)
        self._reset()
        if self.policy == "stop":
            stopped = "" if step == first_step else f" at step {step}"
            raise NonFiniteError(f"{report}; every process stopped{stopped} without applying that step, and "
                                 "nothing was saved after it: files written before are untouched. Lower train.lr, "
                                 "set train.clip_grad_norm, or set train.on_nonfinite=skip")
        skipped = "step skipped on every process" if bad_steps == 1 else \
            f"{bad_steps} steps skipped on every process between steps {first_step} and {step}"
        warn(self.accelerator, f"{report}; {skipped} (train.on_nonfinite=skip)")

    def _report(self, step: int, steps_per_epoch: int) -> str:
        """One line with every process's terms: the process that went wrong is usually not the main one."""
        table = self.accelerator.gather(self.first_values[None]).tolist()
        per_process = "; ".join(
            f"process {index}: " + " ".join(f"{name}={value:.6g}" for name, value in zip(self.names, row))
            for index, row in enumerate(table))
        return f"non-finite loss or gradient norm at step {step} (epoch {(step - 1) // steps_per_epoch}): {per_process}"
