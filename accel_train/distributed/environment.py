"""What the launcher told this process: the one module of the package that reads the environment.

torchrun and `accelerate launch` (and SLURM and Kubernetes through them) describe the job to each process in
environment variables; `launcher_environment()` reads them into one object. Outside a launcher every field says
so: no world size, rank 0, no restarts.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

# What a launcher sets for its workers: a process accel-train starts as a plain process (the bench) leaves them out.
LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                      "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LauncherEnvironment:
    """What a launcher (torchrun, accelerate launch) told this process; None where it said nothing."""

    world_size: int | None  # the processes the launcher started, over all machines
    rank: int  # this process's rank over all machines (0 for a plain process)
    local_rank: int  # its rank on this machine
    local_world_size: int | None  # the processes on this machine
    node_rank: int | None
    main_address: str | None
    main_port: int | None
    restart: int  # restarts of the worker group so far (torchrun / accelerate launch --max_restarts)
    max_restarts: int  # restarts allowed
    mixed_precision: str | None  # what the launch profile asks for
    uses_fsdp: bool  # the launch profile asks for FSDP (accelerate launch exports its fsdp_config this way)
    uses_agent_store: bool  # torchrun's elastic agent hands its own store to the workers
    socket_interfaces: dict[str, str] = field(default_factory=dict)  # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME
    # The launcher's name for the job (torchrun's --rdzv_id, or the id a single-machine torchrun draws; the same for
    # every restart and every machine of the job); None where it names nothing (accelerate launch's "none")
    run_id: str | None = None

    @property
    def is_reporting_process(self) -> bool:
        """The one process that prints user errors raised before the Accelerator exists."""
        return self.rank == 0


def launcher_environment() -> LauncherEnvironment:
    env = os.environ

    def number(name: str) -> int | None:
        return int(env[name]) if env.get(name) else None

    return LauncherEnvironment(
        world_size=number("WORLD_SIZE"),
        rank=int(env.get("RANK", 0)),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        local_world_size=number("LOCAL_WORLD_SIZE"),
        node_rank=number("GROUP_RANK") if env.get("GROUP_RANK") else number("NODE_RANK"),
        main_address=env.get("MASTER_ADDR") or None,
        main_port=number("MASTER_PORT"),
        restart=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
        max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)),
        mixed_precision=(env.get("ACCELERATE_MIXED_PRECISION") or "").lower() or None,
        uses_fsdp=env.get("ACCELERATE_USE_FSDP", "false").lower() == "true",
        uses_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        socket_interfaces={name: env[name] for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if env.get(name)},
        run_id=env.get("TORCHELASTIC_RUN_ID") if env.get("TORCHELASTIC_RUN_ID") not in (None, "", "none") else None,
    )


STAGING_VARIABLE = "ACCEL_TRAIN_STAGING"


def staging_root() -> Path:
    """Where this machine stages the files of run folders kept at a URL: ACCEL_TRAIN_STAGING, else the user's cache
    (XDG_CACHE_HOME, else ~/.cache)."""
    if os.environ.get(STAGING_VARIABLE):
        return Path(os.environ[STAGING_VARIABLE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "accel-train" / "staging"


def host_name() -> str:
    """This machine's name, as a run's records and reports give it."""
    return socket.gethostname()


def machine_identity() -> str:
    """What tells this machine's process ids apart from another's: the host name, the kernel's boot id and this
    process's pid namespace (two containers of one host share a host name, not their pids); the host name alone
    where /proc does not say."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass
    return " ".join(parts)


def plain_process_env(threads: int | None = None) -> dict:
    """Environment for a run started by accel-train itself (the bench): a plain process, fixed thread count."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env
