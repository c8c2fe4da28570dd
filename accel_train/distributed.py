"""Everything about processes and devices lives here; no other module reads ranks or environment variables.

The rest of the package sees an `Accelerator` and calls `prepare`, `backward`, `gather_for_metrics`
and Accelerator's main-process helpers.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

from accel_train.errors import LaunchError, UserError

if TYPE_CHECKING:  # torch and accelerate load lazily so the CLI can report errors without them
    import torch
    from accelerate import Accelerator


def has_accelerator_device() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def launcher_world_size() -> int | None:
    """The world size torchrun / accelerate launch asked for, or None when run as a plain process."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


def launcher_ranks() -> tuple[int, int]:
    """(global rank, rank on this node) the launcher gave this process; (0, 0) for a plain process."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))


def is_reporting_process() -> bool:
    """True on the one process that should print user errors raised before the Accelerator exists."""
    return launcher_ranks()[0] == 0


def make_accelerator(seed: int, collective_timeout_s: float = 600) -> Accelerator:
    """An Accelerator that forms a real process group on whatever hardware is present.

    Batches are split (train.batch_size is global) so N processes x B/N == 1 process x B, the LR
    scheduler steps once per optimizer step at any world size, and the seedable sampler makes the
    data order a function of (seed, epoch) alone. A collective that waits longer than
    `collective_timeout_s` (a peer died or hangs) fails the job instead of hanging for NCCL's 30 minutes.
    """
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs

    use_cpu = not has_accelerator_device()
    mixed_precision = None  # None = whatever the launch profile says
    requested = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if use_cpu and requested == "fp16":
        if is_reporting_process():
            print("accel-train: warning: fp16 mixed precision is unavailable on CPU; training in fp32", file=sys.stderr)
        mixed_precision = "no"
    # Without cpu=True, Accelerate on a GPU-less box under a multi-process launcher silently
    # trains N independent copies instead of joining one gloo process group.
    accelerator = Accelerator(
        cpu=use_cpu,
        mixed_precision=mixed_precision,
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, data_seed=seed),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=collective_timeout_s))],
    )
    expected = launcher_world_size()
    if expected is not None and expected != accelerator.num_processes:
        raise LaunchError(
            f"the launcher started {expected} processes but only {accelerator.num_processes} joined the run "
            f"(distributed type {accelerator.distributed_type}); check the launch profile and device visibility"
        )
    return accelerator


def per_process_batch(global_batch: int, accelerator: Accelerator, key: str) -> int:
    """Check that a global batch splits evenly across processes (Accelerate's split_batches needs it)."""
    n = accelerator.num_processes
    if global_batch % n:
        lower, upper = (global_batch // n) * n, (global_batch // n + 1) * n
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        raise UserError(f"{key}={global_batch} does not split evenly across {n} processes; use a multiple of {n}, e.g. {hint}")
    return global_batch // n


def round_up_to_world(batch: int, accelerator: Accelerator) -> int:
    """Evaluation batch sizes do not change results, so round them up to split evenly instead of failing."""
    n = accelerator.num_processes
    return -(-batch // n) * n


def maybe_sync_batchnorm(model: torch.nn.Module, enabled: bool, accelerator: Accelerator) -> torch.nn.Module:
    if not enabled or accelerator.num_processes == 1:
        return model
    if accelerator.device.type == "cpu":
        accelerator.print("model.sync_batchnorm ignored: SyncBatchNorm needs a GPU; each CPU process keeps its own statistics")
        return model
    import torch

    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)


def tune_for_device(model: torch.nn.Module, accelerator: Accelerator, channels_last: bool,
                    compile: bool = False) -> torch.nn.Module:
    """Device-level speed switches, applied where the model is built (before prepare)."""
    import torch

    if accelerator.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # input shapes are fixed per run, so the autotuning pays once
    if channels_last and any(isinstance(m, torch.nn.Conv2d) for m in model.modules()):
        model = model.to(memory_format=torch.channels_last)
    if compile:
        # In place rather than torch.compile(model): no `_orig_mod.` wrapper, so the state_dict keys, the
        # exported model.safetensors and checkpoints are exactly those of the uncompiled model.
        model.compile()
    return model


def any_process(flag: bool | torch.Tensor, accelerator: Accelerator) -> bool:
    """True on every process if `flag` is true on any: lets all processes stop (or skip) together.

    `flag` may be a one-element tensor on the device, which saves a host sync before the reduction.
    """
    import torch

    flag = flag.float().reshape(1) if torch.is_tensor(flag) else torch.tensor([float(flag)], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


TEST_NONFINITE_ENV = "ACCEL_TRAIN_TEST_NONFINITE_AT"


def injected_nonfinite_step(accelerator: Accelerator) -> int | None:
    """Test hook, not a feature: ACCEL_TRAIN_TEST_NONFINITE_AT=STEP:PROCESS makes the loss that PROCESS
    reports at optimizer step STEP NaN, to check that the others stop with it instead of hanging."""
    value = os.environ.get(TEST_NONFINITE_ENV)
    if not value:
        return None
    step, _, process = value.partition(":")
    return int(step) if int(process or 0) == accelerator.process_index else None


class StopSignals:
    """Records SIGTERM / SIGINT instead of dying on them, so all processes can stop together at a step boundary.

    Launchers (torchrun, accelerate launch, SLURM, Kubernetes) forward the signal to every worker and
    then allow a grace period before SIGKILL; a second signal (the launcher forwarding Ctrl-C once more)
    must not cut the checkpoint short, so it is only noted.
    """

    HANDLED = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, collective_timeout_s: float = 600) -> None:
        import threading

        self.timeout = timedelta(seconds=collective_timeout_s)
        self._group = None
        self.received: str | None = None
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            for sig in self.HANDLED:
                signal.signal(sig, self._record)

    def _record(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            print(f"accel-train: {self.received} received by process {launcher_ranks()[0]}: saving a "
                  "checkpoint at the next step boundary, then exiting", file=sys.stderr, flush=True)


def stop_requested(signals: StopSignals, accelerator: Accelerator) -> bool:
    """True on every process once any process got SIGTERM / SIGINT.

    Asked at every step, so it must not wait for the GPU: the flag is summed over a CPU (gloo) group,
    whereas an all-reduce on the NCCL group would need a host sync that stalls the step pipeline.
    """
    import torch
    import torch.distributed as dist

    flag = torch.tensor([float(signals.received is not None)])
    if accelerator.num_processes == 1:
        return bool(flag.item())
    if signals._group is None:  # every process gets here at the same step, as new_group requires
        signals._group = dist.new_group(backend="gloo", timeout=signals.timeout) \
            if dist.get_backend() != "gloo" else dist.group.WORLD
    dist.all_reduce(flag, group=signals._group)
    return flag.item() > 0


def child_env(threads: int | None = None) -> dict:
    """Environment for a run started by accel-train itself (the bench): plain process, fixed thread count."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def launch_command(num_processes: int, mixed_precision: str, profile: str | None, args: list[str]) -> list[str]:
    """`accelerate launch` of `accel-train ARGS` on N processes of this machine (the shipped multi_gpu profile
    when the checkout has it, else the equivalent flag)."""
    import socket

    with socket.socket() as sock:  # a free port, so bench runs never collide with a training job's rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    where = ["--config_file", profile] if profile else ["--multi_gpu"]
    return [sys.executable, "-m", "accelerate.commands.launch", *where, "--num_processes",
            str(num_processes), "--main_process_port", str(port), "--mixed_precision", mixed_precision,
            "-m", "accel_train", *args]


def run_info(accelerator: Accelerator) -> dict:
    """How this run was launched, written beside its results."""
    import accelerate
    import torch
    import torchvision

    import accel_train

    return {
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "device": accelerator.device.type,
        "mixed_precision": accelerator.mixed_precision,
        "versions": {
            "accel_train": accel_train.__version__,
            "python": sys.version.split()[0],
            "torch": str(torch.__version__),
            "torchvision": str(torchvision.__version__),
            "accelerate": accelerate.__version__,
        },
    }
