"""One writer per run folder: the lease that the main process of a training job holds on its output_dir while it
trains, so that a second start into the folder (a job started twice, a requeued job while the old one still drains)
is refused in one line naming the holder instead of writing the same files.

The lease is `.lease` in the run folder: a local file, or an object in the store for a run folder at a URL. It names
its holder (host, pid, when it started, the launcher's job id) and is taken by a conditional write: created only where
there is none, replaced only where it is still the one read (S3's If-None-Match and If-Match; locally link() and an
flock around the comparison: storage.py). Its holder renews it every RENEW_EVERY_S in a thread and releases it when
the run ends (finished, failed, stopped by a signal after saving). A holder is gone, and its lease taken over at once,
when its process has ended on this machine; on another machine, once the lease has not been renewed for EXPIRY_S, by
the clock of where it lives (the store's LastModified against the Date of the answer; locally the file's mtime against
this machine's clock, so machines sharing a disk must keep their clocks within a few seconds). A holder that cannot
renew for GIVE_UP_S stops itself, before anyone may take the lease over; one whose lease was taken over stops at its
next renewal: two starts never both write for longer than that.

A restart of the same job is the same writer: its launcher's earlier workers have ended (torchrun and accelerate
launch stop them before restarting), so their lease is taken over without a word; a lease of the same job on another
machine or of a process that does not answer (an elastic job whose main process moved) is waited for until it expires,
and refused if it is renewed meanwhile. The other processes of a job take no lease: when the main process refuses, it
exits and the launcher ends them (they wait for it to form the process group). eval, predict, export, runs and plot
read a run folder without a lease.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from datetime import datetime

from accel_train import hooks
from accel_train.console import NOLOCK
from accel_train.distributed.environment import host_name, launcher_environment, machine_identity
from accel_train.distributed.watchdog import end_process
from accel_train.errors import UserError, writing
from accel_train.run.layout import LEASE_FILE
from accel_train.storage import NoConditionalWrites, Store, Versioned

logger = logging.getLogger(__name__)

EXPIRY_S = 60.0  # a lease not renewed for this long is its holder's no longer
RENEW_EVERY_S = 15.0
GIVE_UP_S = 40.0  # a holder that could not renew for this long stops: before its lease expires for anyone else
MIN_CALL_BOUND_S = 0.5  # the least a renewal's call to the store is given (a new client's first call sets it up)
WAIT_POLL_S = 1.0  # how often a lease of this job that is waited for is read again
DAMAGED_AFTER_S = 2.0  # a lease that names no holder for this long is damaged, not being written

TAKEN_OVER, NOT_RENEWED = 2, {True: 3, False: 74}  # a lost lease's exit code: another start has it; (in a store) or not


class RunFolderHeld(UserError):
    """Another start holds the run folder's lease; exit code 2, as for an output_dir that already holds a run.
    Raised by the main process alone, which reports it; the launcher ends the job's other processes."""


@dataclass(frozen=True)
class Holder:
    """Who writes a run folder: the record its lease holds."""

    host: str
    machine: str  # distributed.environment.machine_identity(): whose process ids `pid` is one of
    pid: int
    process_started: float  # the process's start (psutil): a pid taken again by another process is told apart
    started: str  # when it took the lease, ISO 8601 with the UTC offset
    job: str | None  # the launcher's run id (torchrun's rdzv id, or the one it draws): every restart's and machine's
    restart: int  # the launcher's restart count when it took the lease
    token: str  # drawn when it took the lease: whose lease it is
    expiry_s: float
    serial: int = 0  # renewals (so that two renewals never write the same bytes, nor an S3 object the same ETag)

    @staticmethod
    def this_process(expiry_s: float = EXPIRY_S) -> Holder:
        import psutil

        launcher = launcher_environment()
        return Holder(host=host_name(), machine=machine_identity(), pid=os.getpid(),
                      process_started=psutil.Process().create_time(),
                      started=datetime.now().astimezone().isoformat(timespec="seconds"), job=launcher.run_id,
                      restart=launcher.restart, token=uuid.uuid4().hex, expiry_s=expiry_s)

    def record(self) -> bytes:
        return (json.dumps({**asdict(self), "renewed": time.time()}) + "\n").encode()

    @staticmethod
    def of(data: bytes) -> Holder | None:
        """The holder a lease's bytes name; None where they name none (damaged)."""
        try:
            fields = json.loads(data)
            fields.pop("renewed", None)
            return Holder(**fields)
        except (ValueError, TypeError):
            return None

    def renewed(self) -> Holder:
        return replace(self, serial=self.serial + 1)

    def described(self, age_s: float | None) -> str:
        """Who it is, for a line; `age_s`: how long ago its lease was renewed (None: not said)."""
        job = f", job {self.job}" if self.job else ""
        renewed = f", lease renewed {age_s:.0f} s ago" if age_s is not None else ""
        return f"host {self.host}, pid {self.pid}, started {self.started.replace('T', ' ')}{job}{renewed}"

    def is_gone(self) -> bool:
        """Its process has ended (or its pid is another process's now); False where that cannot be known here (another
        machine)."""
        import psutil

        if self.machine != machine_identity():
            return False
        try:
            process = psutil.Process(self.pid)
            return abs(process.create_time() - self.process_started) > 0.5 or \
                process.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:  # another user's process, alive
            return False


def held_line(shown: str, found: Versioned | None, otherwise: Holder | None = None, more: str = "") -> str:
    """The refusal of a start into a run folder that another start writes: named by its lease (`found`), else by
    `otherwise` (the holder of the run's staging on this machine, which may not have taken the lease yet)."""
    holder = Holder.of(found.data) if found is not None else None
    who = holder.described(found.age_s) if holder is not None else \
        otherwise.described(None) if otherwise is not None else "its holder unknown"
    return (f"output_dir={shown} is being written by another start ({who}){more}: let it finish, or stop it (SIGTERM "
            "saves a checkpoint) and continue it with resume=auto; or pass another output_dir")


# What a lease found is to the start that found it (`judged`).
MINE, GONE, EXPIRED, DAMAGED, OF_THIS_JOB, HELD = "mine", "gone", "expired", "damaged", "of this job", "held"


def judged(holder: Holder | None, age_s: float, me: Holder) -> str:
    """MINE (a write of this start whose answer was lost), GONE (its process has ended on this machine), EXPIRED (not
    renewed for its expiry), DAMAGED (names no holder), OF_THIS_JOB (maybe this job's, yet not known to be gone: on
    another machine, or a process that does not answer: waited for), or HELD."""
    if holder is None:
        return DAMAGED
    if holder.token == me.token:
        return MINE
    if holder.is_gone():
        return GONE
    if age_s > holder.expiry_s:
        return EXPIRED
    if (me.job is not None and holder.job == me.job) or me.restart > 0:
        return OF_THIS_JOB
    return HELD


class RunLease:
    """The lease this start holds on its run folder (`RunLease.taken`), renewed in a thread while the run lives and
    released at its end; or none (the job's other processes, a store without conditional writes)."""

    def __init__(self, store: Store | None, shown: str, me: Holder | None = None, *,
                 renew_every_s: float = RENEW_EVERY_S, give_up_s: float = GIVE_UP_S, poll_s: float = WAIT_POLL_S,
                 on_lost: Callable[[int], None] | None = None) -> None:
        self.store, self.shown, self.me = store, shown, me
        self.renew_every_s, self.give_up_s, self.poll_s = renew_every_s, give_up_s, poll_s
        self.on_lost = on_lost or _end_this_process
        self.version: str | None = None  # what the store holds of ours, for the next conditional write
        self.taken_from: str | None = None  # the line saying whose lease was taken over, said once the checks pass
        self.lost: str | None = None  # why the lease is no longer this start's
        self._guard = threading.Lock()  # a renewal and the release, one at a time
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def taken(config, place) -> RunLease:
        """The run folder's lease for this start (opened: `with RunLease.taken(config, place):`), taken by the main
        process (the folder made first where it is local); nothing for the others. `place`: the run's RunPlace
        (run/place.py, which imports this module for its own refusal's line)."""
        shown = config.output_dir
        if launcher_environment().rank != 0:
            return RunLease(None, shown)
        store = place.lease_store()
        if not store.remote:
            place.make_folder(shown)
        lease = RunLease(store, shown, Holder.this_process())
        lease.take()
        return lease

    def __enter__(self) -> RunLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def take(self) -> None:
        """Hold the lease, or raise RunFolderHeld naming who does; a lease of this job not yet known to be gone is
        waited for until it expires (refused if renewed meanwhile)."""
        if self.store is None or self.me is None:
            return
        try:
            with writing(self.store.url(LEASE_FILE), "taking the run folder's lease") if not self.store.remote \
                    else nullcontext():
                self._take()
        except NoConditionalWrites as err:
            self.store = None
            logger.warning(f"output_dir={self.shown}: {err}, so this run folder has no lease there: a second start "
                           "into it would write it too; start one at a time")
            return
        self._thread = threading.Thread(target=self._keep, name="accel-train lease", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        waited: tuple[str, str] | None = None  # (token, version) of a lease of this job being waited for
        while True:
            version = self.store.create(LEASE_FILE, self.me.record())
            if version is not None:
                self.version = version
                return
            found = self.store.read_versioned(LEASE_FILE)
            if found is None:  # released since: try again
                continue
            holder = Holder.of(found.data)
            verdict = judged(holder, found.age_s, self.me)
            if verdict == MINE:
                self.version = found.version
                return
            if verdict == DAMAGED and found.age_s < DAMAGED_AFTER_S:  # written where a file is made, then filled
                time.sleep(self.poll_s / 10)
                continue
            if verdict in (GONE, EXPIRED, DAMAGED):
                version = self.store.replace(LEASE_FILE, self.me.record(), found.version)
                if version is None:  # another start changed it first: judged again
                    continue
                self.version, self.taken_from = version, self._taken_over(holder, verdict, found.age_s)
                return
            if verdict == OF_THIS_JOB:
                if waited is not None and waited[0] == holder.token and waited[1] != found.version:
                    raise RunFolderHeld(held_line(self.shown, found, more="; it was renewed while this start waited "
                                                                          "for it, so it still trains"))
                if waited is None or waited[0] != holder.token:
                    logger.info(f"output_dir={self.shown}: waiting up to {holder.expiry_s - found.age_s:.0f} s for "
                                f"the lease of {holder.described(found.age_s)}, which may be of this job: taken over "
                                "once it expires, unless it is renewed")
                    waited = (holder.token, found.version)
                time.sleep(self.poll_s)
                continue
            raise RunFolderHeld(held_line(self.shown, found))

    def _taken_over(self, holder: Holder | None, verdict: str, age_s: float) -> str | None:
        """The line for a lease taken over; None for the same job's (a restart by its launcher)."""
        if verdict == DAMAGED:
            return f"output_dir={self.shown}: its lease named no holder (damaged); taken over"
        if verdict == GONE and (self.me.restart > 0 or (self.me.job is not None and holder.job == self.me.job)):
            return None
        why = "its process has ended" if verdict == GONE else f"its lease expired, not renewed for {age_s:.0f} s"
        return f"output_dir={self.shown}: taking over the lease of a start that is gone ({holder.described(age_s)}; " \
               f"{why})"

    def say_taken_over(self) -> None:
        """Once the checks have passed: whose lease this start took over, in one line."""
        if self.taken_from:
            logger.info(self.taken_from)

    def _keep(self) -> None:
        """The thread: the lease renewed every renew_every_s until released; lost when another start has it, or when
        it could not be renewed for give_up_s (after which another may take it: each attempt gives up within half of
        renew_every_s, and a failed one is tried again no later than give_up_s)."""
        bound = max(self.renew_every_s / 4, MIN_CALL_BOUND_S)
        store = self.store.sharing(patience_s=bound, call_bound_s=bound)
        renewed_at, wait, said = time.monotonic(), self.renew_every_s, False
        while not self._stopping.wait(wait):
            with self._guard:
                if self._stopping.is_set():
                    return
                try:
                    me = self.me.renewed()
                    version = store.replace(LEASE_FILE, me.record(), self.version)
                    if version is None:
                        found = store.read_versioned(LEASE_FILE)
                        holder = Holder.of(found.data) if found is not None else None
                        if holder is None or holder.token != self.me.token:
                            other = holder.described(found.age_s) if holder else "the lease removed"
                            self._lose(TAKEN_OVER, f"output_dir={self.shown}: this start's lease was taken over by "
                                                   f"another start ({other}): it stops now, so that two starts never "
                                                   "write one run folder")
                            return
                        me, version = holder, found.version  # renewed: the answer was lost, not the write
                except Exception as err:  # the store or the disk: said once, tried again until give_up_s
                    failing_s = time.monotonic() - renewed_at
                    if failing_s >= self.give_up_s:
                        self._lose(NOT_RENEWED[store.remote],
                                   f"output_dir={self.shown}: this start's lease could not be renewed for "
                                   f"{failing_s:.0f} s ({str(err).splitlines()[0][:200]}): it stops now, before "
                                   "another start may take the lease over; resume=auto continues from the newest "
                                   "checkpoint")
                        return
                    if not said:
                        said = True
                        logger.warning(f"output_dir={self.shown}: renewing this start's lease failed "
                                       f"({str(err).splitlines()[0][:200]}); trying again")
                    wait = min(self.renew_every_s, self.give_up_s - failing_s)
                    continue
                self.me, self.version, renewed_at, wait = me, version, time.monotonic(), self.renew_every_s

    def _lose(self, code: int, line: str) -> None:
        self.lost = line
        logger.error(line, extra={**NOLOCK, "heading": "accel-train: error: "})
        self.on_lost(code)

    def release(self) -> None:
        """The renewals stopped and the lease removed where it is still this start's (where it is not, it was lost:
        nothing to release). A store that fails here leaves it to expire."""
        self._stopping.set()
        if self.store is None or self.version is None:
            return
        with self._guard:
            if self.lost is None:
                try:
                    self.store.remove_version(LEASE_FILE, self.version)
                except Exception as err:  # the store or the disk
                    logger.warning(f"output_dir={self.shown}: the lease could not be released "
                                   f"({str(err).splitlines()[0][:200]}); the next start takes it over "
                                   f"{EXPIRY_S:.0f} s after its last renewal, or at once on this machine")
            self.version = None


def _end_this_process(code: int) -> None:
    """A lost lease ends the process from the lease's thread, at once: the training thread would write on."""
    if hooks.every().process_ends(code):
        end_process(code)
