"""micro_batch_size=auto while training: a step or an evaluation batch that runs out of device memory on any process
is redone by every process with half the micro-batch, from the same samples, for the same global batch.

Why the processes agree before any collective of such a step: under DDP the gradient all-reduce runs inside the
backward pass of a step's last micro-batch, and the non-finite guard reduces a flag right after. A process that ran
out of memory in a forward or backward pass never enters them, and the others would wait for it until
train.collective_timeout_s. So every micro-batch of an adaptive step runs forward and backward under no_sync (no
all-reduce), catching the out-of-memory error; then the processes agree over the CPU group whether any ran out (one
all-reduce of a flag a process, no device read: distributed/collectives.py); then either all average their gradients
once and the loop clips, guards and steps as usual, or all drop their gradients, free memory, halve the micro-batch and
run the step again. Single process: no agreement, the same catch and redo. Under FSDP (sharded gradients, gathers
inside forward) nothing is redone: running out stops the run in one line, as with a fixed micro-batch.

The loader keeps the micro-batches the search before training chose (accumulation.py), so the data order, mixing and
resume positions stay those of the plan; a step keeps its loaded micro-batches and splits each into equal chunks
(halving: the largest divisor of the loaded micro-batch at most half the last chunk), each chunk's loss weighted by
its share of the micro-batch, so the gradient is the mean over the step's samples as before. The chunk size
(MicroBatchSize, a stateful part of the run) is recorded (config, checkpoint, starts.jsonl) and a resume continues
with it. Evaluation does the same per eval batch,
agreeing before gather_for_metrics, so the metrics do not change.
"""

from __future__ import annotations

import logging

import torch
from accelerate import Accelerator
from accelerate.utils import concatenate, find_batch_size, release_memory, slice_tensors

from accel_train.config import TrainConfig
from accel_train.console import note, warn
from accel_train.distributed.accelerator import shards_gradients
from accel_train.distributed.collectives import average_gradients, processes_where
from accel_train.errors import UserError
from accel_train.run.summaries import named_processes
from accel_train.state import Observer, State
from accel_train.training.accumulation import divisors
from accel_train.training.dropout import DropoutKeys
from accel_train.training.memory import SMALLER_MODEL, ran_out_of_memory
from accel_train.training.steps import StepTerms, eval_outputs, training_terms

logger = logging.getLogger(__name__)


def halves_on_out_of_memory(accelerator: Accelerator, auto: bool) -> bool:
    """Whether running out of memory halves the micro-batch: micro_batch_size=auto, and no FSDP."""
    return auto and not shards_gradients(accelerator)


class MicroBatchSize:
    """The samples of a forward pass under micro_batch_size=auto: the loaded micro-batch, or the divisor of it that
    the last halving left. A stateful part of the run: a resume continues with it."""

    def __init__(self, accelerator: Accelerator, cfg: TrainConfig) -> None:
        self.accelerator, self.cfg = accelerator, cfg
        self.steps = accelerator.gradient_accumulation_steps  # loaded micro-batches a step
        self.per_process = cfg.batch_size // accelerator.num_processes
        self.loaded = self.per_process // self.steps  # samples a process in each of them
        self.micro = self.loaded

    def halve(self, ran_out: list[int], step: int) -> dict:
        """The next smaller size after `ran_out` processes ran out of memory at `step`, said in one warning; the
        change, as observers are told of it. One line (UserError) when there is none smaller."""
        accelerator = self.accelerator
        smaller = max((size for size in divisors(self.loaded) if size <= self.micro // 2), default=0)
        who = named_processes(ran_out, accelerator.num_processes)
        what = (f"{who} ran out of {accelerator.device.type} memory at step {step} with {self.micro} sample(s) per "
                "micro-batch")
        if not smaller:
            raise UserError(f"{what}, the smallest (train.micro_batch_size=auto); {SMALLER_MODEL}")
        warn(logger, accelerator,
             f"{what}; continuing with {smaller} (train.accumulation_steps "
             f"{self.per_process // self.micro} -> {self.per_process // smaller}, the same global batch)")
        change = {"step": step, "from": self.micro, "to": smaller, "processes": ran_out}
        self._take(smaller)
        return change

    def _take(self, micro: int) -> None:
        """A chunk size from now on: the config (and so every checkpoint's) records it."""
        self.micro = micro
        self.cfg.micro_batch_size, self.cfg.accumulation_steps = micro, self.per_process // micro

    def state_dict(self) -> dict:
        return {"micro_batch_size": self.micro}

    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's micro-batch, or the largest that divides this run's below it (another world size): a run
        that ran out of memory with more does not try more again."""
        micro = max(size for size in divisors(self.loaded) if size <= max(1, state["micro_batch_size"]))
        if micro < self.micro:
            self._take(micro)
            note(logger, self.accelerator,
                 f"train.micro_batch_size=auto: {micro} samples per process per forward pass (in "
                 f"chunks of the {self.loaded} loaded), as the checkpoint ran after running out of "
                 "memory with more")


class AdaptiveStep:
    """One optimizer step of micro_batch_size=auto: forward and backward over the step's micro-batches on every
    process, then the agreement; the step redone with half the micro-batch whenever any process ran out of memory,
    observers told of each halving; the gradients averaged over the processes once none ran out. Returns the step's
    terms, as StepTerms gives them."""

    def __init__(self, accelerator: Accelerator, task, size: MicroBatchSize, observers: Observer, state: State,
                 dropout: DropoutKeys | None = None) -> None:
        self.accelerator, self.task, self.size = accelerator, task, size
        self.observers, self.state, self.dropout = observers, state, dropout
        self.timeout_s = size.cfg.collective_timeout_s

    def __call__(self, model: torch.nn.Module, micro_batches) -> dict[str, torch.Tensor]:
        accelerator, step = self.accelerator, self.state.progress.step + 1
        kept = list(micro_batches)  # loaded once, run again after a halving
        counted = accelerator.step  # Accelerate's count of micro-steps, which a redone step counts again
        while True:
            accelerator.step = counted
            terms = self._forward_backward(model, kept, step)  # None: this process ran out of memory
            ran_out = processes_where(terms is None, accelerator, self.timeout_s)  # agreed by every process
            if not ran_out:
                break
            model.zero_grad(set_to_none=True)
            terms = None
            release_memory()  # what the failed passes left: gc, then the device's cache
            self.observers.on_micro_batch_change(self.state, self.size.halve(ran_out, step))
        average_gradients(model, accelerator)
        return terms

    def _forward_backward(self, model: torch.nn.Module, kept: list, step: int) -> dict[str, torch.Tensor] | None:
        accelerator, micro = self.accelerator, self.size.micro
        step_terms = StepTerms(len(kept))
        try:
            for batch in kept:
                size = find_batch_size(batch)
                # accumulate: Accelerate's bookkeeping (backward divides by the steps; the optimizer and scheduler
                # step after the last); no_sync: not even the last micro-batch all-reduces in backward.
                with accelerator.accumulate(model), accelerator.no_sync(model):
                    if micro >= size:
                        terms = training_terms(self.task, model, batch, step, self.dropout)
                        accelerator.backward(terms["loss"])
                    else:
                        terms = {}
                        for start in range(0, size, micro):
                            share = min(micro, size - start) / size  # of the micro-batch's mean
                            chunk = training_terms(self.task, model, slice_tensors(batch, slice(start, start + micro)),
                                                   step, self.dropout)
                            accelerator.backward(chunk["loss"] * share)
                            for name, value in chunk.items():
                                terms[name] = terms.get(name, 0) + value.detach() * share
                step_terms.add(terms)
        except Exception as err:
            if not ran_out_of_memory(err):
                raise
            return None
        return step_terms.mean()


class AdaptiveEval:
    """Evaluation under micro_batch_size=auto: an eval batch that runs out of memory on any process is evaluated again
    by every process in chunks of half as many samples, and so are the batches after it. The processes agree before
    the batch's gather_for_metrics, and the per-sample outputs are the same, so the metrics are."""

    def __init__(self, accelerator: Accelerator, timeout_s: float) -> None:
        self.accelerator, self.timeout_s = accelerator, timeout_s
        self.chunk: int | None = None  # samples a forward pass; None: the whole batch

    def eval_step(self, task, model: torch.nn.Module, batch) -> dict[str, torch.Tensor]:
        while True:
            outputs = self._outputs(task, model, batch)  # None: this process ran out of memory
            ran_out = processes_where(outputs is None, self.accelerator, self.timeout_s)
            if not ran_out:
                return outputs
            release_memory()
            self._halve(ran_out, find_batch_size(batch))

    def _outputs(self, task, model: torch.nn.Module, batch) -> dict[str, torch.Tensor] | None:
        size = find_batch_size(batch)
        try:
            if self.chunk is None or self.chunk >= size:
                return eval_outputs(task, model, batch)
            return concatenate([eval_outputs(task, model, slice_tensors(batch, slice(start, start + self.chunk)))
                                for start in range(0, size, self.chunk)])
        except Exception as err:
            if not ran_out_of_memory(err):
                raise
            return None

    def _halve(self, ran_out: list[int], size: int) -> None:
        accelerator, current = self.accelerator, min(self.chunk or size, size)
        who = named_processes(ran_out, accelerator.num_processes)
        what = f"{who} ran out of {accelerator.device.type} memory evaluating {current} sample(s) per process at once"
        if current // 2 < 1:
            raise UserError(f"{what}, the smallest (train.micro_batch_size=auto); {SMALLER_MODEL}")
        self.chunk = current // 2
        warn(logger, accelerator, f"{what}; evaluating {self.chunk} at a time from now on (the same metrics)")
