"""The collectives behind the loop's decisions: agreements over a CPU (gloo) group, which need no device sync,
and the gradient average of a step that ran without DDP's own all-reduce (micro_batch_size=auto)."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator


def any_process(flag: bool | torch.Tensor, accelerator: Accelerator) -> bool:
    """True on every process if `flag` is true on any: lets all processes stop (or skip) together.

    A host read: for decisions taken once (resume), not per step (see guard.py for the per-step one).
    """
    import torch

    flag = flag.float().reshape(1) if torch.is_tensor(flag) else torch.tensor([float(flag)], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


_CPU_GROUP: dict = {}  # the process group it was made in ("world") and the gloo group ("group")


def cpu_group(timeout_s: float):
    """The group processes agree over without touching the device: the default group where that is gloo (CPU
    training), else a gloo group beside NCCL's, made once per process group. The first call must come at the same
    point on every process (torch's new_group requires it); later calls return the same group."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    if _CPU_GROUP.get("world") is not dist.group.WORLD:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        _CPU_GROUP.update(world=dist.group.WORLD, group=group)
    return _CPU_GROUP["group"]


def processes_where(flag: bool, accelerator: Accelerator, timeout_s: float) -> list[int]:
    """The processes on which `flag` is true, on every process: one all-reduce (max) of a CPU tensor of one flag per
    process over the CPU group. Values the host already holds, so no device-to-host read; a network round trip per
    call on several machines (docs/scale.md measures it)."""
    if accelerator.num_processes == 1:
        return [0] if flag else []
    import torch
    import torch.distributed as dist

    flags = torch.zeros(accelerator.num_processes)
    flags[accelerator.process_index] = float(flag)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=cpu_group(timeout_s))
    return [process for process, value in enumerate(flags.tolist()) if value]


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def average_gradients(model: torch.nn.Module, accelerator: Accelerator) -> None:
    """After backward passes under no_sync: every process's gradients become their mean over the processes, and
    process 0's buffers (BatchNorm statistics) every process's, as DDP's all-reduce in backward and its buffer
    broadcast before the next forward would have made them. Flat buckets over the default (device) group."""
    # Hand-written: Accelerate offers no "sync now" once backward has run under no_sync (its trigger_sync_in_backward
    # needs a backward still to come), and DDP's reducer all-reduces only from inside a backward pass.
    if accelerator.num_processes == 1:
        return
    import torch
    import torch.distributed as dist

    gradients = []
    for parameter in model.parameters():
        if parameter.requires_grad:
            if parameter.grad is None:  # unused this step: DDP's zeros, so every process reduces the same tensors
                parameter.grad = torch.zeros_like(parameter)
            gradients.append(parameter.grad)
    world = accelerator.num_processes
    for flat in _coalesced(gradients):
        flat.div_(world)  # then summed: DDP's default hook (allreduce_hook) does the same
        dist.all_reduce(flat)
    if getattr(model, "broadcast_buffers", False):
        for flat in _coalesced(list(model.buffers())):
            dist.broadcast(flat, src=0)


def _coalesced(tensors: list[torch.Tensor]):
    """Yields flat buckets of `tensors` (grouped by dtype and device, up to BUCKET_BYTES); what is done to a bucket
    while the caller holds it is copied back into its tensors."""
    import torch

    groups: dict = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group in groups.values():
        bucket, size = [], 0
        for index, tensor in enumerate(group):
            bucket.append(tensor)
            size += tensor.numel() * tensor.element_size()
            if size >= BUCKET_BYTES or index == len(group) - 1:
                flat = torch.cat([part.reshape(-1) for part in bucket])
                yield flat
                for part, synced in zip(bucket, flat.split([part.numel() for part in bucket])):
                    part.copy_(synced.view_as(part))
                bucket, size = [], 0


def first_message(message: str | None, accelerator: Accelerator) -> str | None:
    """The first process's message, on every process (None where no process has one): one line for all."""
    from accelerate.utils import gather_object

    found = [(rank, text) for rank, text in enumerate(gather_object([message])) if text is not None]
    if not found:
        return None
    rank, text = found[0]
    return f"process {rank}: {text}" if accelerator.num_processes > 1 else text


def main_value(value, accelerator: Accelerator):
    """The main process's `value` (any picklable object), on every process."""
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value])[0] if accelerator.num_processes > 1 else value


LOST_PEER = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "NCCL communicator",
             "ProcessGroupNCCL", "Broken pipe", "timeout caused pair closure")  # the last: gloo's, from a backward


def lost_a_peer(err: BaseException) -> bool:
    """Whether a collective failed because another process died or stopped answering (torch raises a RuntimeError
    from gloo's or NCCL's transport, or one of its DistError classes)."""
    import torch

    distributed_error = getattr(torch.distributed, "DistError", ())
    return isinstance(err, distributed_error) or (isinstance(err, RuntimeError)
                                                  and any(marker in str(err) for marker in LOST_PEER))
