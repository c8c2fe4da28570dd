"""The Task interface: the training loop only calls these methods, so every workload shares the same loop.

A user's Task subclasses `accel_train.Task`; a recipe names it by import path (`task: my_tasks:Regression`) or
a script passes an instance to `accel_train.train(task=...)`. It must define training_step, eval_step and
new_metric; the rest has defaults.
"""

from __future__ import annotations

import torch
from torch import nn

from accel_train.config import Config
from accel_train.data import Data
from accel_train.errors import UserError, did_you_mean
from accel_train.import_paths import import_object, is_import_path
from accel_train.registry import Registry

REQUIRED = ("training_step", "eval_step", "new_metric")


class Task:
    # The evaluation metrics this task reports, each with whether higher ("max") or lower ("min") is better: checked
    # before a sweep starts (--metric), and its default direction. None: known only from the first evaluation.
    metrics: dict[str, str] | None = None

    def check_config(self, config: Config) -> None:
        """Before any data loads: reject names and import paths this task cannot build, and resolve what the
        config leaves to them (the pretrained weights' normalisation)."""
        from accel_train.data import check_data_name
        from accel_train.workloads.inputs import check_channels, take_defaults
        from accel_train.workloads.models import check_model, input_defaults

        check_data_name(config.data)
        check_model(config.model)
        # the inputs the model expects (its weights were trained on): the data keys left unset; recorded in
        # config.yaml, so eval, predict and a resume agree
        defaults = input_defaults(config.model)
        take_defaults(config.data, defaults)
        check_channels(config.data, defaults, config.model.name)

    def setup(self, config: Config, data: Data) -> None:
        """Once before training, evaluation or prediction, with the data the model is built for: keep what the
        other methods need (the number of classes, a loss weight from the config)."""

    def build_model(self, config: Config, data: Data) -> nn.Module:
        """The model model.name names, for this data: a registered or torchvision model, or the user's by import
        path, called with num_classes and image_shape where it takes them, and model.args."""
        from accel_train.workloads.models import build_model

        return build_model(config.model, data.num_classes, data.image_shape, data.classes)

    def training_step(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        """Scalar terms for this process's batch; "loss" is optimized, every term is logged."""
        raise NotImplementedError

    def mix_batch(self, batch, epoch: int, number: int):
        """The training batch the model sees (MixUp / CutMix for classification): a function of the batch, the
        epoch and the micro-batch's number in it only, so resume and world size do not change it."""
        return batch

    def eval_step(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        """Per-sample tensors (first dim = batch), gathered across processes by the loop."""
        raise NotImplementedError

    def new_metric(self):
        """A fresh metric: add_batch(**columns) takes the gathered eval_step output, compute() returns a dict.

        An `evaluate` metric fits, and so does `accel_train.mean_metric(*names)`."""
        raise NotImplementedError

    def predict_step(self, model: nn.Module, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-sample predictions for a batch of inputs (accel-train predict): "labels" and "scores", each
        (batch, top_k), best first."""
        raise UserError(f"task {type(self).__name__} does not predict labels; accel-train predict needs a task "
                        "with predict_step (classification has one)")

    def observers(self, config: Config) -> list:
        """Main-process observers this workload adds to a training run (e.g. pictures after each evaluation)."""
        return []


def check_mixing(task: Task, config: Config) -> None:
    """MixUp / CutMix asked of a task that does not mix its batches would silently train without them."""
    if (config.train.mixup_alpha or config.train.cutmix_alpha) and type(task).mix_batch is Task.mix_batch:
        raise UserError(f"train.mixup_alpha / train.cutmix_alpha: MixUp and CutMix mix class labels; task="
                        f"{config.task} does not mix its batches (classification does)")


def reported_metrics(task: Task, config: Config) -> dict[str, str] | None:
    """The evaluation metrics a run of `task` reports, each with the way that is better ("max" or "min"): the task's
    own, and the raw model's (raw_*) beside an EMA of the weights; None where the task does not say which."""
    if task.metrics is None:
        return None
    raw = {f"raw_{name}": mode for name, mode in task.metrics.items()} if config.train.ema_decay else {}
    return {**task.metrics, **raw}


def check_selection_metrics(task: Task, config: Config) -> None:
    """checkpoint.best_metric and train.early_stop_metric name metrics the task reports: a typo would otherwise be
    found only at the first evaluation, after a whole epoch."""
    known = reported_metrics(task, config)
    for key, name in (("checkpoint.best_metric", config.checkpoint.best_metric),
                      ("train.early_stop_metric", config.train.early_stop_metric)):
        if known is not None and name is not None and name not in known:
            raise UserError(f"{key}={name} is not an evaluation metric of task={config.task}{did_you_mean(name, known)}"
                            f"; it reports {', '.join(known)}")


TASKS: Registry[Task] = Registry("task", "task")


def task_named(name: str) -> Task:
    """The Task `task` names: one of the registry, or the user's subclass by import path."""
    found = import_object(name, "task") if is_import_path(name) else TASKS.get(name)
    if not (isinstance(found, type) and issubclass(found, Task)):
        raise UserError(f"task={name}: found {type(found).__name__} {getattr(found, '__name__', found)!r}, expected "
                        "a subclass of accel_train.Task")
    try:
        task = found()
    except TypeError as err:
        raise UserError(f"task={name}: {found.__name__}() failed ({err}); a Task is made without arguments and "
                        "reads the config in setup()") from None
    check_task(task, f"task={name}")
    return task


def check_task(task: Task, where: str) -> None:
    """A user's Task defines what the base class leaves open."""
    if not isinstance(task, Task):
        raise UserError(f"{where}: found {type(task).__name__}, expected an instance of a subclass of accel_train.Task")
    missing = [name for name in REQUIRED if getattr(type(task), name) is getattr(Task, name)]
    if missing:
        raise UserError(f"{where}: {type(task).__name__} does not define {', '.join(missing)}; a Task defines "
                        f"{', '.join(REQUIRED)}")


class WithComputeArgs:
    """Binds compute() keyword arguments to an evaluate metric."""

    def __init__(self, metric, **compute_kwargs) -> None:
        self.metric, self.compute_kwargs = metric, compute_kwargs

    def add_batch(self, **columns) -> None:
        self.metric.add_batch(**{k: v.cpu().numpy() for k, v in columns.items()})

    def compute(self) -> dict:
        return self.metric.compute(**self.compute_kwargs)


def mean_metric(*names: str) -> WithComputeArgs:
    """A metric for a Task's new_metric: the mean of each named per-sample value that eval_step returns, over
    exactly the evaluated samples at any world size, and num_samples."""
    from accel_train.workloads.metrics import MeanValues, in_memory

    return WithComputeArgs(in_memory(MeanValues, names))
