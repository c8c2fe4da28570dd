"""The suite ends whatever a test started (support/processes.py, called from conftest.py's hooks): a test that
passes, fails, or times out waiting for a launch leaves no process behind once it ends, though its processes ignore
SIGTERM and the launcher's worker runs in a session of its own, as the workers of torch's launchers do (a killed
launcher leaves them running)."""

import os
import re
import subprocess
import sys

from support.locations import REPO, TESTS

# A launcher and its worker, each recording its pid, both ignoring SIGTERM (a training process saving a checkpoint,
# or hung in a collective, does not stop on it either).
TREE = """\
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pids, role = sys.argv[1], sys.argv[2]
if role == "launcher":
    subprocess.Popen([sys.executable, __file__, pids, "worker"], start_new_session=True)
with open(pids, "a") as file:
    file.write(f"{os.getpid()}\\n")
time.sleep(600)
"""

# Three tests that start the tree through support.commands' helpers (the launch times out, the test fails, the test
# passes), then one that looks for any of their processes.
SCENARIOS = """\
import time
from pathlib import Path

import psutil
import pytest

from support.commands import PYTHON, run_command, start

pytestmark = pytest.mark.processes  # the mark is derived only from the code of tests/
TREE = Path(__file__).with_name("tree.py")


def tree(name):
    return [PYTHON, str(TREE), str(TREE.with_name(name + ".pids")), "launcher"]


def both_started(name):
    pids = TREE.with_name(name + ".pids")
    while not pids.is_file() or len(pids.read_text().split()) < 2:
        time.sleep(0.05)


def test_times_out():
    run_command(tree("times_out"), timeout=5, check=True)  # kills the launcher and raises: the worker runs on


def test_fails(tmp_path):
    start(tree("fails"), tmp_path / "log")
    both_started("fails")
    assert False


def test_passes(tmp_path):
    start(tree("passes"), tmp_path / "log")
    both_started("passes")


def test_each_ended_with_its_test():
    running = []
    for pids in TREE.parent.glob("*.pids"):
        for pid in map(int, pids.read_text().split()):
            try:
                process = psutil.Process(pid)
                if str(TREE) in process.cmdline() and process.status() != psutil.STATUS_ZOMBIE:
                    running.append(process.cmdline())
            except psutil.Error:
                pass
    assert not running
"""


def test_a_test_that_passes_fails_or_times_out_leaves_none_of_its_processes_running(tmp_path):
    (tmp_path / "tree.py").write_text(TREE)
    (tmp_path / "test_scenarios.py").write_text(SCENARIOS)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}  # not an xdist worker
    env["PYTHONPATH"] = str(TESTS)
    # Processes of their own, not forks of a preloaded interpreter: the last scenario finds them by their command line
    env["ACCEL_TRAIN_TESTS_FRESH_INTERPRETERS"] = "1"
    # conftest.py as a plugin (-p conftest, found on PYTHONPATH), with the project's pytest settings
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-c", str(REPO / "pyproject.toml"),
                             "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "tmp"), "-v",
                             str(tmp_path / "test_scenarios.py")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    outcomes = dict(re.findall(r"::(test_\w+) (PASSED|FAILED)", result.stdout))
    assert outcomes == {"test_times_out": "FAILED", "test_fails": "FAILED", "test_passes": "PASSED",
                        "test_each_ended_with_its_test": "PASSED"}, result.stdout[-5000:] + result.stderr[-3000:]
    assert "TimeoutExpired" in result.stdout and "still running at the end of the test were ended" in result.stdout
    for name in ("times_out", "fails", "passes"):  # each tree had started whole
        assert len((tmp_path / f"{name}.pids").read_text().split()) == 2, name
