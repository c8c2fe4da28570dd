"""An exponential moving average of the weights (train.ema_decay), through torch's AveragedModel.

Every process holds the same average, since every process has the same weights after a step. BatchNorm
buffers are averaged too (`use_buffers=True`). The average is registered with Accelerate for checkpointing,
so resume is exact, and it is exported beside the model as model_ema.safetensors. The averaged model keeps
its step counter on the CPU: updating it reads nothing back from the device.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import save_model
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from accel_train.errors import UserError

EMA_FILE = "model_ema.safetensors"


class WeightsEMA:
    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, decay: float) -> None:
        if str(accelerator.distributed_type).endswith("FSDP"):
            raise UserError("train.ema_decay is not available under FSDP yet: the average would need sharding too")
        self.accelerator = accelerator
        self.averaged = AveragedModel(accelerator.unwrap_model(model), multi_avg_fn=get_ema_multi_avg_fn(decay),
                                      use_buffers=True)
        accelerator.register_for_checkpointing(self.averaged)  # before load_state: a resume restores it

    @property
    def model(self) -> torch.nn.Module:
        return self.averaged.module

    def update(self, model: torch.nn.Module) -> None:
        """After each optimizer step (the first copies the weights)."""
        self.averaged.update_parameters(self.accelerator.unwrap_model(model))

    def export(self, output_dir: str) -> None:
        if self.accelerator.is_main_process:
            save_model(self.model, str(Path(output_dir) / EMA_FILE))
