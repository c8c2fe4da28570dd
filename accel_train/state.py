"""What training is doing, as the loop changes it and as everything else reads it.

Progress is where training is: the loop alone changes it, and a checkpoint saves and restores it. ResumePoint is
where a start continued from. State is what observers (console, run folder, trackers, a task's pictures) read: the
config, the progress, the start, how the run was launched and its data; an Observer is told what happened at the
loop's named points and never changes what the run computes or decides, so the order of observers does not matter.
No torch import: the run folder's readers use these before torch loads.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    from accel_train.config import Config


@dataclass
class Progress:
    steps_per_epoch: int
    total_steps: int
    epoch: int = 0
    step: int = 0  # optimizer steps taken
    last_eval: dict = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)  # this process's start of the run (set-up included)
    elapsed_before_s: float = 0.0  # what the run had taken up to the checkpoint it resumed from

    def elapsed_s(self) -> float:
        """Seconds the run has taken over all its resumes (time lost after a crash's last checkpoint not counted)."""
        return self.elapsed_before_s + time.perf_counter() - self.started

    def batches_done_in_epoch(self) -> int:
        """Optimizer steps of the current epoch already taken: where its sampler continues."""
        return self.step - self.epoch * self.steps_per_epoch

    @property
    def finished(self) -> bool:
        """Every step of the run is taken (train.epochs, or train.max_steps before them)."""
        return self.step >= self.total_steps

    @property
    def at_epoch_end(self) -> bool:
        return self.step % self.steps_per_epoch == 0

    def state_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "last_eval": dict(self.last_eval),
                "elapsed_s": self.elapsed_s()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.last_eval = state["step"], dict(state["last_eval"])
        self.elapsed_before_s = state["elapsed_s"]


@dataclass(frozen=True)
class ResumePoint:
    """What a checkpoint restored, and where training continues."""

    step: int = 0  # optimizer steps already taken
    epoch: int = 0  # the epoch to continue
    steps_done_in_epoch: int = 0  # optimizer steps of that epoch already taken
    evaluated: bool = False  # the checkpoint was saved after the evaluation at `step`
    in_output_dir: bool = False  # saved by this output_dir's run: its metrics.jsonl continues
    saved_world_size: int | None = None  # the processes that saved it (None: no checkpoint resumed)

    def world_size_change(self, world_size: int) -> str | None:
        """'resumed from a checkpoint of 2 processes' when the checkpoint was saved at another world size."""
        if self.saved_world_size is None or self.saved_world_size == world_size:
            return None
        return f"resumed from a checkpoint of {self.saved_world_size} process(es)"


def across_world_sizes(world_size: int, checkpoint_world_size: int) -> str:
    """How the start line and the summary say a resume at another world size."""
    return f"at {world_size} process(es) from a checkpoint of {checkpoint_world_size}"


class Stateful(Protocol):
    """A part of the run that survives a resume (Checkpoints' `states`)."""

    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class Place(Protocol):
    """Where the run's files are written, as observers need it (run/place.py's RunPlace is one)."""

    folder: Path  # output_dir, or this process's staging folder of a URL: the store gets what is written there

    def sync_soon(self) -> None: ...  # what was written reaches the store soon (nothing to do for a local folder)


@dataclass(frozen=True)
class State:
    """What observers read: the loop changes `progress` and nothing else, and observers change nothing."""

    config: Config
    progress: Progress
    start: ResumePoint  # where this start continued from
    launch: dict  # how the run was launched: world size, distributed type, device, precision, versions
    restart: tuple[int, int]  # (restarts by the launcher so far, restarts allowed)
    data: Any  # the training Data: its classes, and what feeds it faster (slow_input_advice)
    trackers: tuple[str, ...]  # Accelerate's tracker names the run logs to
    place: Place  # where the run's files are written, and how a store gets them


class Observer:
    def on_train_start(self, state: State) -> None: ...
    def on_log(self, state: State, logs: dict) -> None: ...
    def on_step_end(self, state: State) -> None: ...
    def on_eval(self, state: State, metrics: dict, split: str) -> None: ...  # split: val or test
    # micro_batch_size=auto halved the micro-batch: {step, from, to, processes} (the processes that ran out of memory)
    def on_micro_batch_change(self, state: State, change: dict) -> None: ...
    def on_train_end(self, state: State) -> None: ...
    def close(self) -> None: ...  # the run ended, finished or stopped (a signal, an error): before its last line


class Observers(Observer):
    """Tells every observer, in any order; `with observers:` closes them however training ends."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = list(observers)

    def on_train_start(self, state: State) -> None:
        for observer in self.observers:
            observer.on_train_start(state)

    def on_log(self, state: State, logs: dict) -> None:
        for observer in self.observers:
            observer.on_log(state, logs)

    def on_step_end(self, state: State) -> None:
        for observer in self.observers:
            observer.on_step_end(state)

    def on_eval(self, state: State, metrics: dict, split: str) -> None:
        for observer in self.observers:
            observer.on_eval(state, metrics, split)

    def on_micro_batch_change(self, state: State, change: dict) -> None:
        for observer in self.observers:
            observer.on_micro_batch_change(state, change)

    def on_train_end(self, state: State) -> None:
        for observer in self.observers:
            observer.on_train_end(state)

    def close(self) -> None:
        for observer in self.observers:
            observer.close()

    def __enter__(self) -> Observers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
