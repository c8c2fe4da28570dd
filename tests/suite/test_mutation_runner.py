"""Contracts of the mutation check's runner (tests/mutations/run.py) that a developer relies on: it starts only on a
committed tree, and a run that is stopped, whatever the signal, leaves the source as committed or names the
command that restores it. Run on a small git repository with one fake mutation, not on this package."""

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.locations import TESTS

RUNNER = TESTS / "mutations" / "run.py"
ANSWER = "ANSWER = 42\n"
# The test holds while the mutation is applied (HOLD_S), writing its pid where the test below waits for it.
TEST = """import os, pathlib, time
import answer


def test_the_answer():
    if answer.ANSWER != 42:
        pathlib.Path(os.environ.get("MUTATED_FLAG", os.devnull)).write_text(str(os.getpid()))
        time.sleep(float(os.environ.get("HOLD_S", "0")))
    assert answer.ANSWER == 42
"""
DRIVER = """import importlib.util, sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("mutation_runner", {runner!r})
run = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = run
spec.loader.exec_module(run)
mutation = run.Mutation("the answer broken", "answer.py", "ANSWER = 42", "ANSWER = 41", ("test_answer.py",))
sys.exit(run.main(sys.argv[1:], [mutation], Path({repo!r})))
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    """A git repository holding answer.py and its test, committed; the driver that runs the runner on it."""
    root = tmp_path / "repo"
    root.mkdir()
    (root / "answer.py").write_text(ANSWER)
    (root / "test_answer.py").write_text(TEST)
    (root / ".gitignore").write_text("__pycache__/\n")  # as in a real repository: the tests write bytecode
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "answer")
    (tmp_path / "driver.py").write_text(DRIVER.format(runner=str(RUNNER), repo=str(root)))
    return root


def loaded_runner():
    """tests/mutations/run.py as a module, for its functions."""
    spec = importlib.util.spec_from_file_location("mutation_runner", RUNNER)
    runner = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = runner  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(runner)
    finally:
        del sys.modules[spec.name]
    return runner


def run_here(repo: Path, capsys, *args: str) -> tuple[int, str, str]:
    """The runner's main() in this process, on `repo` with the one fake mutation."""
    spec = importlib.util.spec_from_file_location("mutation_runner", RUNNER)
    runner = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = runner
    try:
        spec.loader.exec_module(runner)
        mutation = runner.Mutation("the answer broken", "answer.py", "ANSWER = 42", "ANSWER = 41",
                                   ("test_answer.py",))
        handlers = {handled: signal.getsignal(handled) for handled in runner.HANDLED_SIGNALS}
        try:
            code = runner.main(list(args), [mutation], repo)
        finally:
            for handled, handler in handlers.items():
                signal.signal(handled, handler)
    finally:
        del sys.modules[spec.name]
    out, err = capsys.readouterr()
    return code, out, err


def test_the_mutation_runner_refuses_a_tree_with_uncommitted_changes_naming_them_in_one_line(repo, capsys):
    (repo / "answer.py").write_text(ANSWER + "# an edit\n")
    (repo / "test_answer.py").unlink()
    code, out, err = run_here(repo, capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "refusing to start: uncommitted changes to answer.py, test_answer.py: commit or stash" in err
    git(repo, "checkout", "--", ".")
    (repo / "notes.txt").write_text("untracked files are never touched: they do not block")
    code, out, err = run_here(repo, capsys)
    assert code == 0 and "1 of 1 mutations caught" in out, out + err
    assert (repo / "answer.py").read_text() == ANSWER


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGINT])
def test_a_mutation_run_stopped_by_a_signal_ends_its_tests_and_restores_the_source(repo, tmp_path, sent):
    runner, flag = start_runner(repo, tmp_path)
    pytest_pid = wait_for_mutation(runner, flag)
    runner.send_signal(sent)
    try:
        _, err = runner.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        runner.kill()
        raise
    assert runner.returncode == 128 + sent, err
    assert f"stopped by {sent.name}" in err and "the source is restored" in err
    assert (repo / "answer.py").read_text() == ANSWER and git(repo, "status", "--porcelain") == ""
    assert not alive(pytest_pid), "the tests the runner started outlived it"


def test_a_mutation_run_killed_with_sigkill_said_how_to_restore_and_the_next_start_says_it_again(repo, tmp_path,
                                                                                                 capsys):
    runner, flag = start_runner(repo, tmp_path)
    pytest_pid = wait_for_mutation(runner, flag)
    runner.kill()  # SIGKILL: no handler runs
    runner.communicate()
    os.killpg(pytest_pid, signal.SIGKILL)  # the tests it started (their own process group)
    printed = (tmp_path / "runner.out").read_text()
    assert "answer.py; if killed: git checkout -- answer.py]" in printed, printed
    assert (repo / "answer.py").read_text() == "ANSWER = 41\n"
    code, out, err = run_here(repo, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert ('answer.py still holds the mutation "the answer broken" of a run that was killed; restore it with '
            "`git checkout -- answer.py`") in err
    subprocess.run(["git", "checkout", "--", "answer.py"], cwd=repo, check=True)  # the command it named
    code, out, err = run_here(repo, capsys, "--no-baseline")
    assert code == 0 and "1 of 1 mutations caught" in out, out + err


def start_runner(repo: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    flag = tmp_path / "mutated.flag"
    env = {**os.environ, "HOLD_S": "120", "MUTATED_FLAG": str(flag)}
    with open(tmp_path / "runner.out", "w") as out:
        runner = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), "--no-baseline"], cwd=repo, env=env,
                                  stdout=out, stderr=subprocess.PIPE, text=True)
    return runner, flag


def wait_for_mutation(runner: subprocess.Popen, flag: Path, timeout: float = 60) -> int:
    """The pid of the pytest that runs the test while answer.py is mutated."""
    deadline = time.monotonic() + timeout
    while not (flag.is_file() and flag.read_text()):
        if runner.poll() is not None or time.monotonic() > deadline:
            runner.kill()
            raise AssertionError(f"the mutation was never applied: {runner.communicate()[1]}")
        time.sleep(0.1)
    return int(flag.read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_baseline_checks_every_k_selection_on_its_own_since_pytest_keeps_only_the_last_k():
    runner = loaded_runner()
    tests = ("tests/a.py::-k one", "tests/b.py::test_x", "tests/c.py::-k two", "tests/d.py")
    batches = runner.baseline_batches(tests)
    assert batches == [("tests/b.py::test_x", "tests/d.py"), ("tests/a.py::-k one",), ("tests/c.py::-k two",)]
    assert [runner.pytest_args(batch).count("-k") for batch in batches] == [0, 1, 1]


def test_every_mutation_breaks_text_found_once_in_its_file_and_names_tests_that_exist():
    """A row whose text moved (a renamed function, a module split) would break nothing and be reported caught only
    by luck, or not run at all; a row naming a test that no longer exists would select none."""
    rows = loaded_runner()
    repo = RUNNER.parents[2]
    for mutation in rows.MUTATIONS:
        assert (repo / mutation.file).read_text().count(mutation.original) == 1, mutation.name
        for test in mutation.tests:
            path, _, rest = test.partition("::")
            assert (repo / path).is_file(), (mutation.name, test)
            name = rest.split("[")[0]
            if name and not name.startswith("-k "):
                assert f"def {name}(" in (repo / path).read_text(), (mutation.name, test)


def test_the_mutated_and_the_restored_file_run_as_written_though_bytecode_of_the_other_looks_current(repo):
    """Python takes a file's bytecode as current when the file's size and modification second match it: a mutation
    of the same size written within the second its original was compiled (or restored within the second the mutated
    file was) would otherwise run the other version, the mutation uncaught or the source left broken."""
    runner = loaded_runner()
    answer = repo / "answer.py"
    second = (int(time.time()) - 100) * 10**9

    def imported_answer() -> str:
        """The answer a new process imports, the file's modification time set to `second` first, as if every write
        had happened within it; that process writes its bytecode."""
        os.utime(answer, ns=(second, second))
        env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
        return subprocess.run([sys.executable, "-c", "import answer; print(answer.ANSWER)"], cwd=repo, env=env,
                              capture_output=True, text=True, check=True).stdout.strip()

    assert imported_answer() == "42" and list((repo / "__pycache__").glob("answer.*.pyc"))
    with runner.mutated(runner.Mutation("the answer broken", "answer.py", "ANSWER = 42", "ANSWER = 41", ()), repo):
        assert imported_answer() == "41"
    assert imported_answer() == "42"
