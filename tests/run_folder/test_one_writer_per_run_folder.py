"""One writer per run folder (run/lease.py): of two starts into one output_dir, locally or in moto's S3, exactly one
trains and the other exits 2 in one line naming the holder; a holder killed with kill -9 is taken over by resume=auto
in one line; a restart by the launcher is the same writer; a lease of the same job not known to be gone is waited for;
a start whose lease was taken over stops; eval and runs read a held folder.

The races on the lease itself run ten times in this process (two threads, each a "start": a Holder naming a live
process); the real two-start races run once each, as commands.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from accel_train.distributed.environment import LauncherEnvironment, launcher_environment
from accel_train.run.checkpoint_files import list_checkpoints
from accel_train.run.layout import LEASE_FILE, read_jsonl, read_starts
from accel_train.run.lease import GONE, HELD, OF_THIS_JOB, Holder, RunFolderHeld, RunLease, judged
from accel_train.storage import Store
from support.commands import PYTHON, accelerate, free_port, run_cli, start, torchrun, train_in_process, wait_for
from support.locations import PROFILES
from support.runs import assert_resumed_from

TRIES = 10
# 20 steps of 24 synthetic images, a checkpoint every 5: a few seconds of training
RUN = ["train", "mnist_cnn", "data.synthetic=true", "data.train_subset=480", "data.eval_subset=50",
       "train.batch_size=24", "train.epochs=1", "train.log_every_steps=1", "checkpoint.every_steps=5",
       "checkpoint.keep_last=10", "train.plot=false"]
WHERE = ["local", pytest.param("s3", marks=pytest.mark.store)]


def run_folder(where: str, request, tmp_path: Path, name: str = "run") -> str:
    """A run folder's location: a local path, or a URL in the test's S3 store."""
    if where == "s3":
        return request.getfixturevalue("object_store").url(f"runs/{name}")
    return str(tmp_path / name)


@pytest.fixture
def stores(request, tmp_path):
    """where -> name -> the Store of a new run folder there (local: made), sharing one S3 client: an S3 client takes
    0.3 to 0.7 s to make, and the tries below need a folder each."""
    made = {}

    def store(where: str, name: str = "run") -> Store:
        location = run_folder(where, request, tmp_path, name)
        if where == "local":
            Path(location).mkdir(parents=True, exist_ok=True)
        if where not in made:
            made[where] = Store(location, "output_dir")
        return made[where].sharing(location)
    return store


def live_start(process: psutil.Process | None = None, **fields) -> Holder:
    """A holder naming a live process of this machine (this one, unless `process`), with a token of its own."""
    me = Holder.this_process()
    if process is None:
        return replace(me, **fields)
    return replace(me, pid=process.pid, process_started=process.create_time(), **fields)


def lease_at(store: Store, holder: Holder, **options) -> RunLease:
    return RunLease(store, store.location, holder, **options)


def lease_record(store: Store) -> dict | None:
    found = store.read_versioned(LEASE_FILE)
    return json.loads(found.data) if found is not None else None


def race(*leases: RunLease) -> list[BaseException | None]:
    """Each lease's take(), all at once (one thread each): what each raised, or None."""
    outcomes: list[BaseException | None] = [None] * len(leases)
    barrier = threading.Barrier(len(leases))

    def contend(index: int) -> None:
        barrier.wait()
        try:
            leases[index].take()
        except BaseException as err:  # handed to the test
            outcomes[index] = err
    threads = [threading.Thread(target=contend, args=(index,)) for index in range(len(leases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


@pytest.mark.parametrize("where", WHERE)
def test_of_two_starts_racing_for_a_run_folder_ten_times_exactly_one_holds_it_and_the_other_is_refused_naming_it(
        where, stores):
    parent = psutil.Process(os.getppid())
    for attempt in range(TRIES):
        store = stores(where, f"race-{attempt}")
        starts = [lease_at(store, live_start()), lease_at(store, live_start(parent))]
        outcomes = race(*starts)
        (winner,) = [lease for lease, outcome in zip(starts, outcomes) if outcome is None]
        (refusal,) = [outcome for outcome in outcomes if outcome is not None]
        assert isinstance(refusal, RunFolderHeld), refusal
        assert f"output_dir={store.location} is being written by another start (host {winner.me.host}, pid " \
               f"{winner.me.pid}, started " in str(refusal), str(refusal)
        assert lease_record(store)["token"] == winner.me.token
        winner.release()
        assert lease_record(store) is None  # released: the next start needs no wait


@pytest.mark.parametrize("where", WHERE)
def test_of_two_starts_taking_over_an_expired_lease_ten_times_exactly_one_wins(where, stores):
    """Both read the same expired lease; the replace is conditional on what each read, so only the first lands."""
    parent = psutil.Process(os.getppid())
    for attempt in range(TRIES):
        store = stores(where, f"taken-{attempt}")
        store.create(LEASE_FILE, live_start(machine="another machine", expiry_s=-1).record())
        starts = [lease_at(store, live_start()), lease_at(store, live_start(parent))]
        outcomes = race(*starts)
        assert sorted(outcome is None for outcome in outcomes) == [False, True], outcomes
        (winner,) = [lease for lease, outcome in zip(starts, outcomes) if outcome is None]
        assert winner.taken_from.startswith(f"output_dir={store.location}: taking over the lease of a start that is "
                                            "gone (host ")
        assert "its lease expired" in winner.taken_from
        assert lease_record(store)["token"] == winner.me.token
        winner.release()


@pytest.mark.parametrize("where", WHERE)
def test_a_lease_is_written_only_where_it_is_absent_or_still_the_version_read(where, stores):
    """What the races above rest on, without their timing: of two takers that read one version, the second's write
    (and a removal by a holder that lost it) is refused."""
    store = stores(where)
    first, second = live_start(), live_start(psutil.Process(os.getppid()))
    assert store.create(LEASE_FILE, first.record()) and store.create(LEASE_FILE, second.record()) is None
    read = store.read_versioned(LEASE_FILE)
    assert store.replace(LEASE_FILE, second.record(), read.version)
    assert store.replace(LEASE_FILE, first.renewed().record(), read.version) is None
    assert not store.remove_version(LEASE_FILE, read.version)
    assert lease_record(store)["token"] == second.token


@pytest.mark.parametrize("where", WHERE)
def test_a_lease_whose_process_has_ended_on_this_machine_is_taken_over_at_once_saying_whose_it_was(where, stores):
    store = stores(where)
    ended = live_start(process_started=1.0)  # this pid, but another process's: the one that had it has ended
    store.create(LEASE_FILE, ended.record())
    taker = lease_at(store, live_start())
    started = time.monotonic()
    taker.take()
    assert time.monotonic() - started < 2
    assert taker.taken_from.startswith(f"output_dir={store.location}: taking over the lease of a start that is gone "
                                       f"(host {ended.host}, pid {ended.pid}, started ")
    assert taker.taken_from.endswith("its process has ended)")
    taker.release()


def test_a_live_holder_on_another_machine_is_refused_at_once_and_one_of_this_job_is_waited_for_until_it_expires(
        stores):
    """The same launcher's job (its run id) on another machine may be this job's main process before a restart: waited
    for until its lease expires, then taken over; a live start of another job is refused at once."""
    store = stores("local")
    elsewhere = live_start(machine="another machine", host="node-7", job="fm-1", expiry_s=1.0)
    store.create(LEASE_FILE, elsewhere.record())

    with pytest.raises(RunFolderHeld, match="host node-7, pid .*, job fm-1, lease renewed 0 s ago"):
        lease_at(store, live_start(job="fm-2"), poll_s=0.05).take()
    same_job = lease_at(store, live_start(job="fm-1"), poll_s=0.05)
    started = time.monotonic()
    same_job.take()
    waited = time.monotonic() - started
    assert 0.9 < waited < 3, waited  # until the lease expired (its mtime 1 s old), not at once
    assert lease_record(store)["token"] == same_job.me.token and "its lease expired" in same_job.taken_from
    same_job.release()


def test_a_lease_of_this_job_renewed_while_it_is_waited_for_is_refused(stores):
    store = stores("local")
    holder = live_start(machine="another machine", job="fm-1", expiry_s=30.0)
    version = store.create(LEASE_FILE, holder.record())
    renew = threading.Timer(0.3, lambda: store.replace(LEASE_FILE, holder.renewed().record(), version))
    renew.start()
    try:
        with pytest.raises(RunFolderHeld, match="it was renewed while this start waited for it, so it still trains"):
            lease_at(store, live_start(job="fm-1"), poll_s=0.05).take()
    finally:
        renew.join()


def test_a_restart_by_the_launcher_is_the_same_writer_and_an_independent_start_on_the_same_port_is_another(
        monkeypatch):
    """The launcher's run id is the job: torchrun's (drawn once per torchrun, or --rdzv_id) names every restart and
    every machine of it; accelerate launch's "none" names nothing, and MASTER_PORT, which two jobs may share, is not
    looked at."""
    monkeypatch.setenv("MASTER_PORT", "29500")
    for run_id, expected in (("none", None), ("", None), ("fm-1", "fm-1")):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        assert launcher_environment().run_id == expected
    holder = live_start(psutil.Process(os.getppid()), machine="another machine", job="fm-1")
    assert judged(holder, 0.0, live_start(job="fm-1")) == OF_THIS_JOB  # its main process moved: waited for
    assert judged(holder, 0.0, live_start(job="fm-2")) == HELD  # same host, same port, another job
    assert judged(holder, 0.0, live_start(job=None)) == HELD
    assert judged(holder, 0.0, live_start(job=None, restart=1)) == OF_THIS_JOB  # a restart: maybe its own
    ended = replace(holder, machine=live_start().machine, process_started=1.0)
    assert judged(ended, 0.0, live_start(job=None)) == GONE
    assert LauncherEnvironment.__dataclass_fields__["run_id"].default is None  # a plain process names no job


@pytest.mark.parametrize("where", WHERE)
def test_a_start_whose_lease_was_taken_over_stops_at_its_next_renewal(where, stores):
    store, ends = stores(where), []
    holder = lease_at(store, live_start(), renew_every_s=0.1, on_lost=ends.append)
    holder.take()
    deadline = time.monotonic() + 5
    while lease_record(store)["serial"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lease_record(store)["serial"] >= 2 and not ends  # renewed, in the background
    taker = live_start(psutil.Process(os.getppid()), host="node-9")
    # taken over as a start does: conditional on the version read, again if a renewal came between
    while not store.replace(LEASE_FILE, taker.record(), store.read_versioned(LEASE_FILE).version):
        assert time.monotonic() < deadline
    while not ends and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ends == [2]
    assert holder.lost.startswith(f"output_dir={store.location}: this start's lease was taken over by another start "
                                  f"(host node-9, pid {taker.pid}, ") and "it stops now" in holder.lost
    holder.release()
    assert lease_record(store)["token"] == taker.token  # the release leaves the taker's lease alone


@pytest.mark.store
def test_a_start_that_cannot_renew_its_lease_stops_before_it_could_expire(object_store):
    store, ends = Store(object_store.url("runs/unreachable"), "output_dir"), []
    holder = lease_at(store, live_start(), renew_every_s=0.2, give_up_s=1.0, on_lost=ends.append)
    holder.take()
    with object_store.down():
        started = time.monotonic()
        while not ends and time.monotonic() - started < 10:
            time.sleep(0.02)
        stopped_after = time.monotonic() - started
    # give_up_s after the last renewal, plus at most one attempt (its store call and retries bounded: 0.5 s each)
    assert ends == [3] and 0.8 < stopped_after < 2.2, (ends, stopped_after)
    assert "this start's lease could not be renewed for" in holder.lost and "before another start may take" in \
        holder.lost
    holder.release()


def test_eval_and_runs_read_a_folder_another_start_holds_and_leave_its_lease_alone(tmp_path, capsys):
    from accel_train import api
    from accel_train.cli import main

    out = tmp_path / "run"
    train_in_process(*RUN[1:], "data.train_subset=48", f"output_dir={out}")
    assert not (out / LEASE_FILE).exists()  # released at the end of the run
    other = lease_at(Store(str(out), "output_dir"), live_start(psutil.Process(os.getppid())))
    other.take()
    held = (out / LEASE_FILE).read_bytes()
    metrics = api.evaluate(str(out))
    assert metrics["num_samples"] == 50
    main(["runs", str(out)])
    assert "run" in capsys.readouterr().out
    assert (out / LEASE_FILE).read_bytes() == held
    other.release()


# Real starts, as commands.


def lease_of(location: str) -> dict | None:
    return lease_record(Store(location, "output_dir"))


def local_copy(where: str, location: str, request, tmp_path: Path) -> Path:
    """The run folder as files here (a URL's objects downloaded)."""
    if where == "local":
        return Path(location)
    copy = tmp_path / "copy"
    request.getfixturevalue("object_store").fs().get(location + "/", str(copy), recursive=True)
    return copy


def train_steps(folder: Path) -> list[int]:
    return [line["step"] for line in read_jsonl(folder / "metrics.jsonl") if line["split"] == "train"]


@pytest.mark.parametrize("where", WHERE)
def test_two_starts_into_one_folder_one_trains_and_the_other_exits_2_naming_it_and_metrics_stay_whole(
        where, request, tmp_path):
    location = run_folder(where, request, tmp_path)
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    both = [start([PYTHON, "-m", "accel_train", *RUN, f"output_dir={location}", "resume=auto"], log) for log in logs]
    deadline = time.monotonic() + 120
    while all(process.poll() is None for process in both):
        assert time.monotonic() < deadline, [log.read_text()[-2000:] for log in logs]
        time.sleep(0.02)
    (refused,) = [index for index, process in enumerate(both) if process.poll() is not None]
    # the other one's, which still trains (in a store, the other may have been refused by its staging's claim, a
    # moment before this one took the lease)
    wait_for(lambda: lease_of(location) is not None, both[1 - refused], logs[1 - refused])
    holder = lease_of(location)
    assert both[1 - refused].wait(timeout=240) == 0, logs[1 - refused].read_text()[-3000:]

    assert both[refused].returncode == 2, logs[refused].read_text()[-3000:]
    (line,) = logs[refused].read_text().splitlines()
    assert line.startswith(f"accel-train: error: output_dir={location} is being written by another start (host "
                           f"{holder['host']}, pid {holder['pid']}, started "), line
    assert line.endswith("let it finish, or stop it (SIGTERM saves a checkpoint) and continue it with resume=auto; "
                         "or pass another output_dir"), line
    folder = local_copy(where, location, request, tmp_path)
    assert train_steps(folder) == list(range(1, 21)) and len(read_starts(folder)) == 1  # one writer's, whole
    assert not (folder / LEASE_FILE).exists()  # released at the end
    assert "run " in run_cli("runs", location).stdout  # `accel-train runs` reads it


@pytest.mark.parametrize("where", WHERE)
def test_a_holder_killed_with_kill_9_is_taken_over_by_resume_auto_in_one_line_and_its_run_continues(
        where, request, tmp_path):
    location, log = run_folder(where, request, tmp_path), tmp_path / "killed.log"
    run = [*RUN, "data.train_subset=960", f"output_dir={location}", "resume=auto"]  # 40 steps
    first = start([PYTHON, "-m", "accel_train", *run], log)
    wait_for(lambda: "checkpoint step 5 saved" in log.read_text(), first, log)
    holder = lease_of(location)
    os.kill(holder["pid"], signal.SIGKILL)  # the training process itself (a command here may be a fork of another)
    first.wait(timeout=30)
    before = local_copy(where, location, request, tmp_path / "before")
    saved = sorted(meta["step"] for _, meta in list_checkpoints(before / "checkpoints"))

    resumed = run_cli(*run).stdout.splitlines()
    (taken,) = [line for line in resumed if "taking over the lease" in line]
    started = re.escape(holder["started"].replace("T", " "))
    assert re.fullmatch(rf"output_dir={re.escape(location)}: taking over the lease of a start that is gone \(host "
                        rf"{holder['host']}, pid {holder['pid']}, started {started}, lease renewed \d+ s ago; its "
                        r"process has ended\)", taken), taken
    assert f"resuming from {location}/checkpoints/step-{saved[-1]:08d}: step {saved[-1]}," in "\n".join(resumed)
    after = local_copy(where, location, request, tmp_path / "after")
    assert [start["step"] for start in read_starts(after)] == [0, saved[-1]]
    assert_resumed_from(after, saved[-1], [line for line in (before / "metrics.jsonl").read_text().splitlines(
        keepends=True) if line.endswith("\n") and json.loads(line)["step"] < saved[-1]])
    assert train_steps(after) == list(range(1, 41))  # the steps after the checkpoint trained again, once
    assert not (after / LEASE_FILE).exists()


def test_a_launcher_restart_takes_the_lease_of_its_killed_main_process_and_a_second_start_meanwhile_is_refused(
        tmp_path):
    """torchrun --max-restarts: the restarted main process is the same writer (its lease taken over in silence);
    another start at 2 processes (accelerate launch) is refused in one line by its main process and the launcher
    ends its other process."""
    out, log, other_log = tmp_path / "run", tmp_path / "job.log", tmp_path / "other.log"
    run = [*RUN, "data.train_subset=1440", f"output_dir={out}", "resume=auto"]  # 60 steps
    # without --master_port, as README's self-healing line: torchrun meets on a free port, under a run id it draws
    job = start([*torchrun("--nproc_per_node", 1, "--max-restarts", 1), *run], log)
    wait_for(lambda: "checkpoint step 5 saved" in log.read_text(), job, log)
    killed = lease_of(str(out))
    os.kill(killed["pid"], signal.SIGKILL)
    wait_for(lambda: (lease_of(str(out)) or killed)["pid"] != killed["pid"], job, log)
    restarted = lease_of(str(out))
    assert (restarted["job"], restarted["restart"]) == (killed["job"], 1) and killed["job"]  # torchrun's run id

    other = start([*accelerate("--config_file", PROFILES / "multi_gpu.yaml", "--num_processes", 2,
                               "--main_process_port", free_port()), *run], other_log)
    assert other.wait(timeout=120) != 0
    said = other_log.read_text()
    (refusal,) = [line for line in said.splitlines() if line.startswith("accel-train: error: ")] or [said[-3000:]]
    assert refusal.startswith(f"accel-train: error: output_dir={out} is being written by another start (host "
                              f"{restarted['host']}, pid {restarted['pid']}, started "
                              f"{restarted['started'].replace('T', ' ')}, job {restarted['job']}, lease renewed "), said
    assert re.search(r"rank\s*: 1 .*\n.*exitcode\s*: -15", said), said[-3000:]  # ended by its launcher

    assert job.wait(timeout=240) == 0, log.read_text()[-3000:]
    assert [start["launcher_restart"] for start in read_starts(out)] == [0, 1]
    assert "taking over the lease" not in log.read_text()  # the same writer: nothing to say
    assert train_steps(out) == list(range(1, 61)) and not (out / LEASE_FILE).exists()


@pytest.mark.store
def test_a_second_start_of_a_run_in_a_store_on_the_same_machine_is_refused_before_it_empties_the_holders_staging(
        object_store, tmp_path, capsys):
    """Each process claims its staging folder before a start empties it: a second `train` or `sweep` of the URL on
    this machine is refused in one line, and the holder's staged files stay."""
    from accel_train.cli import main

    url, log = object_store.url("runs/staged"), tmp_path / "holder.log"
    holder = start([PYTHON, "-c", "import sys, time; from accel_train.run.place import Mirror; mirror = "
                    "Mirror(sys.argv[1], 5); mirror.claim(); mirror.pull(); (mirror.staging / 'metrics.jsonl')"
                    ".write_text('{}'); print('claimed', flush=True); time.sleep(300)", url], log)
    wait_for(lambda: "claimed" in log.read_text(), holder, log, timeout=60)
    from accel_train.run.place import staging_of

    staged = staging_of(url) / "process-0" / "metrics.jsonl"
    claimant = json.loads(staged.parent.with_name("process-0.claim").read_text())  # no lease taken: only staged
    for command, said in ((["train", *RUN[1:], f"output_dir={url}", "resume=auto"],
                           f"accel-train: error: output_dir={url} is being written by another start (host "
                           f"{claimant['host']}, pid {holder.pid}, started {claimant['started'].replace('T', ' ')}): "),
                          (["sweep", "mnist_cnn", "--trials", "2", "--metric", "accuracy",
                            "train.lr=uniform(0.001,0.01)", f"output_dir={url}"],
                           f"accel-train: error: sweep: another sweep (process {holder.pid}) is running in {url} on "
                           "this machine; ")):
        with pytest.raises(SystemExit) as stop:
            main(command)
        (line,) = capsys.readouterr().err.splitlines()
        assert stop.value.code == 2 and line.startswith(said), line
        assert staged.read_text() == "{}"
    holder.kill()


def test_a_process_forked_during_a_local_conditional_write_does_not_keep_the_lease_file_locked(tmp_path):
    """A DataLoader worker forked while the renewal thread held the file's flock shares its descriptor: the write
    unlocks it, so the next write (this process's, or another start's) does not wait for the worker to end."""
    from accel_train import storage

    store = Store(str(tmp_path), "output_dir")
    version = store.create(LEASE_FILE, live_start().record())
    with storage._locked(tmp_path / LEASE_FILE):
        child = os.fork()
        if child == 0:  # pragma: no cover - the forked worker, which outlives the write
            time.sleep(3)
            os._exit(0)
    try:
        started = time.monotonic()
        assert store.replace(LEASE_FILE, live_start().record(), version)
        assert time.monotonic() - started < 1
    finally:
        os.waitpid(child, 0)
