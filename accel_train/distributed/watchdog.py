"""A stuck process is named: when no micro-batch has passed for train.stuck_after_s, every live process writes its
stacks into output_dir/stuck/, the main process says in one line which processes stopped, where, at which step and on
which host, and every process ends itself with exit code 6 (errors.Stuck).

The loop marks progress (`mark`: a phase and a monotonic time, no lock) at every micro-batch of training and
evaluation; checkpoint saves and exports are not timed (`paused`: long for a large model, and every process is in
them), nor is the first optimizer step of each start (compilation, DataLoader workers starting). A daemon thread looks
about once a second. It runs while the main thread is blocked in C (a collective, a lock, a read, a sleep), since
Python lets go of the GIL there, and `faulthandler` dumps every thread's stack from it.

No collective and no message: when one process stops, the others block in their next collective within a micro-batch,
so each one's own clock fires within a micro-batch of the stopped one's. Each writes its stacks and a record (where
its main thread is: a phase, a step, the innermost frame outside the standard library, and whether that is inside a
collective) into the run folder, which the machines share for checkpoints anyway; a run folder in object storage is no
folder they share (each process writes into staging of its own), so there every file also goes to the store's stuck/
and is read from there. The main process reads the records,
names the processes that are not waiting in a collective as the stopped ones, and those without a record as not
answering (dead, frozen by SIGSTOP, or a C call that never lets go of the GIL), writes its line to report.json and
exits; the others exit once that file is there. All of it before train.collective_timeout_s, after which torch ends
the waiting processes with its own error.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import sysconfig
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from accel_train import hooks
from accel_train.console import NOLOCK
from accel_train.distributed.environment import host_name
from accel_train.errors import Stuck

logger = logging.getLogger(__name__)

STUCK_DIR = "stuck"  # in the run folder
STUCK_STACKS_FILE = "process-{process}.txt"  # faulthandler's dump of every thread of that process
STUCK_RECORD_FILE = "process-{process}.json"  # where it was: phase, step, innermost frame, waiting in a collective
STUCK_REPORT_FILE = "report.json"  # the main process's line; the others end once it is there

TRAINING, EVALUATION = "training", "evaluation"
ANSWER_S = 2.0  # beyond the longest stretch between marks seen: how long the main process waits for the others' records
POLL_S = 0.05
# A main thread in one of these waits for the other processes: in a collective, or in backward, where DDP (and FSDP)
# wait for the gradient all-reduce at the end.
WAITING_IN = (f"torch{os.sep}distributed{os.sep}", f"torch{os.sep}nn{os.sep}parallel{os.sep}",
              f"torch{os.sep}autograd{os.sep}")
STANDARD_LIBRARY = tuple({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})
INSTALLED = tuple(f"{os.sep}{folder}{os.sep}" for folder in ("site-packages", "dist-packages"))
LOADER_WAIT = f"torch{os.sep}utils{os.sep}data{os.sep}"  # a main thread here waits for a DataLoader worker


def stuck_after_s(train) -> float:
    """train.stuck_after_s, or half of train.collective_timeout_s when it is unset; 0: off."""
    return train.collective_timeout_s / 2 if train.stuck_after_s is None else train.stuck_after_s


def end_process(code: int) -> None:
    """Exit now, from any thread: the main thread is blocked and would never run Python's clean-up. The processes
    this one started (DataLoader workers, one perhaps blocked in a dataset's __getitem__) end with it: a blocked
    worker never notices that its parent is gone, and under --max_restarts they would pile up."""
    import psutil

    sys.stdout.flush()
    sys.stderr.flush()
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
    if "folder" in _WORKER_STACKS:  # os._exit runs no atexit: the folder of worker stacks would stay in the temp dir
        import shutil

        shutil.rmtree(_WORKER_STACKS["folder"], ignore_errors=True)
    os._exit(code)


# A DataLoader worker writes its stacks (faulthandler, every thread) into this process's folder of worker stacks when
# sent WORKER_DUMP_SIGNAL: the watchdog names the function a worker is blocked in, not the loader's wait for it.
WORKER_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)
WORKER_STACKS_FILE = "worker-{pid}.txt"
WORKER_ANSWER_S = 1.0  # how long the watchdog waits for a worker's stacks
_WORKER_STACKS: dict = {}  # this process's folder ("folder"); in a worker, its open file ("file")


def worker_stacks_folder() -> Path:
    """This process's folder for its DataLoader workers' stacks: made once, removed when the process exits."""
    if "folder" not in _WORKER_STACKS:
        import atexit
        import shutil
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="accel-train-workers-"))
        atexit.register(shutil.rmtree, folder, True)
        _WORKER_STACKS["folder"] = folder
    return _WORKER_STACKS["folder"]


def stacks_on_request(folder: str, worker_id: int) -> None:
    """A DataLoader's worker_init_fn: from now on WORKER_DUMP_SIGNAL makes this worker write its stacks into
    `folder`. faulthandler writes from C, so a worker blocked in C (a lock, a read) answers too."""
    if WORKER_DUMP_SIGNAL is None:
        return
    _WORKER_STACKS["file"] = open(Path(folder) / WORKER_STACKS_FILE.format(pid=os.getpid()), "w")
    faulthandler.register(WORKER_DUMP_SIGNAL, file=_WORKER_STACKS["file"], all_threads=True)


def worker_stacks() -> list[tuple[int, str]]:
    """(pid, stacks) of each DataLoader worker of this process that answers within WORKER_ANSWER_S."""
    import psutil

    folder = _WORKER_STACKS.get("folder")
    if folder is None or WORKER_DUMP_SIGNAL is None:
        return []
    asked = []
    for child in psutil.Process().children():
        path = folder / WORKER_STACKS_FILE.format(pid=child.pid)
        if path.is_file():
            try:
                child.send_signal(WORKER_DUMP_SIGNAL)
                asked.append((child.pid, path))
            except psutil.Error:
                pass
    deadline = time.monotonic() + WORKER_ANSWER_S
    while time.monotonic() < deadline and not all(path.stat().st_size for _, path in asked):
        time.sleep(POLL_S)
    time.sleep(POLL_S)  # the last lines of a dump still being written
    return [(pid, path.read_text()) for pid, path in asked if path.stat().st_size]


def blocked_worker_frame(stacks: str) -> tuple[str, str, int] | None:
    """(function, file, line) where a worker's main thread is, from faulthandler's text; None where that is only the
    DataLoader's own worker loop (the worker waits for work, it is not the blocked one)."""
    import re

    current = stacks.split("Current thread", 1)[-1]
    for path, line, function in re.findall(r'File "([^"]+)", line (\d+) in (\S+)', current):
        if in_standard_library(path):
            continue
        if f"torch{os.sep}utils{os.sep}data{os.sep}" in path:
            return None
        return function, shown(path), int(line)
    return None


class Shared(Protocol):
    """The folder every process reaches where they share no disk (storage.Store: the run's stuck/ in a store)."""

    def put(self, source: Path, name: str) -> None: ...
    def read(self, name: str) -> bytes: ...
    def url(self, name: str = "") -> str: ...


class Watchdog:
    """`with Watchdog(...) as watchdog:` around training, on every process; `watchdog.mark()` at each micro-batch.
    `folder`: where this process writes its files; `shared`: where the processes meet when that folder is its own."""

    def __init__(self, accelerator, train, progress, folder: Path, signals, shared: Shared | None = None) -> None:
        self.accelerator, self.progress, self.folder, self.signals = accelerator, progress, Path(folder), signals
        self.shared = shared
        # the folder of the stacks as the line names it: where every process's are
        self.shown = shared.url() + "/" if shared is not None else f"{self.folder}{os.sep}"
        self.bound = stuck_after_s(train)
        # The main process waits for the others' records at most this long: its report, and the others' exits,
        # come before the collective timeout ends the processes that wait.
        self.answer_limit = (train.collective_timeout_s - self.bound) / 2
        self.phase, self.last = TRAINING, None  # the last mark: its phase and monotonic time (None: not timed)
        self.first_step = progress.step  # each start's first optimizer step is not timed
        self.longest = 0.0  # the longest stretch between marks seen so far
        self.hosts, self.attempt = [], ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def mark(self, phase: str = TRAINING) -> None:
        """A micro-batch arrived: progress. Two stores, called at every micro-batch."""
        self.phase, self.last = phase, time.monotonic()

    def mark_evaluation(self) -> None:
        self.mark(EVALUATION)

    @contextmanager
    def paused(self):
        """Not timed: a checkpoint save or an export, which every process is in, and which take long for a large
        model. A hang in one is left to train.collective_timeout_s."""
        self.last = None
        try:
            yield
        finally:
            self.last = time.monotonic()

    def __enter__(self) -> Watchdog:
        if self.bound:
            from accelerate.utils import gather_object

            # Every process's host (a process that never answers is named with its host) and an attempt of process
            # 0's, so that records and reports of an earlier start in the same folder are not taken for this one's.
            here = host_name()
            gathered = gather_object([(here, f"{here}-{os.getpid()}-{time.time()}")])
            self.hosts, self.attempt = [host for host, _ in gathered], gathered[0][1]
            self._thread = threading.Thread(target=self._watch, name="accel-train watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        # Ended here, not left to the interpreter's exit: a daemon thread still running when Python finalizes is
        # ended by pthread_exit, which aborted the process (SIGABRT, "terminate called without an active exception")
        # after a signal's stop on a loaded machine.
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        tick = min(1.0, self.bound / 10)
        timed_from = None  # when the first step was seen ended: its last mark came before its long forward pass
        while not self._stop.wait(tick):
            last = self.last
            if last is None or self.progress.step == self.first_step:
                continue
            timed_from = timed_from or time.monotonic()
            idle = time.monotonic() - max(last, timed_from)
            if idle > self.bound:
                self._report()
                return
            self.longest = max(self.longest, idle)

    def _report(self) -> None:
        self.signals.quiet = True  # the launcher's SIGTERM, once another process has ended, changes nothing now
        process = self.accelerator.process_index
        record = self._record(process)
        if process == 0:
            records = self._collect(record)
            line = describe(records, self.hosts, self.bound, self.shown)
            logger.error(line, extra=NOLOCK)
            self._write(self.folder / STUCK_REPORT_FILE, {"attempt": self.attempt, "line": line})
        elif not self._reported():
            logger.error(f"process {process}: {where(record)}; no progress for more than {self.bound:g} s "
                         f"(train.stuck_after_s) and the main process did not report; stacks in "
                         f"{self.shown}{record['stacks']}", extra=NOLOCK)
        if hooks.every().process_ends(Stuck.exit_code):
            end_process(Stuck.exit_code)

    def _record(self, process: int) -> dict:
        """Write this process's stacks, then its record; the record, which says where its main thread is."""
        frames = main_thread_frames()
        function, file, line = innermost_of_ours(frames)
        record = {"attempt": self.attempt, "process": process, "host": self.hosts[process], "phase": self.phase,
                  "step": self.progress.step + (self.phase == TRAINING), "function": function, "file": file,
                  "line": line, "worker": None,
                  "waiting": any(marker in frame.f_code.co_filename for frame in frames for marker in WAITING_IN),
                  "stacks": STUCK_STACKS_FILE.format(process=process)}
        workers = worker_stacks() if any(LOADER_WAIT in frame.f_code.co_filename for frame in frames) else []
        for pid, stacks in workers:  # waiting for a DataLoader worker: name where the worker is blocked
            if (frame := blocked_worker_frame(stacks)) is not None:
                (record["function"], record["file"], record["line"]), record["worker"] = frame, pid
                break
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / record["stacks"], "w") as stacks:
                stacks.write(f"process {process} on {record['host']}: {where(record)}, no progress for more than "
                             f"{self.bound:g} s (train.stuck_after_s); every thread, most recent call first:\n\n")
                stacks.flush()
                faulthandler.dump_traceback(stacks, all_threads=True)
                for pid, text in workers:
                    stacks.write(f"\nDataLoader worker {pid} of process {process}:\n\n{text}")
        except OSError as err:
            record["stacks"] = f"not written: {err}"
        else:
            self._publish(self.folder / record["stacks"])
        self._write(self.folder / STUCK_RECORD_FILE.format(process=process), record)
        return record

    def _write(self, path: Path, content: dict) -> None:
        """Whole or not at all: a reader on another machine never sees half of it."""
        partial = path.with_name(f".{path.name}.partial")
        try:
            partial.write_text(json.dumps(content))
            os.replace(partial, path)
        except OSError:
            return  # the line says what it can; a folder that cannot be written is no reason not to end
        self._publish(path)

    def _publish(self, path: Path) -> None:
        """A file written into this process's folder, where the others read it too (the store, whole or not at all)."""
        if self.shared is not None:
            try:
                self.shared.put(path, path.name)
            except Exception:  # a store that is down is no reason not to end either; the line names who did not answer
                pass

    def _read(self, path: Path) -> dict | None:
        try:
            content = json.loads(self.shared.read(path.name) if self.shared is not None else path.read_text())
        except Exception:  # not there (yet), half a file, or a store that does not answer: read again, or go without
            return None
        return content if content.get("attempt") == self.attempt else None

    def _collect(self, own: dict) -> dict[int, dict]:
        """The records of this attempt, every process's or as many as come in time."""
        records = {own["process"]: own}
        deadline = time.monotonic() + min(ANSWER_S + self.longest, self.answer_limit)
        while len(records) < len(self.hosts):
            for process in set(range(len(self.hosts))) - set(records):
                if (record := self._read(self.folder / STUCK_RECORD_FILE.format(process=process))) is not None:
                    records[process] = record
            if len(records) == len(self.hosts) or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        return records

    def _reported(self) -> bool:
        """Wait for the main process's report (it waits for this process's record, then writes it)."""
        deadline = time.monotonic() + 2 * min(ANSWER_S + self.longest, self.answer_limit)
        while time.monotonic() < deadline:
            if self._read(self.folder / STUCK_REPORT_FILE) is not None:
                return True
            time.sleep(POLL_S)
        return False


def main_thread_frames() -> list:
    """The main thread's frames, innermost first (read from this thread: sys._current_frames)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def innermost_of_ours(frames: list) -> tuple[str, str, int]:
    """(function, file, line) of the innermost frame outside Python's standard library: the call that blocks, rather
    than threading's wait or the lock inside it."""
    if not frames:
        return "?", "?", 0
    ours = [frame for frame in frames if not in_standard_library(frame.f_code.co_filename)]
    frame = (ours or frames)[0]
    return frame.f_code.co_name, shown(frame.f_code.co_filename), frame.f_lineno


def in_standard_library(path: str) -> bool:
    """Python's own modules (threading, queue, selectors, frozen ones), not those installed beside them (a venv's
    site-packages is under its platstdlib)."""
    return path.startswith("<") or (path.startswith(STANDARD_LIBRARY) and not any(part in path for part in INSTALLED))


def shown(path: str) -> str:
    """A file as a line names it: from the package's folder for an installed one, relative to here when below it."""
    for folder in INSTALLED:
        if folder in path:
            return path.rsplit(folder, 1)[1]
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def where(record: dict) -> str:
    """`training step 8, in __getitem__ (my_data.py:42)`: the step it was in (its record's: the one after those it
    finished, or the evaluation after them); a DataLoader worker's function where the process waits for that worker."""
    phase = (f"training step {record['step']}" if record["phase"] == TRAINING
             else f"the evaluation after step {record['step']}")
    worker = f" in DataLoader worker {record['worker']}" if record.get("worker") else ""
    return f"{phase}, in {record['function']} ({record['file']}:{record['line']}){worker}"


def processes(numbers: list[int]) -> str:
    listed = [str(number) for number in numbers]
    return f"process {listed[0]}" if len(listed) == 1 else f"processes {', '.join(listed[:-1])} and {listed[-1]}"


def describe(records: dict[int, dict], hosts: list[str], bound: float, folder: str) -> str:
    """The one line: who stopped (not in a collective), where and on which host; who did not answer; who waited."""
    several = len(hosts) > 1
    waiting = [p for p in sorted(records) if several and records[p]["waiting"]]
    stopped = [p for p in sorted(records) if p not in waiting]
    silent = [p for p in range(len(hosts)) if p not in records]
    parts = [f"process {p} on {hosts[p]} stopped in {where(records[p])}" for p in stopped]
    if silent:
        on = sorted({hosts[p] for p in silent})
        parts.append(f"{processes(silent)} on {', '.join(on)} did not answer (dead, frozen, or in a C call that never "
                     "lets go of Python's lock)")
    if waiting and (stopped or silent):
        them = "them" if len(stopped) + len(silent) > 1 else "it"
        parts.append(f"{processes(waiting)} waited for {them} in a collective")
    elif waiting:
        parts.append("every process waits in a collective, none stopped elsewhere (do they wait at different ones?): "
                     + ", ".join(f"process {p} in {where(records[p])}" for p in waiting))
    stacks = [records[p]["stacks"] for p in sorted(records) if not records[p]["stacks"].startswith("not written")]
    listed = ", ".join(stacks) if len(stacks) <= 4 else f"{len(stacks)} files, process-P.txt"
    return (f"{'; '.join(parts)}; no progress for more than {bound:g} s (train.stuck_after_s); stacks in {folder} "
            f"({listed or 'none written'}); if that was slow rather than stuck, raise train.stuck_after_s")
