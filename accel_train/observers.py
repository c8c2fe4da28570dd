"""Observers: what watches a run on the main process (console, run folder, pictures, trackers).

They are told what happened at the loop's named points and never change what the run computes or decides:
every decision all processes must share (save, stop, evaluate) is a call in loop.py, so the order of
observers does not matter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Progress:
    """Where training is; the loop alone changes it, observers read it."""

    steps_per_epoch: int
    total_steps: int
    epoch: int = 0
    step: int = 0  # optimizer steps taken
    last_eval: dict = field(default_factory=dict)


class Observer:
    def on_train_start(self, progress: Progress) -> None: ...
    def on_log(self, progress: Progress, logs: dict) -> None: ...
    def on_step_end(self, progress: Progress) -> None: ...
    def on_eval(self, progress: Progress, metrics: dict, split: str) -> None: ...  # split: val or test
    def on_train_end(self, progress: Progress) -> None: ...


class Observers(Observer):
    """Tells every observer, in any order."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = list(observers)

    def on_train_start(self, progress: Progress) -> None:
        for observer in self.observers:
            observer.on_train_start(progress)

    def on_log(self, progress: Progress, logs: dict) -> None:
        for observer in self.observers:
            observer.on_log(progress, logs)

    def on_step_end(self, progress: Progress) -> None:
        for observer in self.observers:
            observer.on_step_end(progress)

    def on_eval(self, progress: Progress, metrics: dict, split: str) -> None:
        for observer in self.observers:
            observer.on_eval(progress, metrics, split)

    def on_train_end(self, progress: Progress) -> None:
        for observer in self.observers:
            observer.on_train_end(progress)


class Console(Observer):
    """A tqdm bar over optimizer steps with the latest train terms, and one line per evaluation."""

    def __init__(self, headline: str, output_dir: str, progress_bar: bool) -> None:
        self.headline, self.output_dir, self.progress_bar = headline, output_dir, progress_bar
        self.bar, self.final = None, None

    def on_train_start(self, progress: Progress) -> None:
        from tqdm.auto import tqdm

        print(f"{self.headline}, {progress.total_steps} steps", flush=True)
        if self.progress_bar:
            # disable=None: no bar when stderr is not a terminal (CI logs), eval lines still print.
            self.bar = tqdm(total=progress.total_steps, initial=progress.step, unit="step", dynamic_ncols=True,
                            disable=None)

    def on_log(self, progress: Progress, logs: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in logs.items()}, refresh=False)

    def on_step_end(self, progress: Progress) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_eval(self, progress: Progress, metrics: dict, split: str) -> None:
        self.final = f"{split} {shown(metrics)}"
        line = f"epoch {progress.epoch} step {progress.step} {split}: {shown(metrics)}"
        (self.bar.write if self.bar is not None else print)(line)

    def on_train_end(self, progress: Progress) -> None:
        if self.bar is not None:
            self.bar.close()
        final = self.final or f"eval {shown(progress.last_eval)}"  # no evaluation: resumed with nothing left
        print(f"done: {progress.step} steps; final {final}; config, metrics and "
              f"model.safetensors in {self.output_dir}", flush=True)


def shown(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
