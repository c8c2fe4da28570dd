"""accel-train run the way users run it: as a command, alone or under a launcher, or through the Python API in this
process; and waiting on what a command started."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from support.locations import PROBE, PROFILES, REPO

# `python -m` from the repo root: the code under test is this checkout's, whatever the venv points at.
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command_env(extra: dict | None = None) -> dict:
    """The environment a command runs in: this one, one thread, no network, no progress bars, no GPU, plus `extra`.

    The GPU is hidden (CUDA_VISIBLE_DEVICES="") because the launched contracts are the CPU's: gloo groups of several
    processes, fp16 profiles falling back to fp32. On a machine with one GPU they would otherwise put 2 or 3
    processes on it. What a GPU changes, `make gpu-check` runs (tools/gpu_check.py)."""
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                "CUDA_VISIBLE_DEVICES": "", **(extra or {})})
    return env


def run_command(command: list[str], timeout: int, check: bool, env: dict | None = None) -> subprocess.CompletedProcess:
    """`command` from the repo root; with `check`, an exit other than 0 fails the test with the output's end."""
    result = subprocess.run(command, cwd=REPO, env=command_env(env), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-5000:]}")
    return result


def run_cli(*args: str, timeout: int = 300, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """`accel-train ARGS` in one plain process."""
    return run_command([PYTHON, "-m", "accel_train", *args], timeout, check, env)


def run_probe(*args: str, env: dict | None = None, check: bool = True,
              timeout: int = 300) -> subprocess.CompletedProcess:
    """tests/launched_probe.py ARGS in one plain process: the CLI with the faults `env` asks for."""
    return run_command([PYTHON, PROBE, *args], timeout, check, env)


def accelerate(*options) -> list[str]:
    """`accelerate launch OPTIONS -m accel_train`, to be followed by accel-train's arguments."""
    return [PYTHON, "-m", "accelerate.commands.launch", *map(str, options), "-m", "accel_train"]


def torchrun(*options) -> list[str]:
    """`torchrun OPTIONS -m accel_train`, to be followed by accel-train's arguments."""
    return [PYTHON, "-m", "torch.distributed.run", *map(str, options), "-m", "accel_train"]


def _launch_command(num_processes: int, args: tuple[str, ...], profile: str, script: str | None = None,
                    launcher_args: tuple[str, ...] = ()) -> list[str]:
    target = [script] if script else ["-m", "accel_train"]
    return [PYTHON, "-m", "accelerate.commands.launch", "--config_file", str(PROFILES / profile),
            "--num_processes", str(num_processes), "--main_process_port", str(free_port()), *launcher_args, *target,
            *args]


def launch(num_processes: int, *args: str, profile: str = "multi_gpu.yaml", timeout: int = 300,
           check: bool = True, script: str | None = None, env: dict | None = None,
           launcher_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/PROFILE --num_processes N -m accel_train ARGS`.

    `script` launches that file instead of the package (a test probe wrapping the CLI); `launcher_args` go to
    accelerate launch (e.g. --mixed_precision no). A training run that succeeds must have been trained by
    `num_processes` processes in one group (its config.yaml says so), whatever the test checks besides:
    N independent copies pass many comparisons.
    """
    result = run_command(_launch_command(num_processes, args, profile, script, launcher_args), timeout, check, env)
    output_dir = next((arg.split("=", 1)[1] for arg in args if arg.startswith("output_dir=")), None)
    if args[:1] == ("train",) and result.returncode == 0 and output_dir:
        import fsspec
        import yaml

        with fsspec.open(f"{output_dir.rstrip('/')}/config.yaml", "r") as config:  # a local folder or a URL
            run = yaml.safe_load(config.read())["run"]
        assert run["world_size"] == num_processes, (run, result.stderr[-2000:])
    return result


def start(command: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start a command without waiting (to signal or kill it mid-run); stdout and stderr go to `log`, `env` adds to
    the test environment. Ctrl-C acts as in a terminal: pytest-xdist's workers ignore SIGINT, and a child would
    inherit that."""
    import signal

    with open(log, "w") as handle:
        return subprocess.Popen(command, cwd=REPO, env=command_env(env), stdout=handle, stderr=subprocess.STDOUT,
                                text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def start_launch(num_processes: int, *args: str, log: Path, profile: str = "multi_gpu.yaml",
                 launcher_args: tuple[str, ...] = (), env: dict | None = None,
                 script: str | None = None) -> subprocess.Popen:
    return start(_launch_command(num_processes, args, profile, script, launcher_args), log, env)


def wait_for(condition, process: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    """Until `condition()` holds; fails if `process` (its output in `log`) exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"exited {process.returncode} too early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out:\n{log.read_text()[-3000:]}"
        time.sleep(0.02)


def last_json_line(stdout: str) -> dict:
    """The last line a command printed, read as JSON (`accel-train eval` prints its metrics so)."""
    return json.loads(stdout.strip().splitlines()[-1])


def train_in_process(recipe: str, *overrides: str) -> dict:
    """`accel-train train RECIPE OVERRIDES` in this process, for set-ups whose point is not the command line (a
    model to evaluate, a reference run): no interpreter start. One thread, as the launched runs have."""
    from accel_train import api

    return one_thread(api.train, recipe, list(overrides))


def evaluate_in_process(recipe: str, checkpoint: Path, *overrides: str) -> dict:
    """`accel-train eval RECIPE checkpoint=CHECKPOINT OVERRIDES` in this process: its metrics."""
    from accel_train import api
    from accel_train.config import load_config

    return one_thread(api.evaluate_run, load_config(recipe, list(overrides)), str(checkpoint))


def one_thread(function, *args):
    """`function(*args)` on one CPU thread, as every launched test command runs (OMP_NUM_THREADS=1): another thread
    count may run other kernels, whose last bits differ on some CPUs (docs/contracts.md)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return function(*args)
    finally:
        torch.set_num_threads(threads)
