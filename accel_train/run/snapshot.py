"""A checkpoint's state copied to host memory while training waits, then written as Accelerate's own files while it
goes on.

Accelerate's save_state writes synchronously (accelerate #3746), so training would wait for the disk and the
store. Here it waits only while the tensors are queued for copying into host buffers kept from one save to the next:
from a CUDA device into pinned memory, asynchronously, on the training stream (so the next step's updates come after
them), and the writer waits for an event recorded after the copies before it reads a byte. The files are those
save_state writes, by the same names and serializers, so accelerator.load_state reads them as its own. What this
cannot copy the same way (FSDP, DeepSpeed, a loader whose sampler Accelerate saves, a device other than CPU or CUDA)
is saved by save_state itself.

What save_state saves is what the run prepared: the run says so (`Prepared`), in the order it prepared them
(save_state numbers the files so), rather than this module reading Accelerate's private lists, which any release may
rename; beside them, accel-train's own parts with tensors (the EMA) as safetensors.
tests/checkpoints/test_a_slow_save_never_mixes_two_steps.py holds the two to the same files.

No buffer is copied into while a write may still read it, or a checkpoint could mix two steps. A save normally finds
the previous write done and reuses its buffers; when that write outlasted checkpoint.upload_wait_s and training went
on, the save takes a second set. When both are still held (the writer is stuck: a third copy would only queue behind
them), the save is skipped (`free` says so, and every process agrees) rather than wait on a stuck disk or store
without bound or hold more host memory: at most two copies of a process's state, the second only made when needed.
"""

from __future__ import annotations

import copy
import queue
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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

from accel_train.run.checkpoint_files import TENSOR_PART

BUFFER_SETS = 2  # one for the write under way, one for the save after it (module docstring)


@dataclass
class Prepared:
    """What accelerator.save_state saves of a run: each kind in the order the run prepared (or registered) it."""

    models: Sequence[torch.nn.Module]
    optimizers: Sequence[torch.optim.Optimizer] = ()
    schedulers: Sequence[object] = ()
    loaders: Sequence[object] = ()  # prepared DataLoaders: save_state saves the state of some (see _copyable)
    # accel-train's own parts with tensors (the EMA), written beside save_state's files as NAME.safetensors
    parts: dict[str, torch.nn.Module] = field(default_factory=dict)


@dataclass
class Snapshot:
    """A process's share of a checkpoint in host memory: {file name: (state, safetensors or not)}."""

    files: dict[str, tuple[object, bool]]
    buffers: dict[str, torch.Tensor]  # the set its tensors are in: free again once they are written
    copied: torch.cuda.Event | None  # recorded after the copies from a CUDA device: until then they are not all there


class Snapshots:
    """Takes a process's share of a checkpoint into reused host buffers, and writes it."""

    def __init__(self) -> None:
        # last written, first taken: the second set is filled only while the first is still being written
        self.free_sets: queue.LifoQueue[dict[str, torch.Tensor]] = queue.LifoQueue()
        for _ in range(BUFFER_SETS):
            self.free_sets.put({})

    def free(self) -> bool:
        """Whether `take` has buffers that no write reads any more."""
        return not self.free_sets.empty()

    def take(self, accelerator: Accelerator, prepared: Prepared) -> Snapshot | None:
        """This process's files as save_state would write them now (once `free`), of what the run `prepared`; None
        when save_state must write them itself."""
        if not _copyable(accelerator, prepared):
            return None
        buffers = self.free_sets.get_nowait()
        files: dict[str, tuple[object, bool]] = {}
        if accelerator.is_main_process:  # accelerate's save() writes these on the main process only
            for index, model in enumerate(prepared.models):
                # save_state saves the model as prepare found it, inside DDP's wrapper (no "module." in its names)
                state = accelerator.get_state_dict(accelerator.unwrap_model(model, keep_fp32_wrapper=True,
                                                                            keep_torch_compile=True), unwrap=False)
                files[_numbered(SAFE_WEIGHTS_NAME, index)] = (_copy(buffers, f"model{index}", dict(state)), True)
            for index, optimizer in enumerate(prepared.optimizers):
                files[_numbered(f"{OPTIMIZER_NAME}.bin", index)] = (_copy(buffers, f"opt{index}",
                                                                           optimizer.state_dict()), False)
            for index, scheduler in enumerate(prepared.schedulers):
                files[_numbered(f"{SCHEDULER_NAME}.bin", index)] = (_copy(buffers, f"lr{index}",
                                                                           scheduler.state_dict()), False)
            if accelerator.scaler is not None:
                files[SCALER_NAME] = (_copy(buffers, "scaler", accelerator.scaler.state_dict()), False)
            for name, part in prepared.parts.items():
                files[TENSOR_PART.format(name=name)] = (_copy(buffers, f"part/{name}", part.state_dict()), True)
        rng = {"step": accelerator.step, "random_state": random.getstate(),
               "numpy_random_seed": np.random.get_state(), "torch_manual_seed": torch.get_rng_state()}
        copied = None
        if torch.cuda.is_available():
            rng["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
        if accelerator.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(accelerator.device))  # the stream the copies were queued on
        files[f"{RNG_STATE_NAME}_{accelerator.process_index}.pkl"] = (rng, False)
        return Snapshot(files, buffers, copied)

    def write(self, snapshot: Snapshot, folder: Path) -> list[str]:
        """The files of `take`, written into `folder` as save_state writes them; their names. Its buffers are free
        again after."""
        try:
            if snapshot.copied is not None:
                snapshot.copied.synchronize()  # the copies from the device were only queued
            folder.mkdir(parents=True, exist_ok=True)
            for name, (state, safe) in snapshot.files.items():
                if name.startswith(RNG_STATE_NAME):
                    torch.save(state, folder / name)  # every process writes its own, as in save_state
                else:
                    accelerate_save(state, folder / name, safe_serialization=safe)
        finally:
            self.free_sets.put(snapshot.buffers)
        return list(snapshot.files)


def _copy(buffers: dict[str, torch.Tensor], key: str, value):
    """`value` with every tensor copied into this key's buffer in `buffers` (made once, reused while shapes hold) and
    every container new, so training may change the originals at once."""
    if isinstance(value, torch.Tensor):
        buffer = buffers.get(key)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            # contiguous whatever the source's layout (channels_last): safetensors writes no other. Pinned for a
            # CUDA source: the copy then runs asynchronously at full speed (never asked for without CUDA: it raises)
            buffer = buffers[key] = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=value.is_cuda)
        return buffer.copy_(value.detach(), non_blocking=value.is_cuda)
    if isinstance(value, Mapping):
        return {name: _copy(buffers, f"{key}/{name}", item) for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(buffers, f"{key}/{index}", item) for index, item in enumerate(value))
    return copy.deepcopy(value)  # numbers and strings as they are; any other object as it is now


def _copyable(accelerator: Accelerator, prepared: Prepared) -> bool:
    from accelerate.data_loader import IterableDatasetShard

    plain = accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
    saved_loaders = any(isinstance(loader.dataset, IterableDatasetShard) or getattr(loader, "use_stateful_dataloader",
                                                                                     False)
                        for loader in prepared.loaders)
    return plain and accelerator.device.type in ("cpu", "cuda") and not saved_loaders


def _numbered(name: str, index: int) -> str:
    stem, dot, suffix = name.partition(".")
    return name if index == 0 else f"{stem}_{index}{dot}{suffix}"
