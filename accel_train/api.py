"""The Python API: train, evaluate and predict from a script; the command line is a thin layer over it.

    import accel_train

    metrics = accel_train.train("fashion_mnist_cnn", ["train.epochs=3", "output_dir=runs/mine"], model=MyNet())
    accel_train.evaluate("fashion_mnist_cnn", "runs/mine", model=MyNet())
    rows = accel_train.predict("fashion_mnist_cnn", "runs/mine", "photos/", output="predictions.csv")

A script that calls them runs under any launcher, unchanged: `python my_script.py`, `accelerate launch
--config_file accelerate_configs/multi_gpu.yaml my_script.py`, `torchrun --nproc_per_node 2 my_script.py`.
Every process runs the script, so it must build the same model and data on each (seed what is random).

`recipe` is a shipped recipe's name, a YAML file or a Config (`load_config`); `overrides` are `key=value`
strings as on the command line. Objects given (a task, a model, datasets) take the place of the names
the recipe gives; config.yaml records them as <module.Class>. Mistakes raise `accel_train.UserError`
with the one line the command line would print.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from accel_train.config import Config, load_config
from accel_train.errors import UserError
from accel_train.imports import given_object_name
from accel_train.installed import check_versions

if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset

    from accel_train.tasks import Task


def train(recipe: str | Config, overrides: Sequence[str] = (), *, model: torch.nn.Module | None = None,
          train_dataset: Dataset | None = None, eval_dataset: Dataset | None = None,
          task: Task | None = None) -> dict:
    """Train; returns the final evaluation's metrics (every process gets the same)."""
    from accel_train import loop

    config = _with_objects(_config(recipe, overrides), model, task, train_dataset, eval_dataset)
    if (train_dataset is None) != (eval_dataset is None):
        raise UserError("train_dataset and eval_dataset: give both, or neither (the recipe's data.name is used)")
    return loop.train(config, task=task, model=model, train_dataset=train_dataset, eval_dataset=eval_dataset)


def evaluate(recipe: str | Config, checkpoint: str, overrides: Sequence[str] = (), *,
             model: torch.nn.Module | None = None, eval_dataset: Dataset | None = None,
             task: Task | None = None) -> dict:
    """Metrics of the weights in `checkpoint` (a run folder, a checkpoint folder or a model.safetensors) on the
    evaluation data, over exactly its samples at any world size, plus `num_processes` (the world size)."""
    from accel_train import loop

    config = _with_objects(_config(recipe, overrides), model, task, None, eval_dataset)
    return loop.evaluate_checkpoint(config, str(checkpoint), task=task, model=model, eval_dataset=eval_dataset)


def predict(recipe: str | Config, checkpoint: str, inputs: str, overrides: Sequence[str] = (), *,
            output: str | None = None, model: torch.nn.Module | None = None, task: Task | None = None) -> list[dict]:
    """The top `predict.top_k` labels and scores of each image file under `inputs` (a file, a folder searched
    recursively, or a glob): rows {"path", "labels", "scores"} sorted by path, also written as CSV to `output`."""
    from accel_train.prediction import predict as run

    config = _with_objects(_config(recipe, overrides), model, task, None, None)
    return run(config, str(checkpoint), str(inputs), output, task=task, model=model)


def _config(recipe: str | Config, overrides: Sequence[str]) -> Config:
    check_versions()
    if isinstance(overrides, str):
        raise UserError(f"overrides: pass a list of key=value strings, e.g. [{overrides!r}]")
    if isinstance(recipe, Config):
        return load_config(recipe, overrides)
    return load_config(str(recipe), list(overrides))


def _with_objects(config: Config, model, task, train_dataset, eval_dataset) -> Config:
    """Record given objects in place of the names they replace, after checking what they are."""
    if model is not None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise UserError(f"model: found {type(model).__name__}, expected a torch.nn.Module")
        config.model.name = given_object_name(model)
    if task is not None:
        from accel_train.tasks import check_task

        check_task(task, "task")
        config.task = given_object_name(task)
    if eval_dataset is not None:
        config.data.name = given_object_name(train_dataset if train_dataset is not None else eval_dataset)
    return config
