"""The non-finite guard: a NaN or inf loss term or gradient norm on any process skips that optimizer step on all.

A process that exits alone on NaN leaves the others blocked in their next collective, and a host read of a
device flag at every step would serialise the CPU and the GPU. So each step is decided and applied on the
device: the flags are reduced across processes there and handed to the fused optimizer as `found_inf`, the
way GradScaler skips a step, and to the LR schedule, which does not advance (optim.AppliedStepsLR); no
non-finite update reaches the weights. The host reads the outcome only where the loop needs every process to
agree anyway (a train line, a checkpoint, an evaluation): there every process stops together
(`train.on_nonfinite=stop`, before anything is saved) or reports the skipped steps (`skip`), in one line naming
each process's terms at the first non-finite step.

Under fp16 an inf gradient with a finite loss is routine: the loss scale was too high. That step is skipped the
same way and counted as an overflow (the train line's `overflow_steps`), the GradScaler halves its scale, and
training goes on. A scale that collapses, `train.fp16_max_consecutive_overflows` overflows in a row or a scale
below `train.fp16_min_loss_scale`, means gradients that are not finite at any scale: every process stops (exit 5),
in one line saying which steps overflowed and where the scale went.
"""

from __future__ import annotations

import logging
import math

import torch
from accelerate import Accelerator

from accel_train.config import TrainConfig
from accel_train.console import warn
from accel_train.errors import NonFiniteError
from accel_train.state import Progress

logger = logging.getLogger(__name__)


def clip_gradients(accelerator: Accelerator, model: torch.nn.Module, max_norm: float) -> torch.Tensor | None:
    """The global gradient norm before clipping; clips to max_norm when it is above 0 (train.clip_grad_norm)."""
    # max_norm=inf measures without clipping; Accelerate unscales fp16 gradients first either way, and the
    # GradScaler records there whether they overflowed.
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
    # FSDP2's gradients are DTensors, and so is their norm: the global value, the same on every process
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


class NonFiniteGuard:
    def __init__(self, cfg: TrainConfig, accelerator: Accelerator) -> None:
        self.policy, self.accelerator = cfg.on_nonfinite, accelerator
        self.scaler = accelerator.scaler  # fp16's GradScaler, None otherwise
        self.min_scale, self.max_overflows = cfg.fp16_min_loss_scale, cfg.fp16_max_consecutive_overflows
        self.names: list[str] = []
        self.checked_step = -1
        device = accelerator.device
        self.overflow_run = torch.zeros((), dtype=torch.long, device=device)  # fp16: overflows in a row up to now
        self.overflow_run_start = torch.zeros((), dtype=torch.long, device=device)  # the first step of that run
        self.overflow_steps = 0  # fp16: steps skipped by an overflow between the last two train lines
        self.skipped_steps = 0  # non-finite steps skipped (train.on_nonfinite=skip) since the last train line
        self.skipped_in_start = 0  # ... since this start of the run (its first step, or the checkpoint resumed)
        self._reset()

    def _reset(self) -> None:
        device = self.accelerator.device
        self.bad_steps = torch.zeros((), device=device)  # non-finite steps since the last check; equal on every process
        self.first_step = torch.zeros((), dtype=torch.long, device=device)  # the first of them
        self.first_values: torch.Tensor | None = None  # this process's terms and gradient norm at that step
        self.overflows = torch.zeros((), dtype=torch.long, device=device)  # fp16 overflows since the last check
        self.longest_run = torch.zeros((), dtype=torch.long, device=device)  # the longest run of them up to now

    def step(self, optimizer, terms: dict[str, torch.Tensor], grad_norm: torch.Tensor | None,
             step: int) -> torch.Tensor:
        """optimizer.step(), unless a term or the gradient norm is non-finite on some process: then no process
        updates anything. Returns that decision as a device tensor (1. = skipped), without reading it: the LR
        schedule takes it too."""
        self.names = [*terms, "grad_norm"]
        device = self.accelerator.device
        norm = grad_norm if grad_norm is not None else torch.zeros((), device=device)
        values = torch.stack([*(value.detach().float() for value in terms.values()), norm.detach().float().reshape(())])
        finite = torch.isfinite(values)
        flags = torch.stack([~finite[:-1].all(), ~finite[-1]]).float()
        loss_bad, grads_bad = self.accelerator.reduce(flags, reduction="max").unbind()  # one collective for both
        skipped = torch.maximum(loss_bad, grads_bad)
        # Under fp16 non-finite gradients with a finite loss are an overflow of the loss scale, not an error.
        bad = skipped if self.scaler is None else loss_bad
        if self.scaler is not None:
            overflow = (grads_bad * (1 - loss_bad)).long()
            self.overflow_run_start = torch.where((overflow > 0) & (self.overflow_run == 0), step,
                                                  self.overflow_run_start)
            self.overflow_run = (self.overflow_run + 1) * overflow
            self.longest_run = torch.maximum(self.longest_run, self.overflow_run)
            self.overflows += overflow
        first = (self.bad_steps == 0) & (bad > 0)
        self.first_step = torch.where(first, step, self.first_step)
        self.first_values = torch.where(first, values, values if self.first_values is None else self.first_values)
        self.bad_steps += bad
        self._apply(optimizer, skipped)
        return skipped

    def _apply(self, optimizer, skipped: torch.Tensor) -> None:
        # The inner optimizer, not Accelerate's wrapper: under fp16 the wrapper's GradScaler.step would skip on its
        # own overflow flag alone, applying a step whose loss is not finite.
        inner = getattr(optimizer, "optimizer", optimizer)
        if getattr(inner, "_step_supports_amp_scaling", False):  # fused optimizers read found_inf on the device
            inner.found_inf = skipped
            try:
                inner.step()  # fp16 gradients are unscaled already (clip_gradients)
            finally:
                del inner.found_inf
        elif not skipped.item():  # an optimizer without found_inf: the host has to decide, one read per step
            inner.step()
        if self.scaler is not None:
            self.scaler.update()  # halves the scale after an overflow, grows it after enough steps without

    def check(self, progress: Progress) -> None:
        """Called by the loop on every process at the same step: one host read. On a non-finite step since the
        last check, stops every process (NonFiniteError) or warns that steps were skipped; under fp16, stops every
        process when the loss scale collapsed."""
        step = progress.step
        if step == self.checked_step:  # e.g. the last step's train line, then its evaluation
            return
        self.checked_step = step
        read = torch.stack([self.bad_steps.long(), self.first_step, self.overflows, self.longest_run,
                            self.overflow_run_start])
        bad_steps, first_step, overflows, longest_run, run_start = read.tolist()
        self.overflow_steps += overflows
        if overflows:
            self._check_loss_scale(step, longest_run, run_start)
        if not bad_steps:
            self._reset()
            return
        # a collective: every process read the same bad_steps
        report = self._report(first_step, progress.steps_per_epoch)
        self._reset()
        if self.policy == "stop":
            stopped = "" if step == first_step else f" at step {step}"
            raise NonFiniteError(f"{report}; every process stopped{stopped} without applying that step, and "
                                 "nothing was saved after it: files written before are untouched. Lower train.lr, "
                                 "set train.clip_grad_norm, or set train.on_nonfinite=skip")
        self.skipped_steps += bad_steps
        self.skipped_in_start += bad_steps
        skipped = "step skipped on every process" if bad_steps == 1 else \
            f"{bad_steps} steps skipped on every process between steps {first_step} and {step}"
        warn(logger, self.accelerator, f"{report}; {skipped} (train.on_nonfinite=skip)")

    def refuse_a_start_without_an_applied_step(self, progress: Progress, resumed_at: int) -> None:
        """At the end (every process, with `check`'s host read): a start whose every step was skipped as
        non-finite trained nothing, and ends as a non-finite stop does (exit 5), not as a run that is done."""
        self.check(progress)
        taken = progress.step - resumed_at
        if taken and self.skipped_in_start == taken:
            steps, weights = (f"the {taken} steps after step {resumed_at}", f"those of step {resumed_at}") \
                if resumed_at else (f"the run's {taken} steps", "the initial ones")
            raise NonFiniteError(f"every one of {steps} was skipped as non-finite (train.on_nonfinite=skip): no step "
                                 f"changed the weights, which are still {weights}. Lower train.lr, set "
                                 "train.clip_grad_norm, or look for NaN or inf in the data")

    def _check_loss_scale(self, step: int, longest_run: int, run_start: int) -> None:
        """fp16: stop every process when the overflows have driven the loss scale to nothing."""
        scale = self.scaler.get_scale()  # read only after overflows: it fell
        too_many = self.max_overflows and longest_run >= self.max_overflows
        too_low = scale < self.min_scale
        if not (too_many or too_low):
            return
        why = f"{longest_run} steps in a row (train.fp16_max_consecutive_overflows={self.max_overflows})" \
            if too_many else f"until the scale fell below train.fp16_min_loss_scale={self.min_scale:g}"
        raise NonFiniteError(
            f"fp16 loss scale collapsed: the gradients overflowed (inf/NaN with a finite loss) {why}, from step "
            f"{run_start} to step {step}; each of those steps was skipped on every process, and the scale is now "
            f"{scale:.3g}. Every process stopped at step {step}, its weights those of step {run_start - 1}. "
            f"Train in bf16 (accelerate launch --mixed_precision bf16), lower train.lr, or set train.clip_grad_norm")

    def line_values(self) -> dict[str, float]:
        """What a train line adds: the non-finite steps skipped since the last line, where there were any; under
        fp16 the steps skipped by an overflow since the last line, and the scale. Called after `check` (the host has
        read the device then)."""
        values = {"skipped_steps": self.skipped_steps} if self.skipped_steps else {}
        self.skipped_steps = 0
        if self.scaler is None:
            return values
        values.update(overflow_steps=self.overflow_steps, loss_scale=self.scaler.get_scale())
        self.overflow_steps = 0
        return values

    def _report(self, step: int, steps_per_epoch: int) -> str:
        """One line with every process's terms: the process that went wrong is usually not the main one."""
        table = self.accelerator.gather(self.first_values[None]).tolist()
        per_process = "; ".join(
            f"process {index}: " + " ".join(f"{name}={value:.6g}" for name, value in zip(self.names, row))
            for index, row in enumerate(table))
        what = "non-finite loss" if self.scaler is not None else "non-finite loss or gradient norm"
        return f"{what} at step {step} (epoch {(step - 1) // steps_per_epoch}): {per_process}"
