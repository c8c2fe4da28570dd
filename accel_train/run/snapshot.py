"""A checkpoint's state copied to host memory while training waits, then written as Accelerate's own files while it
goes on.

Accelerate's save_state writes synchronously (accelerate #3746), so training would wait for the disk and the
store. Here it waits only for copies of the tensors into host buffers kept from one save to the next (the next save
waits for the previous write before it copies again); the files are those save_state writes, by the same names and
serializers, so accelerator.load_state reads them as its own. What this cannot copy the same way (FSDP, DeepSpeed,
a loader whose sampler Accelerate saves, a device other than CPU or CUDA) is saved by save_state itself.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import (
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_WEIGHTS_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    DistributedType,
)
from accelerate.utils import save as accelerate_save


class Snapshots:
    """Takes a process's share of a checkpoint into reused host buffers, and writes it."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, accelerator: Accelerator) -> dict[str, tuple[object, bool]] | None:
        """{file name: (state, safetensors or not)} of this process, as save_state would write them now; None when
        save_state must write them itself."""
        if not _copyable(accelerator):
            return None
        files: dict[str, tuple[object, bool]] = {}
        if accelerator.is_main_process:  # accelerate's save() writes these on the main process only
            for index, model in enumerate(accelerator._models):
                state = accelerator.get_state_dict(model, unwrap=False)
                files[_numbered(SAFE_WEIGHTS_NAME, index)] = (self._copy(f"model{index}", dict(state)), True)
            for index, optimizer in enumerate(accelerator._optimizers):
                files[_numbered(f"{OPTIMIZER_NAME}.bin", index)] = (self._copy(f"opt{index}", optimizer.state_dict()),
                                                                     False)
            for index, scheduler in enumerate(accelerator._schedulers):
                files[_numbered(f"{SCHEDULER_NAME}.bin", index)] = (self._copy(f"lr{index}", scheduler.state_dict()),
                                                                     False)
            if accelerator.scaler is not None:
                files[SCALER_NAME] = (self._copy("scaler", accelerator.scaler.state_dict()), False)
            for index, part in enumerate(accelerator._custom_objects):
                files[f"custom_checkpoint_{index}.pkl"] = (self._copy(f"custom{index}", part.state_dict()), False)
        rng = {"step": accelerator.step, "random_state": random.getstate(),
               "numpy_random_seed": np.random.get_state(), "torch_manual_seed": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
        files[f"{RNG_STATE_NAME}_{accelerator.process_index}.pkl"] = (rng, False)
        return files

    def _copy(self, key: str, value):
        """`value` with every tensor copied into this key's host buffer (made once, reused while shapes hold) and
        every container new, so training may change the originals at once."""
        if isinstance(value, torch.Tensor):
            buffer = self.buffers.get(key)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                # contiguous whatever the source's layout (channels_last): safetensors writes no other
                buffer = self.buffers[key] = torch.empty(value.shape, dtype=value.dtype, device="cpu")
            return buffer.copy_(value.detach())
        if isinstance(value, Mapping):
            return {name: self._copy(f"{key}/{name}", item) for name, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(f"{key}/{index}", item) for index, item in enumerate(value))
        return copy.deepcopy(value)  # numbers and strings as they are; any other object as it is now


def write(files: dict[str, tuple[object, bool]], folder: Path) -> list[str]:
    """The files of `take`, written into `folder` as save_state writes them; their names."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (state, safe) in files.items():
        if name.startswith(RNG_STATE_NAME):
            torch.save(state, folder / name)  # every process writes its own, as in save_state
        else:
            accelerate_save(state, folder / name, safe_serialization=safe)
    return list(files)


def _copyable(accelerator: Accelerator) -> bool:
    from accelerate.data_loader import IterableDatasetShard

    plain = accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
    saved_loaders = any(isinstance(loader.dataset, IterableDatasetShard) or getattr(loader, "use_stateful_dataloader",
                                                                                     False)
                        for loader in accelerator._dataloaders)
    return plain and accelerator.device.type in ("cpu", "cuda") and not saved_loaders


def _numbered(name: str, index: int) -> str:
    stem, dot, suffix = name.partition(".")
    return name if index == 0 else f"{stem}_{index}{dot}{suffix}"
