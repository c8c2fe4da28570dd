"""Running out of device memory: recognised whichever allocator raised it, and, where a smaller micro-batch is not
taken or does not help, one line saying what to change (OutOfDeviceMemory, exit 2)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from accelerate import Accelerator

from accel_train.config import TrainConfig
from accel_train.distributed.accelerator import shards_gradients
from accel_train.errors import OutOfDeviceMemory

SMALLER_MODEL = "use a smaller model or image size, mixed precision, or FSDP"


def ran_out_of_memory(err: BaseException) -> bool:
    """torch's out-of-memory error (torch.cuda.OutOfMemoryError is the same class), or what Accelerate's batch-size
    search takes for running out (the CPU allocator's, MPS's)."""
    from accelerate.utils.memory import should_reduce_batch_size

    return isinstance(err, torch.OutOfMemoryError) or should_reduce_batch_size(err)


@contextmanager
def out_of_memory_stops(accelerator: Accelerator, where: str, cfg: TrainConfig | None = None):
    """Running out of device memory inside becomes one line (OutOfDeviceMemory, exit 2) saying what to change.
    `where`: "micro-batch" (fixed by the config, or FSDP's), "optimizer step" (which no micro-batch helps), or
    "evaluation" (`accel-train eval`, and training but with micro_batch_size=auto under DDP)."""
    try:
        yield
    except Exception as err:
        if not ran_out_of_memory(err):
            raise
        raise OutOfDeviceMemory(f"ran out of {accelerator.device.type} memory {_remedy(accelerator, where, cfg)}") \
            from None


def _remedy(accelerator: Accelerator, where: str, cfg: TrainConfig | None) -> str:
    fsdp = shards_gradients(accelerator)
    if where == "optimizer step":
        return ("in the optimizer step, which a smaller micro-batch does not help (the optimizer's state and the "
                "gradients do not depend on it); use a smaller model, an optimizer with less state "
                "(train.optimizer=sgd), mixed precision, or FSDP")
    if where == "evaluation":
        return "evaluating; set a smaller train.eval_batch_size (the metrics do not depend on it)"
    micro = cfg.batch_size // accelerator.num_processes // accelerator.gradient_accumulation_steps
    if fsdp:
        return (f"with {micro} sample(s) per micro-batch; under FSDP the micro-batch is not halved on the way (its "
                "gradients are sharded: train.micro_batch_size=auto recovers under DDP only), so set a smaller "
                "train.micro_batch_size")
    return (f"with {micro} sample(s) per micro-batch, fixed by train.micro_batch_size or train.accumulation_steps; set "
            "train.micro_batch_size=auto to go on with half the micro-batch whenever a step runs out (the same global "
            "batch), or a smaller train.micro_batch_size")
