"""The devices torch sees on this machine, and the CPU cores each process may use."""

from __future__ import annotations

import os

from accel_train.distributed.environment import launcher_environment


def has_accelerator_device() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def cores_per_process() -> int:
    """The CPU cores this process may use divided among the processes on this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores // (launcher_environment().local_world_size or 1)


def dataloader_workers(requested: int | str) -> int:
    """data.num_workers: a number as given; auto, the cores per process (torch warns above the cores it sees),
    at most 8."""
    return int(requested) if requested != "auto" else min(8, cores_per_process())


def finish_runs_in_workers(device, workers: int) -> bool:
    """Where a dataset's finish (uint8 batches made into the model's input: scaled, normalised, crops resized) runs
    for a run that trains on `device` with `workers` DataLoader workers a process. On a CPU with workers, in the
    workers, as part of their collation: there the device is the main process's own cores, which would finish every
    batch beside the model while the workers wait. On a GPU (or any other device), and without workers, on the device
    after the copy, as before: the device finishes a batch in its own stream and the host copies a quarter of the
    bytes (uint8). The same operations on the same values either way, so the same inputs bit for bit."""
    import torch

    return torch.device(device).type == "cpu" and workers > 0


def cpu_has_bf16() -> bool:
    """Whether oneDNN has native bf16 kernels here (AVX512-BF16 / AMX); without them autocast only emulates."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def visible_devices() -> tuple[str, str, list[str], str]:
    """The device type ("cuda", "xpu" or "cpu"), its process-group backend, the device names, and one line
    saying what is visible."""
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return "cuda", "nccl", names, f"{len(names)} CUDA GPU(s): {', '.join(names)}"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        names = [f"xpu:{i}" for i in range(torch.xpu.device_count())]
        return "xpu", "xccl", names, f"{len(names)} Intel XPU(s)"
    return "cpu", "gloo", [], f"no GPU visible; CPU with {os.cpu_count()} cores"


def set_numerics(deterministic: bool, tf32: bool | str) -> None:
    """How this process computes on GPUs: train.deterministic and train.tf32 (docs/contracts.md's table says what
    each gives). Set before the model first runs: cuBLAS reads its workspace setting when it starts."""
    import torch

    use_tf32 = not deterministic if tf32 == "auto" else bool(tf32)
    torch.backends.cuda.matmul.allow_tf32 = use_tf32
    torch.backends.cudnn.allow_tf32 = use_tf32
    # benchmark: input shapes are fixed per run, so autotuning pays once; but the algorithm it picks may change from
    # run to run, and with it the last bits
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.deterministic = deterministic
    # warn_only: an operation without a deterministic kernel says so once and runs as it is, rather than failing
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    if deterministic:  # cuBLAS's own condition for reproducible matrix products (CUDA 10.2 and newer)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
