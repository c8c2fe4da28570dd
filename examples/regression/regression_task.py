"""Your own Task, for a problem that is not classification: regression, with MSE and MAE as eval metrics.

A Task owns what differs between workloads: the loss of a training batch, the per-sample values an
evaluation gathers, and the metric over them. The loop, the launchers, checkpoints, exact evaluation at
any world size and the non-finite guard stay accel-train's. The recipe beside this file names the task
(`task: regression_task:Regression`) and the model (`model.name: regression_task:MLP`) by import path.
"""

import torch
import torch.nn.functional as F
from torch import nn

import accel_train


class MLP(nn.Module):
    """A small fully connected network; accel-train passes image_shape (the shape of one input: here (1,))."""

    def __init__(self, image_shape: tuple[int, ...], hidden: int = 64, layers: int = 2) -> None:
        super().__init__()
        widths = [image_shape[0], *[hidden] * layers]
        blocks = [module for a, b in zip(widths, widths[1:]) for module in (nn.Linear(a, b), nn.Tanh())]
        self.net = nn.Sequential(*blocks, nn.Linear(widths[-1], 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Regression(accel_train.Task):
    def training_step(self, model, batch):
        x, y = batch
        return {"loss": F.mse_loss(model(x), y)}  # every term returned is averaged over processes and logged

    def eval_step(self, model, batch):
        x, y = batch
        error = model(x) - y
        # One value per sample: the loop gathers them over processes, without the padding of the last batch.
        return {"mse": error.pow(2).mean(dim=1), "mae": error.abs().mean(dim=1)}

    def new_metric(self):
        return accel_train.mean_metric("mse", "mae")  # exact means over the evaluated samples, and num_samples
