"""The Accelerator every command uses, formed into a real process group on whatever hardware is present (a training
run's with its numerics: accelerator_for_run), and the check a launch must pass: the world size. How a global batch
splits across the processes is training/accumulation.py's, with the rest of a step's arithmetic.

The rest of the package sees an `Accelerator` and calls `prepare`, `backward`, `gather_for_metrics` and its
main-process helpers; the few collectives of the loop's decisions are collectives.py's.
"""

from __future__ import annotations

import atexit
import logging
from datetime import timedelta
from typing import TYPE_CHECKING

from accel_train import hooks
from accel_train.console import note
from accel_train.distributed.devices import has_accelerator_device, set_numerics
from accel_train.distributed.environment import LauncherEnvironment, launcher_environment
from accel_train.errors import LaunchError
from accel_train.versions import versions

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # torch and accelerate load lazily so the CLI can report errors without them
    import torch
    from accelerate import Accelerator

    from accel_train.config import TrainConfig


def accelerator_for_run(cfg: TrainConfig, seed: int, trackers: list[str], trackers_dir: str) -> Accelerator:
    """A training run's Accelerator: the numerics train.deterministic and train.tf32 ask for, set before any kernel
    runs; its trackers' files in `trackers_dir`."""
    set_numerics(cfg.deterministic, cfg.tf32)
    return make_accelerator(seed, cfg.collective_timeout_s, trackers, trackers_dir)


def make_accelerator(seed: int, collective_timeout_s: float = 600, trackers: list[str] = (),
                     trackers_dir: str | None = None) -> Accelerator:
    """An Accelerator that forms a real process group on whatever hardware is present.

    Batches are split (train.batch_size is global) so N processes x B/N == 1 process x B, the LR
    scheduler steps once per optimizer step at any world size (the loop steps it, telling it whether the step was
    skipped: Accelerate's wrapper passes every call through), and the seedable sampler makes the
    data order a function of (seed, epoch) alone. A collective that waits longer than
    `collective_timeout_s` (a peer died or hangs) fails the job instead of hanging for NCCL's 30 minutes.
    `trackers` (Accelerate's names, e.g. tensorboard) keep their local files in `trackers_dir`.
    """
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs

    launcher = launcher_environment()
    use_cpu = not has_accelerator_device()
    mixed_precision = None  # None = whatever the launch profile says
    if use_cpu and launcher.mixed_precision == "fp16":
        _warn_once("fp16 mixed precision is unavailable on CPU; training in fp32")
        mixed_precision = "no"
    if use_cpu and launcher.uses_fsdp:
        _warn_once("Accelerate runs FSDP on GPUs only; on this CPU every process holds the whole model (DDP over a "
                   "gloo group)")
    form_group_apart_from_earlier_attempts(use_cpu, collective_timeout_s, launcher)
    # Without cpu=True, Accelerate on a GPU-less box under a multi-process launcher silently
    # trains N independent copies instead of joining one gloo process group.
    options = hooks.every().accelerator_options(dict(
        cpu=use_cpu,
        mixed_precision=mixed_precision,
        # non_blocking: batches come from pinned memory (the loaders pin them for a GPU), so the copy to the device is
        # queued behind the step's kernels instead of waiting for them
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, data_seed=seed,
                                                  non_blocking=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=collective_timeout_s))],
        # The loop alone decides how the schedule moves (optim.AppliedStepsLR, from the guard's device flag). Stepped
        # with the optimizer, Accelerate's wrapper would drop the call on a micro-step it does not sync (and may count
        # it in the scheduler's private _step_count, which ours does not keep).
        step_scheduler_with_optimizer=False,
        log_with=list(trackers) or None,
        project_dir=trackers_dir if trackers else None,
    ))
    accelerator = Accelerator(**options)
    if launcher.world_size is not None and launcher.world_size != accelerator.num_processes:
        raise LaunchError(
            f"the launcher started {launcher.world_size} processes but only {accelerator.num_processes} joined the "
            f"run (distributed type {accelerator.distributed_type}); check the launch profile and device visibility"
        )
    hooks.every().accelerator_made(accelerator)
    _GROUP["finished"] = False
    if not _GROUP["registered"]:
        atexit.register(_destroy_finished_group)
        _GROUP["registered"] = True
    return accelerator


def _warn_once(line: str) -> None:
    """A warning about the launch, from the reporting process, once a process (a script may make several)."""
    if line not in _GROUP["warned"] and launcher_environment().is_reporting_process:
        logger.warning(line)
    _GROUP["warned"].add(line)


# Whether the last command of this process finished its work (finish_command); whether the exit handler is registered
_GROUP = {"finished": False, "registered": False, "warned": set()}


def finish_command(accelerator: Accelerator) -> None:
    """A command (train, evaluate, predict) has done its work: its trackers finish. The process group stays, so that a
    script that trains and then evaluates under a launcher runs the second call in the same group (Accelerate's state
    is one per process); it is destroyed when the process exits, for a clean exit on every process."""
    for tracker in accelerator.trackers:
        tracker.finish()
    _GROUP["finished"] = True


def _destroy_finished_group() -> None:
    """At exit, after a command that finished: a process that stopped on an error leaves the group as it is (the
    others may be gone, and destroying it would wait for them)."""
    if _GROUP["finished"]:
        from accelerate.state import PartialState

        PartialState().destroy_process_group()


def form_group_apart_from_earlier_attempts(use_cpu: bool, timeout_s: float, launcher: LauncherEnvironment) -> None:
    """After a launcher restart, form the process group under keys of this attempt only (Accelerate then uses it).

    The elastic agent keeps one store across restarts, and the group's keys in it still hold the addresses of
    the previous attempt's dead processes: a restarted process may read those and hang or fail to connect
    (pytorch/pytorch#135712). Every process of a restarted group gets the same restart count from its launcher.
    """
    import torch

    if not launcher.restart or not launcher.uses_agent_store:
        return
    if not use_cpu and not torch.cuda.is_available():  # other accelerators: Accelerate forms the group as before
        return
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    agent_store = dist.TCPStore(launcher.main_address, launcher.main_port, is_master=False, timeout=timeout)
    bound = {}
    if not use_cpu:  # this process's GPU first, as Accelerate does: else NCCL would set up every process on GPU 0
        torch.cuda.set_device(launcher.local_rank)
        bound = {"device_id": torch.device("cuda", launcher.local_rank)}
    # On GPUs NCCL for CUDA tensors and gloo for CPU ones, as Accelerate's own FSDP-offload group has
    dist.init_process_group("gloo" if use_cpu else "cuda:nccl,cpu:gloo",
                            store=dist.PrefixStore(f"accel_train/restart_{launcher.restart}", agent_store),
                            rank=launcher.rank, world_size=launcher.world_size, timeout=timeout, **bound)


def round_up_to_world(batch: int, accelerator: Accelerator) -> int:
    """Evaluation batch sizes do not change results, so round them up to split evenly instead of failing."""
    n = accelerator.num_processes
    return -(-batch // n) * n


def maybe_sync_batchnorm(model: torch.nn.Module, enabled: bool, accelerator: Accelerator) -> torch.nn.Module:
    if not enabled or accelerator.num_processes == 1:
        return model
    if accelerator.device.type == "cpu":
        note(logger, accelerator,
             "model.sync_batchnorm ignored: SyncBatchNorm needs a GPU; each CPU process keeps its own "
             "statistics")
        return model
    import torch

    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)


def shards_gradients(accelerator: Accelerator) -> bool:
    """FSDP: each process holds a shard of the gradients, and its forward and backward passes gather and scatter."""
    return "FSDP" in str(accelerator.distributed_type)


def run_info(accelerator: Accelerator) -> dict:
    """How this run was launched, written beside its results."""
    return {
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "device": accelerator.device.type,
        "mixed_precision": accelerator.mixed_precision,
        "versions": {name.replace("-", "_"): version for name, version in versions().items()},
    }
