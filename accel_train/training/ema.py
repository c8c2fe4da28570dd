"""An exponential moving average of the weights (train.ema_decay), kept in torch's AveragedModel.

Every process holds the same average, since every process has the same weights after a step. BatchNorm
buffers are averaged too (`use_buffers=True`). The average (`averaged`, a torch module) is one of the loop's
stateful parts, saved with each checkpoint, so resume is exact; it is exported beside the model as
model_ema.safetensors.

AveragedModel's own update reads its step counter on the host at every step and copies it to the device, which on
a GPU makes each step wait for the ones before it. AveragedOnDevice does the same arithmetic (torch's EMA: the first
update copies the weights, each later one interpolates by 1 - decay) with nothing read back: whether an update is
the first is known on the host, and the counter, kept for the checkpoint's sake, lives on the model's device.
"""

from __future__ import annotations

from itertools import chain

import torch
from accelerate import Accelerator
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from accel_train.errors import UserError


class AveragedOnDevice(AveragedModel):
    """torch's EMA of a model's parameters and buffers, on `device`, updated without a host read."""

    def __init__(self, model: torch.nn.Module, decay: float, device: torch.device) -> None:
        # torch's public EMA of a list of tensors, in place (a for-each lerp: one kernel a device and dtype); our
        # update_parameters calls it without AveragedModel's host read
        super().__init__(model, device=device, use_buffers=True, multi_avg_fn=get_ema_multi_avg_fn(decay))
        self.decay = decay
        self.copies_next = True  # the first update copies the weights; a restored average has had its first

    @torch.no_grad()
    def update_parameters(self, model: torch.nn.Module) -> None:
        pairs = list(zip(chain(self.module.parameters(), self.module.buffers()),
                         chain(model.parameters(), model.buffers())))
        floats = [(average, now) for average, now in pairs if average.is_floating_point()]
        if self.copies_next:
            for average, now in floats:
                average.copy_(now)
        elif floats:
            self.multi_avg_fn([average for average, _ in floats], [now for _, now in floats], self.n_averaged)
        for average, now in pairs:
            if not average.is_floating_point():  # counters (BatchNorm's batches seen) follow the model
                average.copy_(now)
        self.n_averaged += 1
        self.copies_next = False

    def load_state_dict(self, state_dict, *args, **kwargs):
        loaded = super().load_state_dict(state_dict, *args, **kwargs)
        self.copies_next = False  # a checkpoint comes after a step, so after the first update
        return loaded


class WeightsEMA:
    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, decay: float) -> None:
        if str(accelerator.distributed_type).endswith("FSDP"):
            raise UserError("train.ema_decay is not available under FSDP yet: the average would need sharding too")
        self.accelerator = accelerator
        self.averaged = AveragedOnDevice(accelerator.unwrap_model(model), decay, accelerator.device)

    @property
    def model(self) -> torch.nn.Module:
        return self.averaged.module

    def update(self, model: torch.nn.Module) -> None:
        """After each optimizer step (the first copies the weights)."""
        self.averaged.update_parameters(self.accelerator.unwrap_model(model))
