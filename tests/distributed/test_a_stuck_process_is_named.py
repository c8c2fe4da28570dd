"""A stuck process is named (distributed/watchdog.py): when no micro-batch has passed for train.stuck_after_s, every
live process writes its stacks to output_dir/stuck/, the main process says in one line which process stopped (its
host, the step, the function it is blocked in) and that the others waited for it, and every process exits 6. Under
--max_restarts the launcher restarts the group and resume=auto continues from the newest checkpoint.

A worker is blocked on purpose inside a user dataset's __getitem__ (tests/user_code/user_models.py: BlockingPoints):
with data.num_workers=0 in the training process itself; with data.num_workers > 0 in a DataLoader worker, which is
then named, its stacks written beside its process's, and which ends with the job. A run that is slow but goes on (a
long evaluation, a long checkpoint save, a long first step) is not taken for a stuck one.
"""

import json
import re
import socket
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

import accel_train
from accel_train import hooks
from accel_train.config import load_config
from accel_train.distributed import watchdog
from accel_train.errors import UserError
from support.commands import PYTHON, start_launch, wait_for
from support.commands import start as start_command
from support.locations import USER_RECIPE
from support.runs import read_metrics

BOUND_S = 3  # train.stuck_after_s of the launched run
SLACK_S = 10  # the report comes within BOUND_S + SLACK_S of the block, on a loaded 2-core CI machine too
# Process P blocks at its 25th training sample (6 a step; one more builds the model, and the loader reads a batch
# ahead): while its start's third step trains.
CALL = 25
STUCK_RUN = ["train", USER_RECIPE, "data.name=user_models:blocking_points", "data.num_classes=3",
             "data.train_subset=null", "data.args.size=240", "train.max_steps=null", "checkpoint.every_steps=2",
             "train.log_every_steps=1", "train.plot=false", "train.log_with=none", "resume=auto"]


def reports(log) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("accel-train: process ")]


def test_a_blocked_worker_is_named_with_its_host_step_and_function_and_the_restarted_run_resumes(tmp_path):
    # Start 0: process 1 blocks; start 1 (the launcher's restart, resumed): process 0, the main one, blocks.
    out, note, log = tmp_path / "run", tmp_path / "blocked", tmp_path / "log"
    job = start_launch(2, *STUCK_RUN, f"data.args.block=1@{CALL},0@{CALL}", f"data.args.note={note}",
                       f"train.stuck_after_s={BOUND_S}", "train.collective_timeout_s=60", f"output_dir={out}",
                       log=log, launcher_args=("--max_restarts", "1"))
    host, seen = socket.gethostname(), []
    for start, (stopped, waited) in enumerate([(1, 0), (0, 1)]):
        wait_for(lambda n=start: note.is_file() and len(note.read_text().splitlines()) > n, job, log, timeout=240)
        blocked_at = float(note.read_text().splitlines()[start].split()[1])
        wait_for(lambda n=start: len(reports(log)) > n, job, log, timeout=BOUND_S + SLACK_S + 30)
        seconds = time.time() - blocked_at
        line, in_step = reports(log)[start], read_metrics(out, "train")[-1]["step"] + 1
        stacks = {process: (out / "stuck" / f"process-{process}.txt").read_text() for process in (0, 1)}
        seen.append((start, stopped, seconds, in_step))
        assert line.startswith(f"accel-train: process {stopped} on {host} stopped in training step {in_step}, in "
                               f"__getitem__ (tests/user_code/user_models.py:"), line
        assert f"process {waited} waited for it in a collective" in line and f"stacks in {out / 'stuck'}" in line
        assert "(process-0.txt, process-1.txt)" in line and "train.stuck_after_s" in line
        # faulthandler's dump, below the line the watchdog writes first
        assert re.search(r'File ".*user_models\.py", line \d+ in __getitem__', stacks[stopped]), stacks[stopped]
        assert re.search(r"line \d+ in backward", stacks[waited]) and "user_models.py" not in stacks[waited]
        record = json.loads((out / "stuck" / f"process-{stopped}.json").read_text())
        assert (record["process"], record["host"], record["step"], record["function"], record["waiting"]) \
            == (stopped, host, in_step, "__getitem__", False)  # the step in progress, as the line names it
        assert BOUND_S < seconds < BOUND_S + SLACK_S, seconds
    assert job.wait(timeout=BOUND_S + SLACK_S + 30) != 0
    text = log.read_text()
    assert text.count("exitcode  : 6") == 2, text[-3000:]  # each worker's own code, in the launcher's summary
    # Nothing but the lines: no worker's traceback (the one there is the launcher's), no signal said to save
    assert text.count("Traceback (most recent call last)") == 1 and "SIGTERM received" not in text, text[-3000:]
    starts = [json.loads(line) for line in (out / "starts.jsonl").read_text().splitlines()]
    newest_before = max(step for step in range(2, seen[0][3], 2))  # checkpoint.every_steps=2
    assert [(start["launcher_restart"], start["step"]) for start in starts] == [(0, 0), (1, newest_before)]
    assert seen[1][3] > newest_before + 1  # the restarted group trained on from its checkpoint before the second block
    for start, stopped, seconds, in_step in seen:
        print(f"\nstart {start}: process {stopped} blocked in training step {in_step}, named {seconds:.1f} s later "
              f"(train.stuck_after_s={BOUND_S})")


def running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, ended but not yet reaped by its new parent, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def temp():
    """The processes' temporary folder (TMPDIR), where each keeps its folder of DataLoader worker stacks: a short
    path, since multiprocessing binds its sockets there (108 bytes at most)."""
    with tempfile.TemporaryDirectory(prefix="stuck-") as folder:
        yield Path(folder)


@pytest.mark.fresh_interpreters  # signals or inspects the processes themselves (psutil)
@pytest.mark.parametrize("processes", [2, 1], ids=["process 1 of 2 under accelerate launch", "a plain process"])
def test_a_dataloader_worker_blocked_in_getitem_is_named_its_stacks_written_and_it_ends_with_the_job(tmp_path,
                                                                                                      processes, temp):
    # The DataLoader worker of the last process blocks in the user's __getitem__; the training process waits for it
    # in torch's loader. The line names the worker's function, not the loader's wait (_try_get_data). torch's
    # launcher ends each worker's process group; a plain process (accel-train train alone) has no launcher to.
    # The worker reads two batches ahead of the step: alone (batches of 12) it blocks while step 4 trains, past the
    # first step of the start (not timed)
    out, note, log, stopped = tmp_path / "run", tmp_path / "blocked", tmp_path / "log", processes - 1
    call = CALL if processes == 2 else 5 * 12 + 1
    run = [*STUCK_RUN, f"data.args.block={stopped}@{call}", f"data.args.note={note}", "data.num_workers=1",
           f"train.stuck_after_s={BOUND_S}", "train.collective_timeout_s=60", f"output_dir={out}"]
    job = start_launch(2, *run, log=log, env={"TMPDIR": str(temp)}) if processes == 2 else \
        start_command([PYTHON, "-m", "accel_train", *run], log, env={"TMPDIR": str(temp)})
    wait_for(lambda: note.is_file() and note.read_text().endswith("\n"), job, log, timeout=240)
    worker = int(note.read_text().split()[2])
    wait_for(lambda: reports(log), job, log, timeout=BOUND_S + SLACK_S + 30)
    line, in_step = reports(log)[0], read_metrics(out, "train")[-1]["step"] + 1
    assert line.startswith(f"accel-train: process {stopped} on {socket.gethostname()} stopped in training step "
                           f"{in_step}, in __getitem__ (tests/user_code/user_models.py:"), line
    assert f") in DataLoader worker {worker};" in line and "_try_get_data" not in line, line
    record = json.loads((out / "stuck" / f"process-{stopped}.json").read_text())
    assert (record["function"], record["worker"], record["step"]) == ("__getitem__", worker, in_step)
    # below the training process's own stacks, the worker's (faulthandler's, asked for by a signal)
    own, _, of_worker = (out / "stuck" / f"process-{stopped}.txt").read_text().partition(
        f"DataLoader worker {worker} of process {stopped}:")
    assert "in _try_get_data" in own and not re.search(r'File ".*user_models\.py"', own), own
    assert re.search(r'File ".*user_models\.py", line \d+ in __getitem__', of_worker), of_worker
    code = job.wait(timeout=BOUND_S + SLACK_S + 30)
    assert code == 6 if processes == 1 else code != 0 and "exitcode  : 6" in log.read_text(), log.read_text()[-3000:]
    # the blocked worker never notices that its process is gone: it ends with it, not left running on its own
    gone_by = time.monotonic() + 5
    while running(worker) and time.monotonic() < gone_by:
        time.sleep(0.1)
    assert not running(worker), f"DataLoader worker {worker} still runs after its job ended"
    assert not list(temp.glob("accel-train-workers-*")), "the stuck process left its folder of worker stacks"


def test_a_blocked_worker_of_a_run_in_a_bucket_is_named_and_its_stacks_reach_the_bucket(object_store, tmp_path):
    # Each process stages the run in a folder of its own: the processes share no disk, and meet in the store's stuck/.
    url, note, log = object_store.url("runs/stuck"), tmp_path / "blocked", tmp_path / "log"
    job = start_launch(2, *STUCK_RUN, f"data.args.block=1@{CALL}", f"data.args.note={note}",
                       f"train.stuck_after_s={BOUND_S}", "train.collective_timeout_s=60", f"output_dir={url}",
                       log=log, env={"ACCEL_TRAIN_STAGING": str(tmp_path / "staging")})
    wait_for(lambda: reports(log), job, log, timeout=240)
    line = reports(log)[0]
    assert line.startswith(f"accel-train: process 1 on {socket.gethostname()} stopped in training step "), line
    assert "in __getitem__ (tests/user_code/user_models.py:" in line and "process 0 waited for it" in line, line
    assert f"stacks in {url}/stuck/ (process-0.txt, process-1.txt)" in line, line
    assert job.wait(timeout=BOUND_S + SLACK_S + 30) != 0
    assert log.read_text().count("exitcode  : 6") == 2, log.read_text()[-3000:]
    stacks = object_store.fs().cat_file(f"{url}/stuck/process-1.txt").decode()
    assert re.search(r'File ".*user_models\.py", line \d+ in __getitem__', stacks), stacks
    record = json.loads(object_store.fs().cat_file(f"{url}/stuck/process-1.json"))
    assert (record["process"], record["function"], record["waiting"]) == (1, "__getitem__", False)


class Paced(torch.utils.data.Dataset):
    """Random samples, each served after `pause(call)` seconds (its call counted from 1), or blocked at `block_at`
    until `released` (20 s at most: a test that fails does not hang)."""

    classes = ["a", "b", "c"]

    def __init__(self, size: int, seed: int, pause=lambda call: 0.0, block_at: int | None = None) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, 1, 4, 4, generator=generator)
        self.labels = torch.randint(0, 3, (size,), generator=generator)
        self.pause, self.block_at, self.calls, self.released = pause, block_at, 0, threading.Event()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        self.calls += 1
        if self.calls == self.block_at:
            self.released.wait(timeout=20)
        time.sleep(self.pause(self.calls))
        return self.inputs[index], self.labels[index]


class SlowFirstForward(torch.nn.Module):
    """A linear classifier whose first training forward pass takes `first_s` seconds, as torch.compile's does."""

    def __init__(self, first_s: float = 0.0) -> None:
        super().__init__()
        self.linear, self.first_s = torch.nn.Linear(16, 3), first_s

    def forward(self, x):
        if self.training and self.first_s:
            time.sleep(self.first_s)
            self.first_s = 0.0
        return self.linear(x.flatten(1))


def train_paced(tmp_path, train_data: Paced, eval_data: Paced, *overrides: str, first_s: float = 0.0) -> dict:
    return accel_train.train(USER_RECIPE, ["data.train_subset=null", "train.max_steps=null", "train.plot=false",
                                           "train.log_with=none", f"output_dir={tmp_path}", *overrides],
                             model=SlowFirstForward(first_s), train_dataset=train_data, eval_dataset=eval_data)


class Ends(hooks.Hooks):
    """A stuck process's end, noted instead of ending this test's process; and a slow first checkpoint, if asked."""

    def __init__(self, when_ended=None, first_save_s: float = 0.0, after_first_step_s: float = 0.0) -> None:
        self.ended, self.when_ended, self.first_save_s = [], when_ended, first_save_s
        self.after_first_step_s = after_first_step_s

    def process_ends(self, code):
        self.ended.append(code)
        if self.when_ended:
            self.when_ended(code)
        return False

    def checkpoint_saving(self, progress):
        time.sleep(self.first_save_s if progress.step == 2 else 0)

    def optimizer_stepped(self, progress, terms, skipped, lr):
        time.sleep(self.after_first_step_s if progress.step == 1 else 0)


def test_a_single_process_that_stops_names_itself_and_ends_with_exit_6(tmp_path, capsys):
    ended = []
    # Batch 12 at 1 process; the model is built from one sample, and the loader reads a batch ahead: the 40th call
    # is read for step 4 while step 3 trains. The first step of a start is not timed.
    train_data = Paced(60, 0, block_at=40)

    def end_process(code):  # instead of os._exit: note the code and the step, let the dataset go on: the run ends
        ended.append((code, read_metrics(tmp_path, "train")[-1]["step"] + 1))
        train_data.released.set()

    with hooks.added(Ends(end_process)):
        train_paced(tmp_path, train_data, Paced(20, 1), "train.stuck_after_s=0.5")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("accel-train: process")]
    (code, in_step), = ended
    assert code == 6 and len(lines) == 1, lines
    assert lines[0].startswith(f"accel-train: process 0 on {socket.gethostname()} stopped in training step {in_step}, "
                               "in __getitem__ (tests/distributed/test_a_stuck_process_is_named.py:"), lines[0]
    assert "waited" not in lines[0] and "(process-0.txt)" in lines[0]
    stacks = (tmp_path / "stuck" / "process-0.txt").read_text()
    assert re.search(r'File ".*test_a_stuck_process_is_named\.py", line \d+ in __getitem__', stacks), stacks


def test_a_long_evaluation_checkpoint_save_or_first_step_is_not_taken_for_a_stuck_process(tmp_path):
    # Each lasts 0.75 s, past train.stuck_after_s=0.5 by 5 of the watchdog's ticks (a tenth of it): the evaluation in
    # batches that keep coming, the save and the first step of the start untimed. Steps: 2 an epoch, 2 epochs, an
    # evaluation and a save after each. The time between the first step's end and the next micro-batch (0.2 s here,
    # a log line or a hook) is timed from that end, not from the first step's micro-batch, which came before its long
    # forward pass (0.95 s before).
    ends = Ends(first_save_s=0.75, after_first_step_s=0.2)
    eval_data = Paced(20, 1, pause=lambda call: 0.075 if call <= 20 else 0.0)  # the first evaluation: 10 batches
    with hooks.added(ends):
        metrics = train_paced(tmp_path, Paced(24, 0), eval_data, "train.epochs=2", "train.eval_batch_size=2",
                              "train.stuck_after_s=0.5", first_s=0.75)
    assert ends.ended == [] and not (tmp_path / "stuck").exists()
    assert metrics["num_samples"] == 20 and [line["step"] for line in read_metrics(tmp_path, "test")] == [2, 4]


def test_the_line_names_processes_that_did_not_answer_and_waits_at_different_collectives(tmp_path):
    def record(process, waiting, function):
        return {"process": process, "phase": "training", "step": 6, "function": function, "file": "f.py", "line": 1,
                "waiting": waiting, "stacks": f"process-{process}.txt"}

    hosts = ["a", "a", "b"]
    silent = watchdog.describe({0: record(0, True, "all_reduce")}, hosts, 5, f"{tmp_path}/")
    assert silent.startswith("processes 1 and 2 on a, b did not answer (dead, frozen, or in a C call that never lets "
                             "go of Python's lock); process 0 waited for them in a collective; no progress for more "
                             "than 5 s (train.stuck_after_s)"), silent
    every = watchdog.describe({p: record(p, True, "all_reduce") for p in range(3)}, hosts, 5, f"{tmp_path}/")
    assert every.startswith("every process waits in a collective, none stopped elsewhere"), every


@pytest.mark.parametrize("overrides", [["train.stuck_after_s=600"], ["train.collective_timeout_s=60",
                                                                      "train.stuck_after_s=90"]])
def test_a_bound_not_below_the_collective_timeout_is_refused_naming_both_keys(overrides):
    with pytest.raises(UserError, match=r"train.stuck_after_s=\d+ must be below train.collective_timeout_s=\d+"):
        load_config("mnist_cnn", overrides)


@pytest.mark.parametrize("phase, said", [("training", "training step 12"),
                                         ("evaluation", "the evaluation after step 11")])
def test_a_processs_record_names_the_step_its_line_names(tmp_path, phase, said):
    """11 steps done: training is in step 12, an evaluation comes after step 11; record and line say the same."""
    from types import SimpleNamespace

    from accel_train.config import TrainConfig
    from accel_train.state import Progress

    progress = Progress(steps_per_epoch=10, total_steps=30, step=11)
    dog = watchdog.Watchdog(SimpleNamespace(process_index=0), TrainConfig(stuck_after_s=5), progress, tmp_path,
                            SimpleNamespace(quiet=False))
    dog.hosts, dog.attempt = ["here"], "a"
    dog.mark(phase)
    record = dog._record(0)
    assert record["step"] == (12 if phase == "training" else 11)
    assert watchdog.where(record).startswith(f"{said}, in ")
    assert json.loads((tmp_path / "process-0.json").read_text())["step"] == record["step"]
