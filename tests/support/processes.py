"""The processes a test starts: every one ends with the test, and a test that starts any is marked `processes`
(make test-fast leaves those out). tests/conftest.py calls these from pytest's hooks.

Ending them. Whatever starts a process (the helpers of support/, a test's own subprocess call, a library), one
started through subprocess while a test runs gets a token in its environment, and its descendants inherit it: a
launcher's workers too, though torch's launchers start each worker in a session of its own, so that it outlives a
launcher killed at a timeout. When the test's teardown is done, every process that carries a token of that test gets
SIGTERM, and SIGKILL `ENDING_GRACE_S` later if it ignores it (a training process handles SIGTERM by saving a
checkpoint, and one hung in a collective never gets there).

The mark. It is derived from the code a test runs: the test, its fixtures and parameters, and every function and
class of tests/ (support/ included) they name, followed through: one that names a way to start a process
(subprocess, os.system, fork, pty) starts processes. Code outside tests/ is not read: a test whose processes a library
starts (torch.compile runs a C++ compiler) carries the mark itself, and a test without the mark that starts a process
fails, naming what it started.
"""

from __future__ import annotations

import builtins
import dis
import functools
import inspect
import os
import pty
import random
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import pytest

from support.locations import TESTS

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


def track() -> None:
    """From here, what is started through subprocess carries a token (subprocess.run and the rest look Popen up in
    their module when called)."""
    subprocess.Popen = _TrackedPopen


def untrack() -> None:
    """Outside tests (collection, pytest-xdist's own workers) nothing is tracked."""
    subprocess.Popen = _PLAIN_POPEN


def started_commands() -> list[str]:
    """The command lines started through subprocess since end_started() last ran."""
    return [" ".join(map(str, process.args)) if isinstance(process.args, list) else str(process.args)
            for _, process in _started]


def carrying(tokens: set[str]) -> list:
    """The live processes whose environment carries one of `tokens` (zombies have none left)."""
    import psutil

    found = []
    if not tokens:  # a test that started nothing: no need to read every process's environment (9 ms a test)
        return found
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


_STARTERS = {id(starter) for starter in (
    _PLAIN_POPEN, _TrackedPopen, subprocess.run, subprocess.call, subprocess.check_call, subprocess.check_output,
    subprocess.getoutput, subprocess.getstatusoutput, os.system, os.popen, os.fork, os.forkpty, os.posix_spawn,
    os.posix_spawnp, os.spawnv, os.spawnve, os.spawnvp, os.spawnvpe, os.spawnl, os.spawnle, os.spawnlp,
    os.spawnlpe, os.execv, os.execve, os.execvp, os.execvpe, pty.fork, pty.spawn)}


def starts_processes(item: pytest.Item) -> bool:
    """Whether the code `item` runs (the test, its fixtures and parameters, and the code of tests/ they name)
    names a way to start a process."""
    walk = _Walk()
    named = [item.obj, *getattr(getattr(item, "callspec", None), "params", {}).values()]
    named += [fixture.func for name in item.fixturenames
              for fixture in item._fixtureinfo.name2fixturedefs.get(name, ())]
    return any(_starts(thing, walk) for thing in named)


class _Walk:
    """The code one test's walk has met (a function met again is not read again), and how often it met one again."""

    def __init__(self):
        self.seen: set = set()
        self.met_again = 0


def _starts(thing, walk: _Walk) -> bool:
    """Whether `thing` is a way to start a process, or code of tests/ that names one."""
    if id(thing) in _STARTERS:
        return True
    if isinstance(thing, _Inner):
        return _code_starts(thing.code, thing.namespace, walk)
    if isinstance(thing, (list, tuple, set, frozenset, dict)):
        return any(_starts(part, walk) for part in (thing.values() if isinstance(thing, dict) else thing))
    if isinstance(thing, type) and _in_tests(getattr(sys.modules.get(thing.__module__), "__file__", None)):
        return any(_starts(member, walk) for member in vars(thing).values())
    function = inspect.unwrap(getattr(thing, "__func__", thing)) if callable(thing) else None
    code = getattr(function, "__code__", None)
    return code is not None and _in_tests(code.co_filename) and _code_starts(code, function.__globals__, walk)


@functools.cache
def _in_tests(filename: str | None) -> bool:
    """Whether `filename` is in tests/ or a folder under it (support/, the test folders)."""
    return filename is not None and Path(filename).resolve().is_relative_to(TESTS)


# (code, its namespace) -> whether it starts a process, kept across tests: found once, or known not to once read to
# the end without meeting code its walk had met (a False below that may stand only for the first meeting's answer)
_STARTS: dict = {}


def _code_starts(code, namespace: dict, walk: _Walk) -> bool:
    key = (code, id(namespace))
    if key in _STARTS:
        return _STARTS[key]
    if code in walk.seen:
        walk.met_again += 1
        return False
    walk.seen.add(code)
    met_again = walk.met_again
    starts = any(_starts(named, walk) for named in _named_by(code, namespace))
    if starts or walk.met_again == met_again:
        _STARTS[key] = starts
    return starts


_NAMED_BY: dict = {}  # code -> what it names: each function is read once, not once per test that reaches it


def _named_by(code, namespace: dict) -> list:
    """What `code` (and the functions and classes defined in it) loads by name: globals, modules, their attributes."""
    key = (code, id(namespace))
    if key in _NAMED_BY:
        return _NAMED_BY[key]
    named = []
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
        if current is not None:
            named.append(current)
    named += [_Inner(const, namespace) for const in code.co_consts if inspect.iscode(const)]
    _NAMED_BY[key] = named
    return named


class _Inner:
    """A function or class body defined inside another, read with the namespace of the code around it."""

    def __init__(self, code, namespace: dict):
        self.code, self.namespace = code, namespace
