"""Experiment trackers (TensorBoard, W&B, MLflow, Aim) through Accelerate's own tracking API.

They receive the scalars of metrics.jsonl at the same optimizer steps (train terms, lr, samples/s, eval metrics,
tagged `train/loss`, `val/accuracy`, ...) and the resolved config as hyperparameters. metrics.jsonl stays the
record of a run; a tracker is a view of it.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

from accel_train.config import Config, flatten
from accel_train.errors import UserError
from accel_train.run.layout import trackers_dir
from accel_train.state import Observer, State
from accel_train.versions import version_problems

PROJECT = "accel-train"  # the project (W&B, Aim) or experiment (MLflow); TensorBoard's folder under trackers/
# train.log_with -> (the package it needs, how to get it)
PACKAGES = {"tensorboard": ("tensorboard", "pip install 'accel-train[tensorboard]'"),
            "wandb": ("wandb", "pip install wandb"), "mlflow": ("mlflow", "pip install mlflow"),
            "aim": ("aim", "pip install aim")}


def tracker_names(log_with: str) -> list[str]:
    """Accelerate's tracker names for train.log_with; a named tracker that is not installed is an error, not a
    silent run without it (Accelerate itself only warns)."""
    if log_with == "none":
        return []
    if log_with == "auto":
        if not installed("tensorboard"):
            return []
        log_with = "tensorboard"
    package, how = PACKAGES[log_with]
    if not installed(package):
        raise UserError(f"train.log_with={log_with}: {package} is not installed ({how}); or set train.log_with=none")
    problems = version_problems(extras=(log_with,))
    if problems:  # an old tracker fails at its first log with an error about numpy or protobuf instead
        raise UserError(f"train.log_with={log_with}: {problems[0]}; or set train.log_with=none")
    return [log_with]


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


class Trackers(Observer):
    """Feeds Accelerate's trackers on the main process; distributed.accelerator.finish_command closes them."""

    def __init__(self, accelerator) -> None:
        self.accelerator = accelerator  # what the trackers are fed through

    def on_train_start(self, state: State) -> None:
        config = state.config
        name = Path(config.output_dir).name
        init_kwargs = {"wandb": {"name": name}, "mlflow": {"run_name": name}}
        if state.start.in_output_dir:  # resumed from a checkpoint of this output_dir: its events are there
            # As metrics.jsonl drops the lines written after the checkpoint, TensorBoard drops those events.
            init_kwargs["tensorboard"] = {"purge_step": state.progress.step + 1}
            after_earlier_events(trackers_dir(state.place.folder) / PROJECT)
        self.accelerator.init_trackers(PROJECT, config=hyperparameters(config, state.launch), init_kwargs=init_kwargs)

    def on_log(self, state: State, logs: dict) -> None:
        self.accelerator.log(scalars("train", logs), step=state.progress.step)

    def on_eval(self, state: State, metrics: dict, split: str) -> None:
        self.accelerator.log(scalars(split, metrics), step=state.progress.step)


def after_earlier_events(folder: Path) -> None:
    """Wait, if need be, until a second later than that of the newest TensorBoard events file in `folder`.

    TensorBoard reads a run's event files in name order, and a name is the second it was opened, then a counter
    of the process ("...10" sorts before "...8"): a resume within the second of the run before it (in the same
    Python process) could be read first, and the earlier file's steps would then purge its events."""
    seconds = [int(path.name.split(".")[3]) for path in folder.glob("events.out.tfevents.*")
               if path.name.split(".")[3].isdigit()]
    if seconds:
        time.sleep(max(0.0, max(seconds) + 1 - time.time()))


def scalars(split: str, values: dict) -> dict[str, float]:
    return {f"{split}/{key}": value for key, value in values.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def hyperparameters(config: Config, launch_info: dict) -> dict:
    """The resolved config as the flat keys `accel-train runs --diff` shows (`train.lr`, `model.args.width`), in
    the types trackers take (lists and empty mappings as JSON)."""
    tree = {**config.to_dict(), "run": {"recipe": config.recipe, "world_size": launch_info["world_size"],
                                        "mixed_precision": launch_info["mixed_precision"]}}
    return {key: json.dumps(value) if isinstance(value, (dict, list)) else value
            for key, value in flatten(tree).items() if value is not None}
