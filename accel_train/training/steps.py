"""An optimizer step's micro-batches, as the loop walks the training loader, and the step that runs them.

Each epoch's optimizer steps left (a resumed epoch continues at its checkpoint's step) come as iterators over their
micro-batches, fetched as the step reads them: Accelerate's `accumulate` decides where gradients are all-reduced from
the loader's position, so nothing is fetched early. Each micro-batch is marked for the watchdog (progress) and mixed by
the task (MixUp / CutMix) as the model receives it. The plain step runs them under `accumulate`; with
micro_batch_size=auto the adaptive step (adaptive.py) runs them instead.
"""

from __future__ import annotations

from itertools import islice

import torch
from accelerate import Accelerator

from accel_train import hooks
from accel_train.data import start_epoch
from accel_train.data.decode import model_input
from accel_train.data.keyed import with_index, without_index
from accel_train.state import Progress, ResumePoint
from accel_train.training.dropout import DropoutKeys
from accel_train.training.memory import out_of_memory_stops


class StepTerms:
    """The terms of one optimizer step: the mean of its micro-batches' terms (each a mean over its samples).

    With equal micro-batches that is the mean over the step's samples, what one batch without accumulation
    gives; a NaN in any micro-batch stays in the mean, so the non-finite guard sees it.
    """

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, terms: dict[str, torch.Tensor]) -> None:
        for name, value in terms.items():
            value = value.detach()
            self.sums[name] = value if name not in self.sums else self.sums[name] + value

    def mean(self) -> dict[str, torch.Tensor]:
        means = {name: value / self.steps for name, value in self.sums.items()} if self.steps > 1 else self.sums
        self.sums = {}
        return means


def training_terms(task, model: torch.nn.Module, batch, step: int, dropout: DropoutKeys | None = None
                   ) -> dict[str, torch.Tensor]:
    """The task's training terms of a micro-batch of optimizer step `step`, as the hooks see them. `dropout`: the
    run's keys where its dropout is keyed by sample; the batch then carries its samples' indices (last), which the
    forward pass's masks are drawn from and the task does not see."""
    if dropout is None:
        return hooks.every().after_forward("train", step, model, batch, task.training_step(model, batch))
    batch, indices = without_index(batch) if dropout.layers else (batch, None)
    with dropout.keyed(indices, step, model):
        terms = task.training_step(model, batch)
    return hooks.every().after_forward("train", step, model, batch, terms)


def eval_outputs(task, model: torch.nn.Module, batch) -> dict[str, torch.Tensor]:
    """The task's per-sample evaluation outputs of a batch, as the hooks see them."""
    return hooks.every().after_forward("eval", None, model, batch, task.eval_step(model, batch))


class TrainingBatches:
    """The training loader walked step by step; `steps(epoch)` gives the epoch's optimizer steps left."""

    def __init__(self, accelerator: Accelerator, loader, task, seed: int, accumulation: int, progress: Progress,
                 start: ResumePoint, timed, mark, finish=None, sample_indices: bool = False) -> None:
        self.accelerator, self.loader, self.task, self.seed = accelerator, loader, task, seed
        self.accumulation, self.progress, self.start = accumulation, progress, start
        self.timed, self.mark = timed, mark  # the meter's clock of data waits; the watchdog's mark of progress
        self.finish = finish  # the data's: uint8 batches made into the model's input on the device
        self.sample_indices = sample_indices  # batches carry their samples' indices last (keyed dropout)

    def steps(self, epoch: int):
        """The epoch's optimizer steps not yet taken, up to the run's last, each an iterator over its micro-batches.
        Micro-batches left at the epoch's end, fewer than a step, are not trained (as drop_last drops a batch)."""
        progress = self.progress
        start_epoch(self.loader, epoch, self.seed)
        # The seedable sampler's order depends on (seed, epoch) only; skipping what the checkpoint already trained
        # makes a resumed epoch see exactly the micro-batches an uninterrupted run would.
        done = self.start.steps_done_in_epoch if epoch == self.start.epoch else 0
        micro_batches_done = self.accumulation * done
        micro_batches = self.loader
        if micro_batches_done:
            micro_batches = self.accelerator.skip_first_batches(self.loader, micro_batches_done)
            start_epoch(micro_batches, epoch, self.seed)  # before accelerate 1.15 it started over at epoch 0
        steps_left = min(progress.steps_per_epoch, progress.total_steps - epoch * progress.steps_per_epoch) - done
        numbered = enumerate(self.timed(micro_batches), start=micro_batches_done)  # timed: the lines' data_wait
        self.mark()  # training again, from the epoch's first batch on (after an evaluation, a save)
        for _ in range(steps_left):
            yield (self._as_received(number, batch) for number, batch in islice(numbered, self.accumulation))

    def _as_received(self, number: int, batch):
        """A micro-batch as the model receives it: `number` is its place in the epoch, which mixing is keyed by. Its
        samples' indices, where it carries them, stay beside it (last) for the step's keyed dropout."""
        self.mark()  # progress: no stuck report while micro-batches come (train.stuck_after_s)
        indices = None
        if self.sample_indices:
            batch, indices = without_index(batch)
        batch = model_input(self.finish, batch)  # before mixing: MixUp mixes the normalised images
        hooks.every().micro_batch_loaded(self.progress, batch)
        batch = self.task.mix_batch(batch, self.progress.epoch, number)
        return batch if indices is None else with_index(batch, indices)


class PlainStep:
    """The micro-batches of one optimizer step under `accelerator.accumulate`: no gradient all-reduce until the last
    one's backward. Returns the step's terms (their mean over the micro-batches)."""

    def __init__(self, accelerator: Accelerator, task, cfg, progress: Progress,
                 dropout: DropoutKeys | None = None) -> None:
        self.accelerator, self.task, self.cfg, self.progress = accelerator, task, cfg, progress
        self.dropout = dropout

    def __call__(self, model: torch.nn.Module, micro_batches) -> dict[str, torch.Tensor]:
        accelerator, step = self.accelerator, self.progress.step + 1
        step_terms = StepTerms(accelerator.gradient_accumulation_steps)
        for batch in micro_batches:
            with accelerator.accumulate(model), out_of_memory_stops(accelerator, "micro-batch", self.cfg):
                terms = training_terms(self.task, model, batch, step, self.dropout)
                accelerator.backward(terms["loss"])  # divided by the accumulation steps
            step_terms.add(terms)
        return step_terms.mean()
