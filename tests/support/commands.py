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


PRELOADED = Path(__file__).parent / "preloaded"
FRESH = "ACCEL_TRAIN_TESTS_FRESH_INTERPRETERS"  # set to 1: every command a fresh interpreter, as before the server
_server: dict = {}  # this pytest worker's preloaded interpreter: its socket and process, once started
preloading = True  # conftest.py turns it off for a test marked fresh_interpreters
_ENV_AT_START = dict(os.environ)  # the server's, before any test set a variable of its own


def preloaded_interpreter() -> dict:
    """The variables that hand a command to this worker's preloaded interpreter (support/preloaded/server.py),
    starting it at the first command; none where preloading is off. A command that comes before the server listens
    starts as usual."""
    if not preloading or os.environ.get(FRESH) == "1":
        return {}
    if not _server:
        import atexit
        import shutil
        import tempfile

        from support.processes import _PLAIN_POPEN  # the server serves every test: no test's to end

        folder = Path(tempfile.mkdtemp(prefix="accel-train-preloaded-"))
        address = str(folder / "socket")
        with open(folder / "log", "w") as log:
            process = _PLAIN_POPEN([PYTHON, str(PRELOADED / "server.py"), address], cwd=REPO,
                                   env=_plain_env(_ENV_AT_START),
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

        def end_server():
            process.terminate()
            process.wait(timeout=10)
            if os.environ.get("ACCEL_TRAIN_TESTS_KEEP_PRELOADED_LOG") != "1":
                shutil.rmtree(folder, ignore_errors=True)

        atexit.register(end_server)
        _server.update(process=process, address=address, log=folder / "log")
    if _server["process"].poll() is not None:  # it refused to start, or died: fresh interpreters from here
        if not _server.get("said"):
            import warnings

            _server["said"] = True
            warnings.warn(f"the preloaded interpreter ended ({_server['log'].read_text()[-2000:]}): every command "
                          "from here is a fresh interpreter", stacklevel=2)
        return {}
    paths = [str(PRELOADED), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"ACCEL_TRAIN_TESTS_PRELOADED": _server["address"], "PYTHONPATH": os.pathsep.join(paths)}


# Where a test signals or inspects some of its processes, only those start fresh (`env=` of run_command, start, ...):
# a launcher whose workers it kills with SIGKILL (its workers may be forks: a worker's command killed, its fork goes
# too), or every process of a command it stops with SIGSTOP (a stopped command's fork would run on).
FRESH_LAUNCHER = {"ACCEL_TRAIN_TESTS_FRESH_HERE": "1"}
FRESH_PROCESSES = {"ACCEL_TRAIN_TESTS_PRELOADED": ""}


def _plain_env(base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.pop("WORLD_SIZE", None)
    env.pop("ACCEL_TRAIN_TESTS_PRELOADED", None)  # a pytest run by a test starts its own server
    # HF_DATASETS_OFFLINE follows HF_HUB_OFFLINE where unset; set, a command that sets it (the GPU check's) and one
    # that does not import `datasets` alike, and so both can be forks of the preloaded interpreter
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": ""})
    return env


def command_env(extra: dict | None = None) -> dict:
    """The environment a command runs in: this one, one thread, no network, no progress bars, no GPU, plus `extra`.

    The GPU is hidden (CUDA_VISIBLE_DEVICES="") because the launched contracts are the CPU's: gloo groups of several
    processes, fp16 profiles falling back to fp32. On a machine with one GPU they would otherwise put 2 or 3
    processes on it. What a GPU changes, `make gpu-check` runs (tools/gpu_check.py)."""
    env = _plain_env()
    preloaded = preloaded_interpreter()
    if preloaded:  # a fresh start would spend the same seconds on the same imports as the server's that is under way
        _until_listening(preloaded["ACCEL_TRAIN_TESTS_PRELOADED"], timeout=120)
    if extra and "PYTHONPATH" in extra and preloaded:
        preloaded["PYTHONPATH"] = os.pathsep.join([str(PRELOADED), extra["PYTHONPATH"]])
    env.update({**preloaded, **{key: value for key, value in (extra or {}).items()
                                if key != "PYTHONPATH" or not preloaded}})
    return env


def wait_for_preloaded_interpreter(timeout: float = 120) -> bool:
    """Until this worker's preloaded interpreter listens (False: preloading is off, or it ended: see its log)."""
    address = preloaded_interpreter().get("ACCEL_TRAIN_TESTS_PRELOADED")
    assert not address or _until_listening(address, timeout), \
        f"the preloaded interpreter is not listening after {timeout} s"
    return bool(address) and os.path.exists(address)


def _until_listening(address: str, timeout: float) -> bool:
    """False if the server is still not listening after `timeout` s; True once it listens or has ended."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(address) and _server["process"].poll() is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


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
