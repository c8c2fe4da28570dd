"""The suite's preloaded interpreter (support/preloaded/): a command it runs behaves as the same command in a fresh
interpreter (arguments, folder, environment, sys.path, streams, exit codes, signals), ends with its command, and a
command whose imports could differ is left to a fresh interpreter."""

import json
import os
import signal
import time

import psutil
import pytest

from support.commands import (
    FRESH_LAUNCHER,
    FRESH_PROCESSES,
    PRELOADED,
    PYTHON,
    run_command,
    start,
    wait_for,
    wait_for_preloaded_interpreter,
)

FRESH = FRESH_PROCESSES  # the same command, in a fresh interpreter
SCRIPT = '''
import json, os, sys, tempfile, time
preloaded = "torch" in sys.modules  # imported by the preload; this script imports nothing of torch
print(json.dumps({"preloaded": preloaded, "argv": sys.argv, "cwd": os.getcwd(),
                  "mark": os.environ.get("ACCEL_TRAIN_MARK"), "path": sys.path[:3], "main": __name__,
                  "file": __file__, "fresh_here": os.environ.get("ACCEL_TRAIN_TESTS_FRESH_HERE"),
                  "temp": tempfile.gettempdir()}))
sys.stdout.flush()
mode = sys.argv[1]
if mode == "exit 3":
    sys.exit(3)
if mode == "message":
    sys.exit("accel-train: a message")
if mode == "raise":
    raise ValueError("boom")
if mode == "interrupt":
    raise KeyboardInterrupt
if mode == "own module":
    import own_module
    print(own_module.VALUE)
if mode == "devices":
    import torch
    print(json.dumps({"cuda": torch.cuda.is_available(), "devices": torch.cuda.device_count()}))
if mode == "child":
    import subprocess
    subprocess.run([sys.executable, __file__, "report"], check=True)
if mode == "sleep":
    import signal
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(75)))
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(120)
'''


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    folder = tmp_path_factory.mktemp("script")
    (folder / "probe.py").write_text(SCRIPT)
    (folder / "modules").mkdir()
    (folder / "modules" / "own_module.py").write_text("VALUE = 'from PYTHONPATH'\n")
    assert wait_for_preloaded_interpreter(), "no preloaded interpreter: ACCEL_TRAIN_TESTS_FRESH_INTERPRETERS=1?"
    return folder


def both(command: list[str], env: dict) -> tuple:
    """(preloaded, fresh): the command's exit code, its first line read as JSON, the rest of stdout, and stderr."""
    results = []
    for extra in (env, {**env, **FRESH}):
        result = run_command(command, timeout=120, check=False, env=extra)
        first, _, rest = result.stdout.partition("\n")
        results.append((result.returncode, json.loads(first), rest, result.stderr))
    return tuple(results)


@pytest.mark.parametrize("mode", ["exit 3", "message", "raise", "interrupt", "own module"])
def test_a_command_runs_in_the_preloaded_interpreter_as_in_a_fresh_one(script, mode):
    env = {"ACCEL_TRAIN_MARK": "this command's", "PYTHONPATH": str(script / "modules"), "TMPDIR": str(script)}
    preloaded, fresh = both([PYTHON, str(script / "probe.py"), mode], env)
    assert preloaded[1].pop("preloaded") and not fresh[1].pop("preloaded")
    assert preloaded[1]["argv"] == [str(script / "probe.py"), mode] and preloaded[1]["mark"] == "this command's"
    assert preloaded[1]["temp"] == str(script)  # the preload's imports had chosen /tmp
    assert preloaded[1]["path"] == [str(script), str(PRELOADED), str(script / "modules")], preloaded[1]
    assert preloaded == fresh  # exit code, output and error output (a traceback without the server's frames)
    assert preloaded[0] == {"exit 3": 3, "message": 1, "raise": 1, "interrupt": -2, "own module": 0}[mode]
    assert ("Traceback" in preloaded[3]) == (mode in ("raise", "interrupt")), preloaded[3]


def test_a_module_runs_as_with_python_dash_m(script):
    command = [PYTHON, "-u", "-m", "accel_train", "--version"]
    preloaded = run_command(command, timeout=120, check=False)
    fresh = run_command(command, timeout=120, check=False, env=FRESH)
    assert (preloaded.returncode, preloaded.stdout, preloaded.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert preloaded.returncode == 0 and preloaded.stdout.strip()


def test_a_command_whose_imports_could_differ_runs_in_a_fresh_interpreter(script):
    preloaded, fresh = both([PYTHON, str(script / "probe.py"), "exit 3"], {"HF_HOME": str(script / "hf")})
    assert not preloaded[1]["preloaded"] and preloaded[:3] == fresh[:3]


def test_what_accelerate_launch_sets_for_its_workers_leaves_them_forks_where_it_changes_nothing(script):
    """accelerate launch sets CUDA_VISIBLE_DEVICES (a profile's gpu_ids) and KMP_* (CPU runs) for its workers: a fork
    takes them where no NVIDIA driver is and torch's OpenMP is not Intel's, and sees what a fresh interpreter sees."""
    env = {"CUDA_VISIBLE_DEVICES": "0", "KMP_AFFINITY": "granularity=fine,compact,1,0", "KMP_BLOCKTIME": "1"}
    preloaded, fresh = both([PYTHON, str(script / "probe.py"), "devices"], env)
    with open("/proc/self/maps") as maps:  # this worker imported torch as the server did
        changes_nothing = not os.path.exists("/dev/nvidiactl") and "libiomp" not in maps.read()
    assert preloaded[1].pop("preloaded") is changes_nothing and not fresh[1].pop("preloaded")
    assert preloaded == fresh


def test_a_signal_to_the_command_reaches_its_fork_and_the_fork_ends_with_its_command(script, tmp_path):
    log, pid_file = tmp_path / "log", tmp_path / "pid"
    command = start([PYTHON, str(script / "probe.py"), "sleep", str(pid_file)], log)
    wait_for(lambda: pid_file.is_file() and pid_file.read_text(), command, log, timeout=60)
    fork = psutil.Process(int(pid_file.read_text()))
    assert fork.pid != command.pid  # a fork of the preloaded interpreter, not the command's own process
    command.send_signal(signal.SIGTERM)
    assert command.wait(timeout=30) == 75 and "got SIGTERM" in log.read_text()

    pid_file.unlink()
    command = start([PYTHON, str(script / "probe.py"), "sleep", str(pid_file)], log)
    wait_for(lambda: pid_file.is_file() and pid_file.read_text(), command, log, timeout=60)
    fork = psutil.Process(int(pid_file.read_text()))
    command.kill()  # SIGKILL: it passes nothing on; the server sees its command gone
    assert command.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while fork.is_running() and fork.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not fork.is_running() or fork.status() == psutil.STATUS_ZOMBIE, "the fork outlived its command"
    assert not os.path.exists(f"/proc/{fork.pid}") or fork.status() == psutil.STATUS_ZOMBIE


def test_a_script_named_relative_to_another_folder_runs_there(script):
    import subprocess

    from support.commands import command_env

    results = [subprocess.run([PYTHON, "probe.py", "exit 3"], cwd=script, env=command_env(extra), capture_output=True,
                              text=True, timeout=120) for extra in ({}, FRESH)]
    preloaded, fresh = ((r.returncode, json.loads(r.stdout.partition("\n")[0]), r.stderr) for r in results)
    assert preloaded[1].pop("preloaded") and not fresh[1].pop("preloaded")
    assert preloaded == fresh and preloaded[1]["cwd"] == str(script) and preloaded[0] == 3


def test_a_launcher_a_test_inspects_starts_fresh_and_the_commands_it_starts_are_forks(script):
    """FRESH_LAUNCHER: psutil finds the launcher's children, and a SIGKILL to one ends its fork with it."""
    result = run_command([PYTHON, str(script / "probe.py"), "child"], timeout=120, check=True, env=FRESH_LAUNCHER)
    launcher, child = (json.loads(line) for line in result.stdout.splitlines()[:2])
    assert (launcher["preloaded"], child["preloaded"]) == (False, True)
    assert launcher["fresh_here"] is None and child["fresh_here"] is None  # taken out of the environment at start
