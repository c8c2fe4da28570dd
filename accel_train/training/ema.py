"""An exponential moving average of the weights (train.ema_decay), through torch's AveragedModel.

Every process holds the same average, since every process has the same weights after a step. BatchNorm
buffers are averaged too (`use_buffers=True`). The average (`averaged`, a torch module) is one of the loop's
stateful parts, saved with each checkpoint, so resume is exact; it is exported beside the model as
model_ema.safetensors. The averaged model keeps
its step counter on the CPU: updating it reads nothing back from the device.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from accel_train.errors import UserError


class WeightsEMA:
    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, decay: float) -> None:
        if str(accelerator.distributed_type).endswith("FSDP"):
            raise UserError("train.ema_decay is not available under FSDP yet: the average would need sharding too")
        self.accelerator = accelerator
        self.averaged = AveragedModel(accelerator.unwrap_model(model), multi_avg_fn=get_ema_multi_avg_fn(decay),
                                      use_buffers=True)

    @property
    def model(self) -> torch.nn.Module:
        return self.averaged.module

    def update(self, model: torch.nn.Module) -> None:
        """After each optimizer step (the first copies the weights)."""
        self.averaged.update_parameters(self.accelerator.unwrap_model(model))
