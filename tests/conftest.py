"""Helpers that run accel-train the way users do: as a command, alone or under a launcher. Also: every process a
test starts ends with the test, and the tests that start processes are marked `processes` (make test-fast leaves
them out)."""

from __future__ import annotations

import builtins
import dis
import inspect
import json
import os
import pty
import random
import socket
import stat
import subprocess
import sys
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

# torch's import asks ldconfig once for system libraries (cuda.pathfinder): done here, before any test, so that the
# test that happens to import torch first is not taken for one that starts a process.
import torch  # noqa: F401

from accel_train.run.summaries import TIMING

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
PROFILES = REPO / "accelerate_configs"
PROBE = "tests/launched_probe.py"  # the CLI with recorders and injected faults (see its docstring)
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
# `python -m` from the repo root: the code under test is this checkout's, whatever the venv points at.
PYTHON = sys.executable

needs_fashion_mnist = pytest.mark.skipif(
    not FASHION_MNIST.is_dir(),
    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist; make test does it)"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                **(extra or {})})
    return env


def run_cli(*args: str, timeout: int = 300, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """`accel-train ARGS` in one plain process."""
    return _run([PYTHON, "-m", "accel_train", *args], timeout, check, env)


def train_in_process(recipe: str, *overrides: str) -> dict:
    """`accel-train train RECIPE OVERRIDES` in this process, for set-ups whose point is not the command line (a
    model to evaluate, a reference run): no interpreter start. One thread, as the launched runs have."""
    from accel_train import api

    return _one_thread(api.train, recipe, list(overrides))


def evaluate_in_process(recipe: str, checkpoint: Path, *overrides: str) -> dict:
    """`accel-train eval RECIPE checkpoint=CHECKPOINT OVERRIDES` in this process: its metrics."""
    from accel_train import api
    from accel_train.config import load_config

    return _one_thread(api.evaluate_run, load_config(recipe, list(overrides)), str(checkpoint))


def _one_thread(function, *args):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return function(*args)
    finally:
        torch.set_num_threads(threads)


def run_probe(*args: str, env: dict | None = None, check: bool = True,
              timeout: int = 300) -> subprocess.CompletedProcess:
    """tests/launched_probe.py ARGS in one plain process: the CLI with the faults `env` asks for."""
    return _run([PYTHON, PROBE, *args], timeout, check, env)


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
    result = _run(_launch_command(num_processes, args, profile, script, launcher_args), timeout, check, env)
    output_dir = next((arg.split("=", 1)[1] for arg in args if arg.startswith("output_dir=")), None)
    if args[:1] == ("train",) and result.returncode == 0 and output_dir:
        import yaml

        run = yaml.safe_load((Path(output_dir) / "config.yaml").read_text())["run"]
        assert run["world_size"] == num_processes, (run, result.stderr[-2000:])
    return result


def start(command: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start a command without waiting (to signal or kill it mid-run); stdout and stderr go to `log`, `env` adds to
    the test environment. Ctrl-C acts as in a terminal: pytest-xdist's workers ignore SIGINT, and a child would
    inherit that."""
    import signal

    with open(log, "w") as handle:
        return subprocess.Popen(command, cwd=REPO, env=_env(env), stdout=handle, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def start_launch(num_processes: int, *args: str, log: Path, profile: str = "multi_gpu.yaml",
                 launcher_args: tuple[str, ...] = (), env: dict | None = None) -> subprocess.Popen:
    return start(_launch_command(num_processes, args, profile, launcher_args=launcher_args), log, env)


def _run(command: list[str], timeout: int, check: bool, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=REPO, env=_env(env), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-5000:]}")
    return result


def read_metrics(output_dir: Path, split: str) -> list[dict]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["split"] == split]


def metrics_without_timing(output_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in line.items() if key not in TIMING} for line in lines]


def assert_same_run(out: Path, reference: Path, weights: tuple[str, ...] = ("model.safetensors",)) -> None:
    """metrics.jsonl line for line (timings aside) and every weights file bit for bit."""
    assert metrics_without_timing(out) == metrics_without_timing(reference)
    assert_same_weights(out, reference, weights)


def assert_same_weights(out: Path, reference: Path, weights: tuple[str, ...] = ("model.safetensors",)) -> None:
    """Every weights file bit for bit."""
    from safetensors.torch import load_file

    for name in weights:
        ours, theirs = load_file(str(Path(out) / name)), load_file(str(Path(reference) / name))
        assert ours.keys() == theirs.keys(), name
        assert all(torch.equal(ours[key], theirs[key]) for key in ours), name


def crash_after_checkpoint_then_resume(step: int, recipe: str, *overrides: str, resume: str = "auto") -> None:
    """Train in this process, fail right after the checkpoint of `step` is saved, then train again with
    resume=auto (or the checkpoint `resume` names), as a user would after a crash.

    The second run must have started where that checkpoint left off (assert_resumed_from)."""
    from accel_train import hooks
    from support.faults import Crash, RaiseAfterSave

    with pytest.raises(Crash), hooks.added(RaiseAfterSave(step)):
        train_in_process(recipe, *overrides)
    out = Path(next(arg.split("=", 1)[1] for arg in overrides if arg.startswith("output_dir=")))
    if resume == "auto":
        resumed_from = newest_checkpoint_step(out)
        assert resumed_from == step, f"the newest checkpoint is of step {resumed_from}, not {step}"
    else:
        resumed_from = json.loads((Path(resume) / "checkpoint.json").read_text())["step"]
    before = metrics_lines_before(out, resumed_from)
    train_in_process(recipe, *overrides, f"resume={resume}")
    assert_resumed_from(out, resumed_from, before)


def newest_checkpoint_step(out: Path) -> int:
    """The step of the checkpoint resume=auto takes: the newest save, by checkpoint.json's serial."""
    saved = [json.loads(meta.read_text()) for meta in (Path(out) / "checkpoints").glob("*/checkpoint.json")]
    assert saved, f"no checkpoint in {out}/checkpoints"
    return max(saved, key=lambda meta: meta["serial"])["step"]


def metrics_lines_before(out: Path, step: int) -> list[str]:
    """metrics.jsonl's lines of steps before `step`, as written: a resume from `step` keeps them byte for byte."""
    written = (Path(out) / "metrics.jsonl").read_text().splitlines(keepends=True)
    return [line for line in written if json.loads(line)["step"] < step]


def assert_resumed_from(out: Path, step: int, before: list[str]) -> None:
    """The last start of the run in `out` began at `step` (starts.jsonl), and kept the lines `before` it.

    A resume that silently started again from step 0 rewrites metrics.jsonl and can reproduce an uninterrupted
    run line for line and bit for bit: comparing with that run alone cannot tell."""
    started = json.loads((Path(out) / "starts.jsonl").read_text().splitlines()[-1])["step"]
    assert started == step, f"the resumed run started at step {started}, not at its checkpoint's {step}"
    kept = (Path(out) / "metrics.jsonl").read_text().splitlines(keepends=True)[:len(before)]
    assert kept == before, "the resumed run rewrote the lines of metrics.jsonl written before its checkpoint"


def last_json_line(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def run_nodes(commands: list[tuple[list[str], dict]], timeout: int = 300, check: bool = True,
              apart_s: float = 0) -> list[subprocess.CompletedProcess]:
    """Start every (command, extra env) at once, as the nodes of one job would (or `apart_s` seconds after each
    other, as nodes that boot at different times), and wait for all of them.

    If any runs past `timeout` (a hang at rendezvous or in a collective), all are killed and the test fails.
    """
    procs = []
    for index, (command, env) in enumerate(commands):
        if index and apart_s:
            time.sleep(apart_s)
        procs.append(subprocess.Popen(command, cwd=REPO, env=_env(env), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    results = []
    try:
        for proc, (command, _) in zip(procs, commands):
            stdout, stderr = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(command, proc.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, 9)
        outputs = [proc.communicate() for proc in procs]
        raise AssertionError(f"{len(procs)} launches did not finish in {timeout}s (hang?)\n" +
                             "\n".join(f"{out[0][-2000:]}\n{out[1][-3000:]}" for out in outputs)) from None
    for result in results:
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(result.args)} exited {result.returncode}\n{result.stdout[-3000:]}\n"
                                 f"{result.stderr[-5000:]}\n(other nodes: {[r.returncode for r in results]})")
    return results


def slurm_nodes(tmp: Path, nodes: int = 2, dry_run: bool = False, **slurm) -> list:
    """The sbatch file as each node's srun task runs it, with SLURM's variables faked and a fake scontrol."""
    fake = tmp / "fake_slurm_bin"
    fake.mkdir(exist_ok=True)
    scontrol = fake / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "127.0.0.1\\n127.0.0.2\\n"\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    path = f"{fake}:{Path(sys.executable).parent}:/usr/bin:/bin"  # `accelerate` from this Python's environment
    env = {"PATH": path, "SLURM_JOB_NUM_NODES": str(nodes),
           "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_JOB_ID": str(job_id_with_free_port()), **slurm}
    if dry_run:
        env["ACCEL_TRAIN_DRY_RUN"] = "1"
    task = ["bash", "accelerate_configs/slurm_multi_node.sbatch", "--node-task"]  # as the batch step's srun runs it
    return [(task, {**env, "SLURM_NODEID": str(rank)}) for rank in range(nodes)]


def job_id_with_free_port() -> int:
    """A SLURM job id whose derived port (20000 + id % 20000) is free on this machine."""
    for _ in range(100):
        port = random.randrange(20000, 40000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return 100000 + port - 20000
    raise RuntimeError("no free port in 20000-39999")


@dataclass
class Host:
    """One network namespace: a "machine" with its own interface and address."""

    namespace: str
    interface: str
    address: str

    def run(self, command: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *command]


@pytest.fixture(scope="session")
def two_hosts():
    """Two network namespaces joined by a veth pair, so "nodes" reach each other only over that link.

    Skips where namespaces cannot be created (needs root or CAP_NET_ADMIN, and iproute2's `ip`).
    """
    tag, subnet = f"at{os.getpid() % 100000}", f"10.231.{os.getpid() % 250}"
    hosts = [Host(f"{tag}n{i}", f"{tag}v{i}", f"{subnet}.{i + 1}") for i in (0, 1)]
    setup = [["ip", "netns", "add", host.namespace] for host in hosts]
    setup.append(["ip", "link", "add", hosts[0].interface, "type", "veth", "peer", "name", hosts[1].interface])
    for host in hosts:
        setup += [["ip", "link", "set", host.interface, "netns", host.namespace],
                  ["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface],
                  ["ip", "-n", host.namespace, "link", "set", host.interface, "up"],
                  ["ip", "-n", host.namespace, "link", "set", "lo", "up"]]
    try:
        for command in setup:
            subprocess.run(command, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as err:
        _delete_namespaces(hosts)
        detail = getattr(err, "stderr", "") or str(err)
        pytest.skip(f"cannot create network namespaces ({' '.join(command)}: {detail.strip()}); "
                    "needs root or CAP_NET_ADMIN and iproute2")
    yield hosts
    _delete_namespaces(hosts)


def _delete_namespaces(hosts: list[Host]) -> None:
    for host in hosts:  # deleting a namespace deletes its end of the veth pair, and with it the other end
        subprocess.run(["ip", "netns", "delete", host.namespace], capture_output=True)


# Every process a test starts ends with the test. Whatever starts it (the helpers above, a test's own subprocess
# call, a library), a process started through subprocess gets a token in its environment, and its descendants
# inherit it: a launcher's workers too, though torch's launchers start each worker in a session of its own, so that
# it outlives a launcher killed at a timeout. When the test's teardown is done, every process that carries a token
# of that test gets SIGTERM, and SIGKILL `ENDING_GRACE_S` later if it ignores it (a training process handles SIGTERM
# by saving a checkpoint, and one hung in a collective never gets there).
TREE = "ACCEL_TRAIN_TEST_TREE"  # the tokens of every test process above (a test's child may run pytest too)
ENDING_GRACE_S = 3
_PLAIN_POPEN = subprocess.Popen
_started: list[tuple[str, subprocess.Popen]] = []  # (token, process) of each start since end_started() last ran


class ProcessesLeftRunning(UserWarning):
    pass


class _TrackedPopen(subprocess.Popen):
    def __init__(self, args, *positional, env=None, **kwargs):
        token = f"{os.getpid()}-{len(_started)}-{random.getrandbits(48):012x}"
        env = dict(os.environ if env is None else env)
        env[TREE] = f"{env.get(TREE, '')} {token}".lstrip()
        super().__init__(args, *positional, env=env, **kwargs)
        _started.append((token, self))


def carrying(tokens: set[str]) -> list:
    """The live processes whose environment carries one of `tokens` (zombies have none left)."""
    import psutil

    found = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and tokens.intersection(process.environ().get(TREE, "").split()):
                found.append(process)
        except psutil.Error:  # gone meanwhile, or another user's
            pass
    return found


def end_processes(tokens: set[str], grace_s: float = ENDING_GRACE_S) -> list[str]:
    """SIGTERM to every process that carries one of `tokens`, SIGKILL to those alive `grace_s` later; their
    command lines. Again while any is found: a launcher may start a worker while it is being ended."""
    import psutil

    ended = []
    for _ in range(5):
        processes = carrying(tokens)
        if not processes:
            break
        for process in processes:
            try:
                ended.append(" ".join(process.cmdline()))
                process.terminate()
                process.resume()  # a stopped process takes SIGTERM only once it runs again
            except psutil.Error:
                pass
        for process in _still_running(processes, grace_s):
            try:
                process.kill()
            except psutil.Error:
                pass
        _still_running(processes, 10)
    return ended


def _still_running(processes: list, timeout_s: float) -> list:
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        running = []
        for process in processes:
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    running.append(process)
            except psutil.Error:
                pass
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.05)


def end_started() -> None:
    """End what was started through subprocess since the last call, and say so if any was still running."""
    ended = end_processes({token for token, _ in _started})
    for _, process in _started:
        process.poll()  # reaps the ended processes that were this one's children
    _started.clear()
    if ended:
        warnings.warn(ProcessesLeftRunning(f"{len(ended)} process(es) still running at the end of the test were "
                                           f"ended: {ended}"), stacklevel=1)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    subprocess.Popen = _TrackedPopen  # subprocess.run and the rest look Popen up in their module when called
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        subprocess.Popen = _PLAIN_POPEN  # outside tests (collection, pytest-xdist's own workers) nothing is tracked
        end_started()


def pytest_sessionfinish(session):
    end_started()  # a test cut short (Ctrl-C) never reached its teardown


# The fast tier (`make test-fast`): the tests not marked `processes`. The mark is derived here from the code a test
# runs: the test, its fixtures and parameters, and every function and class of tests/ they name, followed through:
# one that names a way to start a process (subprocess, os.system, fork, pty) starts processes. Code outside tests/
# is not read: a test whose processes a library starts (torch.compile runs a C++ compiler) carries the mark itself,
# and a test without the mark that starts a process fails, naming what it started.
_STARTERS = {id(starter) for starter in (
    _PLAIN_POPEN, _TrackedPopen, subprocess.run, subprocess.call, subprocess.check_call, subprocess.check_output,
    subprocess.getoutput, subprocess.getstatusoutput, os.system, os.popen, os.fork, os.forkpty, os.posix_spawn,
    os.posix_spawnp, os.spawnv, os.spawnve, os.spawnvp, os.spawnvpe, os.spawnl, os.spawnle, os.spawnlp,
    os.spawnlpe, os.execv, os.execve, os.execvp, os.execvpe, pty.fork, pty.spawn)}


def starts_processes(item: pytest.Item) -> bool:
    seen: set = set()
    named = [item.obj, *getattr(getattr(item, "callspec", None), "params", {}).values()]
    named += [fixture.func for name in item.fixturenames
              for fixture in item._fixtureinfo.name2fixturedefs.get(name, ())]
    return any(_starts(thing, seen) for thing in named)


def _starts(thing, seen: set) -> bool:
    """Whether `thing` is a way to start a process, or code of tests/ that names one."""
    if id(thing) in _STARTERS:
        return True
    if isinstance(thing, (list, tuple, set, frozenset, dict)):
        return any(_starts(part, seen) for part in (thing.values() if isinstance(thing, dict) else thing))
    if isinstance(thing, type) and _in_tests(getattr(sys.modules.get(thing.__module__), "__file__", None)):
        return any(_starts(member, seen) for member in vars(thing).values())
    function = inspect.unwrap(getattr(thing, "__func__", thing)) if callable(thing) else None
    code = getattr(function, "__code__", None)
    return code is not None and _in_tests(code.co_filename) and _code_starts(code, function.__globals__, seen)


def _in_tests(filename: str | None) -> bool:
    return filename is not None and Path(filename).resolve().is_relative_to(TESTS)


def _code_starts(code, namespace: dict, seen: set) -> bool:
    if code in seen:
        return False
    seen.add(code)
    current = imported = None
    for instruction in dis.get_instructions(code):
        operation, name = instruction.opname, instruction.argval
        if operation in ("LOAD_GLOBAL", "LOAD_NAME"):
            current = namespace.get(name, getattr(builtins, name, None))
        elif operation.startswith(("LOAD_FAST", "LOAD_DEREF")) and isinstance(name, str):  # a module imported
            current = sys.modules.get(name)  # inside the function
        elif operation == "IMPORT_NAME":
            current = imported = sys.modules.get(name)
        elif operation == "IMPORT_FROM":
            current = getattr(imported, name, None)
        elif operation in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(current, (types.ModuleType, type)):
            current = getattr(current, name, None)
        else:
            current = None
        if current is not None and _starts(current, seen):
            return True
    return any(_code_starts(const, namespace, seen) for const in code.co_consts if inspect.iscode(const))


@pytest.hookimpl(tryfirst=True)  # before -m selects by it
def pytest_collection_modifyitems(items):
    for item in items:
        if isinstance(item, pytest.Function) and not item.get_closest_marker("processes") and starts_processes(item):
            item.add_marker("processes")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    if _started and not item.get_closest_marker("processes"):
        commands = [" ".join(map(str, process.args)) if isinstance(process.args, list) else str(process.args)
                    for _, process in _started]
        pytest.fail(f"{item.nodeid} started {len(commands)} process(es) without the mark `processes`, so it runs in "
                    f"make test-fast: {commands}. conftest.py derives the mark from the code of tests/ a test runs; "
                    "where a library starts the processes, mark the test @pytest.mark.processes.", pytrace=False)
    return result
