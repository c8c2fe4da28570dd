"""The Task interface: the training loop only calls these methods, so every workload shares the same loop."""

from __future__ import annotations

import torch
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

    def observers(self, config: Config) -> list:
        """Main-process observers this workload adds to a training run (e.g. pictures after each evaluation)."""
        return []


TASKS: Registry[Task] = Registry("task", "task")


class WithComputeArgs:
    """Binds compute() keyword arguments to an evaluate metric."""

    def __init__(self, metric, **compute_kwargs) -> None:
        self.metric, self.compute_kwargs = metric, compute_kwargs

    def add_batch(self, **columns) -> None:
        self.metric.add_batch(**{k: v.cpu().numpy() for k, v in columns.items()})

    def compute(self) -> dict:
        return self.metric.compute(**self.compute_kwargs)

