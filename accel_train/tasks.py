"""A Task owns what differs between workloads: the model head, forward + loss, and evaluation metrics.

The training loop only calls the methods of `Task`, so every workload shares the same loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from accel_train.config import Config
from accel_train.data import ImageData
from accel_train.registry import Registry


class Task:
    def check_config(self, config: Config) -> None:
        """Reject names this task cannot build, before any data is loaded."""

    def build_model(self, config: Config, data: ImageData) -> nn.Module:
        raise NotImplementedError

    def training_step(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        """Scalar terms for this process's batch; "loss" is optimized, every term is logged."""
        raise NotImplementedError

    def eval_step(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        """Per-sample tensors (first dim = batch), gathered across processes by the loop."""
        raise NotImplementedError

    def new_metric(self):
        """A fresh `evaluate` metric whose add_batch takes the gathered eval_step output."""
        raise NotImplementedError

    def hooks(self, config: Config) -> list:
        """Main-process hooks this workload adds to the run (e.g. pictures after each evaluation)."""
        return []


TASKS: Registry[Task] = Registry("task", "task")


@TASKS.register("classification")
class ClassificationTask(Task):
    top_k = 5

    def check_config(self, config: Config) -> None:
        from accel_train.data import DATASETS
        from accel_train.models import check_model_name

        DATASETS.get(config.data.name)
        check_model_name(config.model.name)

    def build_model(self, config: Config, data: ImageData) -> nn.Module:
        from accel_train.models import build_classifier

        self.report_top5 = data.num_classes > self.top_k
        return build_classifier(config.model, data.num_classes, data.image_shape)

    def training_step(self, model, batch):
        images, labels = batch
        return {"loss": F.cross_entropy(model(images), labels)}

    def eval_step(self, model, batch):
        images, labels = batch
        logits = model(images)
        k = min(self.top_k, logits.shape[-1])
        return {
            "predictions": logits.topk(k, dim=-1).indices,
            "references": labels,
            "losses": F.cross_entropy(logits.float(), labels, reduction="none"),
        }

    def new_metric(self):
        from accel_train.metrics import ClassificationMetrics

        return _WithArgs(ClassificationMetrics(keep_in_memory=True), report_top5=self.report_top5)


class _WithArgs:
    """Binds compute() keyword arguments to an evaluate metric."""

    def __init__(self, metric, **compute_kwargs) -> None:
        self.metric, self.compute_kwargs = metric, compute_kwargs

    def add_batch(self, **columns) -> None:
        self.metric.add_batch(**{k: v.cpu().numpy() for k, v in columns.items()})

    def compute(self) -> dict:
        return self.metric.compute(**self.compute_kwargs)


# Workloads in their own modules register themselves on import.
from accel_train import vae  # noqa: E402, F401
