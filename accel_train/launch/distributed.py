"""Process-group concerns live here; ranks and the environment are read in settings.py alone.

Forming the group on whatever hardware is present, launch checks (world size, batch splits), stop signals and
the few collectives the loop's decisions need: agreements over a CPU (gloo) group, which need no device sync, and
the gradient average of a step that ran without DDP's own all-reduce (micro_batch_size=auto). The rest of the
package sees an `Accelerator` and calls `prepare`, `backward`, `gather_for_metrics` and Accelerator's main-process
helpers.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from accel_train.console import say
from accel_train.errors import LaunchError, UserError
from accel_train.launch.settings import (
    is_reporting_process,
    launcher_ranks,
    launcher_restarts,
    launcher_settings,
    launcher_world_size,
    requested_mixed_precision,
    uses_agent_store,
    wants_fsdp,
)

if TYPE_CHECKING:  # torch and accelerate load lazily so the CLI can report errors without them
    import torch
    from accelerate import Accelerator


def has_accelerator_device() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def cores_per_process() -> int:
    """The CPU cores this process may use divided among the processes on this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores // (launcher_settings().local_world_size or 1)


def dataloader_workers(requested: int | str) -> int:
    """data.num_workers: a number as given; auto, the cores per process (torch warns above the cores it sees),
    at most 8."""
    return int(requested) if requested != "auto" else min(8, cores_per_process())


def make_accelerator(seed: int, collective_timeout_s: float = 600, trackers: list[str] = (),
                     trackers_dir: str | None = None) -> Accelerator:
    """An Accelerator that forms a real process group on whatever hardware is present.

    Batches are split (train.batch_size is global) so N processes x B/N == 1 process x B, the LR
    scheduler steps once per optimizer step at any world size, and the seedable sampler makes the
    data order a function of (seed, epoch) alone. A collective that waits longer than
    `collective_timeout_s` (a peer died or hangs) fails the job instead of hanging for NCCL's 30 minutes.
    `trackers` (Accelerate's names, e.g. tensorboard) keep their local files in `trackers_dir`.
    """
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs

    use_cpu = not has_accelerator_device()
    mixed_precision = None  # None = whatever the launch profile says
    requested = requested_mixed_precision()
    if use_cpu and requested == "fp16":
        if is_reporting_process():
            print("accel-train: warning: fp16 mixed precision is unavailable on CPU; training in fp32", file=sys.stderr)
        mixed_precision = "no"
    if use_cpu and wants_fsdp() and is_reporting_process():
        print("accel-train: warning: Accelerate runs FSDP on GPUs only; on this CPU every process holds the whole "
              "model (DDP over a gloo group)", file=sys.stderr)
    form_group_apart_from_earlier_attempts(use_cpu, collective_timeout_s)
    # Without cpu=True, Accelerate on a GPU-less box under a multi-process launcher silently
    # trains N independent copies instead of joining one gloo process group.
    accelerator = Accelerator(
        cpu=use_cpu,
        mixed_precision=mixed_precision,
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, data_seed=seed),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=collective_timeout_s))],
        log_with=list(trackers) or None,
        project_dir=trackers_dir if trackers else None,
    )
    expected = launcher_world_size()
    if expected is not None and expected != accelerator.num_processes:
        raise LaunchError(
            f"the launcher started {expected} processes but only {accelerator.num_processes} joined the run "
            f"(distributed type {accelerator.distributed_type}); check the launch profile and device visibility"
        )
    return accelerator


def form_group_apart_from_earlier_attempts(use_cpu: bool, timeout_s: float) -> None:
    """After a launcher restart, form the process group under keys of this attempt only (Accelerate then uses it).

    The elastic agent keeps one store across restarts, and the group's keys in it still hold the addresses of
    the previous attempt's dead processes: a restarted process may read those and hang or fail to connect
    (pytorch/pytorch#135712). Every process of a restarted group gets the same restart count from its launcher.
    """
    import torch

    restart, _ = launcher_restarts()
    if not restart or not uses_agent_store():
        return
    if not use_cpu and not torch.cuda.is_available():  # other accelerators: Accelerate forms the group as before
        return
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    launcher = launcher_settings()
    agent_store = dist.TCPStore(launcher.main_address, launcher.main_port, is_master=False, timeout=timeout)
    # On GPUs NCCL for CUDA tensors and gloo for CPU ones, as Accelerate's own FSDP-offload group has
    dist.init_process_group("gloo" if use_cpu else "cuda:nccl,cpu:gloo",
                            store=dist.PrefixStore(f"accel_train/restart_{restart}", agent_store),
                            rank=launcher_ranks()[0], world_size=launcher.world_size, timeout=timeout)


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def per_process_batch(global_batch: int, accelerator: Accelerator, key: str) -> int:
    """Check that a global batch splits evenly across processes (Accelerate's split_batches needs it)."""
    n = accelerator.num_processes
    if global_batch % n:
        lower, upper = (global_batch // n) * n, (global_batch // n + 1) * n
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        # A checkpoint continues only with its own global batch: the world sizes that split it are the other way out.
        raise UserError(f"{key}={global_batch} does not split evenly across {n} processes; use a multiple of {n}, "
                        f"e.g. {hint}, or run at a world size that splits it: "
                        f"{', '.join(map(str, divisors(global_batch)))} process(es)")
    return global_batch // n


def round_up_to_world(batch: int, accelerator: Accelerator) -> int:
    """Evaluation batch sizes do not change results, so round them up to split evenly instead of failing."""
    n = accelerator.num_processes
    return -(-batch // n) * n


def maybe_sync_batchnorm(model: torch.nn.Module, enabled: bool, accelerator: Accelerator) -> torch.nn.Module:
    if not enabled or accelerator.num_processes == 1:
        return model
    if accelerator.device.type == "cpu":
        accelerator.print("model.sync_batchnorm ignored: SyncBatchNorm needs a GPU; each CPU process keeps its own "
                          "statistics")
        return model
    import torch

    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)


def any_process(flag: bool | torch.Tensor, accelerator: Accelerator) -> bool:
    """True on every process if `flag` is true on any: lets all processes stop (or skip) together.

    A host read: for decisions taken once (resume), not per step (see guard.py for the per-step one).
    """
    import torch

    flag = flag.float().reshape(1) if torch.is_tensor(flag) else torch.tensor([float(flag)], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


def shards_gradients(accelerator: Accelerator) -> bool:
    """FSDP: each process holds a shard of the gradients, and its forward and backward passes gather and scatter."""
    return "FSDP" in str(accelerator.distributed_type)


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


SIGNAL_CHECK_S = 2.0  # how often processes agree on a stop signal: well inside launchers' 30 s grace before SIGKILL
MAX_STEPS_BETWEEN_CHECKS = 10_000


def first_message(message: str | None, accelerator: Accelerator) -> str | None:
    """The first process's message, on every process (None where no process has one): one line for all."""
    from accelerate.utils import gather_object

    found = [(rank, text) for rank, text in enumerate(gather_object([message])) if text is not None]
    if not found:
        return None
    rank, text = found[0]
    return f"process {rank}: {text}" if accelerator.num_processes > 1 else text


def steps_between_checks(seconds_per_step: float, every_s: float = SIGNAL_CHECK_S) -> int:
    """Optimizer steps until the next stop-signal agreement: about `every_s` seconds of the slowest process."""
    if seconds_per_step <= 0:
        return 1
    return max(1, min(MAX_STEPS_BETWEEN_CHECKS, int(every_s / seconds_per_step)))


class StopSignals:
    """SIGTERM / SIGINT are recorded instead of killing the process; all processes then agree to stop at one step.

    Launchers (torchrun, accelerate launch, SLURM, Kubernetes) forward the signal to every worker and then
    allow a grace period before SIGKILL; a second signal (the launcher forwarding Ctrl-C once more) must not
    cut the checkpoint short, so it is only noted.

    The agreement is an all-reduce over a CPU (gloo) group, never the GPU one, so it needs no device sync; and
    it happens about every SIGNAL_CHECK_S seconds rather than every step, because on several machines each one
    is a network round trip. Every process computes the same next step to agree at, from values it reduced.
    """

    HANDLED = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, accelerator: Accelerator, collective_timeout_s: float = 600) -> None:
        import threading

        self.accelerator = accelerator
        self.timeout_s = collective_timeout_s
        self.received: str | None = None
        self.next_check: int | None = None  # None: at the first step asked
        self._last_check: tuple[int, float] | None = None  # (step, time) of the previous agreement
        self._previous = {}
        # Set once this process is ending itself (run/watchdog.py: it stopped, or waits for one that did): a signal
        # then changes nothing, and says nothing of a checkpoint that will not come.
        self.quiet = False
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            self._previous = {sig: signal.signal(sig, self._record) for sig in self.HANDLED}

    def __enter__(self) -> StopSignals:
        return self

    def __exit__(self, *exc) -> None:
        """Training is over: the signals act as they did before (a script calling train() gets Ctrl-C back)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _record(self, signum: int, frame) -> None:
        if self.received is None and not self.quiet:
            self.received = signal.Signals(signum).name
            say(f"accel-train: {self.received} received by process {launcher_ranks()[0]}: saving a checkpoint at the "
                "next agreed step, then exiting", error=True, nolock=True)

    def agreed(self, step: int, now: bool = False) -> bool:
        """True on every process, at the same step, once any process got SIGTERM / SIGINT.

        Asked after every optimizer step; `now=True` (where the processes wait for each other anyway, after an
        evaluation) agrees at once. A single process needs no agreement and stops at the next step.
        """
        if self.accelerator.num_processes == 1:
            return self.received is not None
        if not now and self.next_check is not None and step < self.next_check:
            return False
        import torch
        import torch.distributed as dist

        clock = time.perf_counter()
        seconds_per_step = 0.0
        if self._last_check is not None and step > self._last_check[0]:
            seconds_per_step = (clock - self._last_check[1]) / (step - self._last_check[0])
        flags = torch.tensor([float(self.received is not None), seconds_per_step])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=cpu_group(self.timeout_s))
        received, slowest = flags.tolist()
        self.next_check = step + steps_between_checks(slowest)
        self._last_check = (step, time.perf_counter())
        return received > 0

    def stop_message(self, step: int, saved) -> str:
        return (f"stopped by {self.received or 'a signal to another process'} at step {step}; checkpoint saved in "
                f"{saved}; run the same command with resume=auto to continue")


def run_info(accelerator: Accelerator) -> dict:
    """How this run was launched, written beside its results."""
    from accel_train.installed import versions

    return {
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "device": accelerator.device.type,
        "mixed_precision": accelerator.mixed_precision,
        "versions": {name.replace("-", "_"): version for name, version in versions().items()},
    }
