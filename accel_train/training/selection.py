"""Model selection on the validation split: the best model exported (checkpoint.best_metric) and early stopping
(train.early_stop_patience, early_stop_metric, early_stop_mode, early_stop_min_delta).

Every process computes the same metrics (gather_for_metrics), so every process takes the same decision; the
stop is still agreed on with one collective, once per evaluation, so no process can train on alone. The state
(best values, evaluations without improvement, whether the run stopped) is saved in each checkpoint's loop
state, so a resumed run selects and stops as the uninterrupted one would.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator

from accel_train.config import Config
from accel_train.console import warn
from accel_train.distributed.collectives import any_process
from accel_train.errors import UserError, did_you_mean
from accel_train.run.layout import BEST_FILE
from accel_train.run.weights import export

logger = logging.getLogger(__name__)


@dataclass
class Watched:
    """One metric and the best value it has had."""

    metric: str
    mode: str  # "max" or "min"
    min_delta: float = 0.0
    best: float | None = None
    evaluations_without_improvement: int = 0

    def improves(self, value: float) -> bool:
        better = self.best is None or (value > self.best + self.min_delta if self.mode == "max"
                                       else value < self.best - self.min_delta)
        if better:
            self.best, self.evaluations_without_improvement = value, 0
        else:
            self.evaluations_without_improvement += 1
        return better


class ModelSelection:
    def __init__(self, config: Config, accelerator: Accelerator, folder: Path) -> None:
        """`folder`: where this process writes the run (RunPlace.folder), model_best.safetensors among it."""
        train, checkpoint = config.train, config.checkpoint
        self.accelerator, self.output_dir = accelerator, folder
        self.best = Watched(checkpoint.best_metric, checkpoint.best_mode) if checkpoint.best_metric else None
        self.patience = train.early_stop_patience
        self.early_stop = Watched(train.early_stop_metric or checkpoint.best_metric,
                                  train.early_stop_mode or checkpoint.best_mode,
                                  train.early_stop_min_delta) if self.patience else None
        self.stopped = False  # early stopping has ended the run

    def warn_if_choosing_on(self, split: str) -> None:
        """Say so where best_metric or early stopping choose on the test set (`split`: no validation split)."""
        if (self.best is not None or self.patience) and split == "test":
            warn(logger, self.accelerator, "checkpoint.best_metric / train.early_stop_patience choose on the test set, "
                 "which then no longer measures unseen data; set data.val_fraction (e.g. 0.1) to choose on a "
                 "validation split")

    def update(self, metrics: dict, model: torch.nn.Module) -> bool:
        """After an evaluation on the validation split, with the model it evaluated: export model_best.safetensors
        when best_metric improved; True when early stopping ends the run (on every process alike)."""
        for key, watched in (("checkpoint.best_metric", self.best), ("train.early_stop_metric", self.early_stop)):
            if watched is not None and watched.metric not in metrics:  # a task that does not say its metrics before
                raise UserError(f"{key}={watched.metric} is not an eval metric{did_you_mean(watched.metric, metrics)}"
                                f"; eval reports {', '.join(sorted(metrics))}")
        if self.best is not None and self.best.improves(metrics[self.best.metric]):
            export(self.accelerator, model, self.output_dir / BEST_FILE)
        if self.early_stop is not None:
            self.early_stop.improves(metrics[self.early_stop.metric])
            exhausted = self.early_stop.evaluations_without_improvement >= self.patience
            self.stopped = any_process(exhausted, self.accelerator)
        return self.stopped

    def describe_stop(self) -> str:
        watched = self.early_stop
        return (f"early stopping: {watched.metric} has not improved on {watched.best:.6g} for {self.patience} "
                "evaluation(s)")

    def state_dict(self) -> dict:
        return {"best": self.best and asdict(self.best), "early_stop": self.early_stop and asdict(self.early_stop),
                "stopped": self.stopped}

    def load_state_dict(self, state: dict | None) -> None:
        """What a checkpoint saved; the values of a watch whose metric or mode changed since are not kept."""
        for name in ("best", "early_stop"):
            saved, watched = (state or {}).get(name), getattr(self, name)
            if saved and watched and (saved["metric"], saved["mode"]) == (watched.metric, watched.mode):
                watched.best = saved["best"]
                watched.evaluations_without_improvement = saved["evaluations_without_improvement"]
        self.stopped = bool((state or {}).get("stopped")) and self.early_stop is not None

