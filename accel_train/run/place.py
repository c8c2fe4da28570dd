"""Where a run folder's bytes live, as one object made once from output_dir and handed to whoever reads or writes the
run (the checks, Checkpoints, the run folder's files, the watchdog, model selection, the end of training), who ask it
instead of branching on where the run is: `RunPlace.open` returns a LocalPlace (output_dir is a folder) or a
StorePlace (a URL: s3://, gs://, az://), opened. Nothing here is global: two runs in one process have one each.

Checkpoints (run/checkpoint.py) decides when and what to save; the place, where and how a checkpoint's bytes go (as
Lightning's CheckpointIO does for its strategies): a process's part put (`put_part`), the parts still missing and the
record of those written (`missing_parts`, `parts_written`), the commit (`commit`), a committed checkpoint removed
(`remove`), the saves that did not complete (`unfinished_saves`, `clear_unfinished`), and a checkpoint's files made
ready to resume from (`fetch`). Locally checkpoint.json is written last and the folder renamed into place; in a store
the manifest, checkpoint.json with each object's size and sha256, is written after every object and after
metrics.jsonl.

At a URL each process writes the run into a staging folder on its own machine's disk, and its Mirror brings what
changed to the store in the background, one upload at a time in the order asked (a checkpoint's manifest after its
objects, metrics.jsonl before the manifest that counts on its lines). The store holds the truth. A start empties its
staging folder and pulls the run's files and the manifests of its checkpoints back from the store; a checkpoint's
objects come down only when it is resumed. Staging belongs to the implementation: the end of a run removes it, and
the next start on the machine replaces whatever a crash left. Readers (eval, predict, train RUN, runs, plot) work on
a copy of a run at a URL instead: run/read_cache.py.

metrics.jsonl and starts.jsonl reach the store at most `SYNC_EVERY_S` after a line is written, before each
checkpoint is committed (so a resume finds every line its checkpoint had seen), and at the end of the run.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import shutil
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING

from accel_train.config import CONFIG_FILE
from accel_train.distributed.environment import launcher_environment, staging_root
from accel_train.errors import UserError, storage_error
from accel_train.run.checkpoint_files import (
    PART_DONE,
    PARTIAL_PREFIX,
    damage,
    fsync,
    sha256_of,
    write_synced,
)
from accel_train.run.layout import (
    CHECKPOINT_META_FILE,
    CHECKPOINTS_DIR,
    CLASSES_FILE,
    LEASE_FILE,
    METRICS_FILE,
    STARTS_FILE,
    TRACKERS_DIR,
    checkpoints_dir,
    usual_permissions,
)
from accel_train.run.lease import Holder, RunFolderHeld, held_line
from accel_train.storage import NoConditionalWrites, Store, StoreUnavailable, check_location, is_remote

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from accelerate import Accelerator

SYNC_EVERY_S = 10.0  # how stale the store's metrics.jsonl may be while a run trains
PULLED = (CONFIG_FILE, METRICS_FILE, STARTS_FILE, CLASSES_FILE)  # what a start needs of the run, beside its trackers


def staging_of(url: str) -> Path:
    """This machine's folder for a URL (its processes' staging folders, a resumed checkpoint's download)."""
    return staging_root() / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def run_folder_patience(config) -> float:
    """How long the run folder's reads and writes retry a store (checkpoint.store_patience_s, else the data's)."""
    return config.checkpoint.store_patience_s or config.data.store_patience_s


class RunPlace(ABC):
    """Where a run folder's bytes live (`RunPlace.open`): `folder`, where this process writes the run, and its
    `checkpoints` folder; `worker`, the thread a save's bytes are written (and uploaded) on."""

    save_verb: str  # what a save's background work is, as lines say it: "still being written"
    shared: bool  # every process writes into `folder` (a local output_dir, on a disk the machines share)

    def __init__(self, folder: Path, worker: Worker) -> None:
        self.folder, self.worker, self.checkpoints = folder, worker, checkpoints_dir(folder)

    def make_folder(self, shown: str) -> Path:
        """`folder` made where it is not there, as a folder this process can write (`shown`: output_dir as given, for
        the line that says it cannot be); the folder."""
        folder = self.folder
        if folder.exists() and not folder.is_dir():
            raise UserError(f"output_dir={shown} is a file, not a folder; pass a folder for the run's results")
        unwritable = "choose an output_dir you can write"
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise UserError(f"output_dir={shown}: a part of this path is a file, not a folder") from None
        except OSError as err:
            raise storage_error(folder, "creating output_dir", err, unwritable) from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise storage_error(folder, "creating output_dir", PermissionError(13, "Permission denied"), unwritable)
        return folder

    @staticmethod
    def open(output_dir: str | Path, patience_s: float, *, whole: bool = False,
             ignore: tuple[str, ...] = ()) -> RunPlace:
        """The place of the run (or, `whole`, of a folder mirrored file for file: a sweep's) at output_dir, before
        anything reads it: a local folder as it is; for a URL, the store checked (credentials, bucket: one line,
        exit 2) and this process's staging pulled from it, retrying the store for `patience_s`. `ignore`: names
        staged that never go to the store."""
        output_dir = str(output_dir)
        if not is_remote(output_dir):
            return LocalPlace(output_dir, patience_s)
        check_location(output_dir, "output_dir")
        mirror = Mirror(output_dir, patience_s, whole=whole, ignore=ignore)
        mirror.store.names()  # access problems answer here, before any data loads
        mirror.claim()  # before the pull empties it: another start of the run here may be staging in it
        mirror.pull()
        return StorePlace(mirror)

    @abstractmethod
    def shown(self, path: Path) -> str:
        """A path under `folder` as the user knows it (under the run's URL for a run folder in a store)."""

    @abstractmethod
    def discard(self) -> None:
        """A run refused or failed: what only this process's machine holds of it removed."""

    @abstractmethod
    def sync_soon(self) -> None:
        """New lines of the run's files reach where the run lives within SYNC_EVERY_S."""

    @abstractmethod
    def drain(self, bound_s: float) -> bool:
        """Whether everything written so far has reached where the run lives, waiting at most `bound_s` (in a store:
        then this process's staging is removed)."""

    @abstractmethod
    def lease_store(self) -> Store:
        """Where the run folder's lease lives (run/lease.py): the folder itself, or the run's URL."""

    @abstractmethod
    def store_of(self, folder: str) -> Store | None:
        """A folder of the run where processes that share no disk meet (the watchdog's stuck/); None where every
        process writes into one folder."""

    def clear_unfinished(self, under_way: set[str], main: bool) -> None:
        """Before a save: the checkpoints folder made, and the partial folders of saves a crash cut short removed
        (not those of the saves named `under_way`, still being written). Where every process writes into one folder
        the main process's saves stand for every process's: each is under way there until it has committed (every
        part written) or given up; a staging folder is its process's own."""
        if self.shared and not main:
            return
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        for stale in self.checkpoints.glob(f"{PARTIAL_PREFIX}*"):
            if stale.name.removeprefix(PARTIAL_PREFIX) not in under_way:
                shutil.rmtree(stale, ignore_errors=True)

    def unfinished_saves(self) -> list[Path]:
        """The saves that did not complete (none has its checkpoint.json): never listed as checkpoints."""
        return sorted(self.checkpoints.glob(f"{PARTIAL_PREFIX}*")) if self.checkpoints.is_dir() else []

    @abstractmethod
    def put_part(self, name: str, partial: Path, process: int) -> None:
        """This process's files of checkpoint `name`, written into `partial`, put where the checkpoint goes, then the
        marker that tells the main process this part is complete."""

    @abstractmethod
    def missing_parts(self, name: str, partial: Path, processes: int) -> list[int]:
        """The processes whose part of checkpoint `name` is not complete yet."""

    @abstractmethod
    def parts_written(self, name: str, partial: Path, processes: int) -> dict[str, list]:
        """{file: [size, sha256]} of every process's part, once all are complete."""

    @abstractmethod
    def commit(self, name: str, partial: Path, manifest: str) -> Path:
        """Checkpoint `name` made to count, its checkpoint.json (`manifest`) written last; its folder here."""

    @abstractmethod
    def remove(self, folder: Path, meta: dict) -> None:
        """A committed checkpoint deleted: every file its manifest (`meta`) lists."""

    @abstractmethod
    def fetch(self, accelerator: Accelerator, folder: Path, meta: dict) -> str | None:
        """Before a resume reads anything (all processes): a committed checkpoint's files in `folder`, as its
        manifest describes them. What is wrong, or None."""


class LocalPlace(RunPlace):
    """A run folder on a disk: every process writes into output_dir itself."""

    save_verb, shared = "written", True

    def __init__(self, output_dir: str, patience_s: float) -> None:
        super().__init__(Path(output_dir), Worker("accel-train checkpoint"))
        self.patience_s = patience_s

    def shown(self, path: Path) -> str:
        return str(path)

    def discard(self) -> None:
        """Nothing: a local output_dir is left as it is."""

    def sync_soon(self) -> None:
        """Nothing: the lines are where the run lives."""

    def drain(self, bound_s: float) -> bool:
        return True

    def lease_store(self) -> Store:
        return Store(str(self.folder), "output_dir", self.patience_s)

    def store_of(self, folder: str) -> None:
        return None

    def put_part(self, name: str, partial: Path, process: int) -> None:
        mine = files_in(partial)
        usual_permissions(*mine)
        for path in mine:  # on a disk several machines share, each writer syncs its own
            fsync(path)
        write_synced(partial / PART_DONE.format(process=process), "")

    def missing_parts(self, name: str, partial: Path, processes: int) -> list[int]:
        present = {path.name for path in partial.iterdir()}
        return [process for process in range(processes) if PART_DONE.format(process=process) not in present]

    def parts_written(self, name: str, partial: Path, processes: int) -> dict[str, list]:
        """The markers removed (the checkpoint holds only what its manifest lists), then every file hashed."""
        for process in range(processes):
            (partial / PART_DONE.format(process=process)).unlink()
        return {str(path.relative_to(partial)): [path.stat().st_size, sha256_of(path)]
                for path in sorted(partial.rglob("*")) if path.is_file()}

    def commit(self, name: str, partial: Path, manifest: str) -> Path:
        """Every file durable, checkpoint.json written, then the folder renamed into place."""
        files = [path for path in sorted(partial.rglob("*")) if path.is_file()]
        usual_permissions(*files)
        for path in files:  # durable before the rename publishes them
            fsync(path)
        write_synced(partial / CHECKPOINT_META_FILE, manifest)
        final = self.checkpoints / name
        os.replace(partial, final)
        fsync(self.checkpoints)
        return final

    def remove(self, folder: Path, meta: dict) -> None:
        shutil.rmtree(folder, ignore_errors=True)

    def fetch(self, accelerator: Accelerator, folder: Path, meta: dict) -> str | None:
        """The files are here: their sizes, and their content (sha256) read once per machine."""
        return damage(folder, meta, content=accelerator.is_local_main_process)


class StorePlace(RunPlace):
    """A run folder at a URL: each process writes into its staging folder, and its Mirror brings the run to the
    store; a checkpoint's parts go to the store directly, each process's under the checkpoint's prefix."""

    save_verb, shared = "uploaded", False  # each process stages the run on its own machine's disk

    def __init__(self, mirror: Mirror) -> None:
        super().__init__(mirror.staging, mirror.worker)
        self.mirror = mirror

    def shown(self, path: Path) -> str:
        relative = path.relative_to(self.folder).as_posix()
        return self.mirror.url if relative == "." else f"{self.mirror.url}/{relative}"

    def discard(self) -> None:
        """This process's staging removed (the store holds what the run committed; the next start pulls it)."""
        self.mirror.discard()

    def sync_soon(self) -> None:
        self.mirror.sync_soon()

    def drain(self, bound_s: float) -> bool:
        return self.mirror.drain(bound_s)

    def lease_store(self) -> Store:
        return self.mirror.store

    def store_of(self, folder: str) -> Store:
        return self.mirror.store_of(folder)

    def unfinished_saves(self) -> list[Path]:
        """Beside staged ones, the checkpoints the store holds objects of but no manifest (seen at the start)."""
        return [*super().unfinished_saves(), *(self.checkpoints / name for name in self.mirror.partial_checkpoints)]

    def put_part(self, name: str, partial: Path, process: int) -> None:
        """Each file uploaded, then the record of them (size, sha256); the staged copy removed: the store has it."""
        store, record = self.mirror.store, {}
        for path in files_in(partial):
            store.put(path, f"{CHECKPOINTS_DIR}/{name}/{path.name}")
            record[path.name] = [path.stat().st_size, sha256_of(path)]
        store.write(f"{CHECKPOINTS_DIR}/{name}/{PART_DONE.format(process=process)}", json.dumps(record).encode())
        shutil.rmtree(partial, ignore_errors=True)

    def missing_parts(self, name: str, partial: Path, processes: int) -> list[int]:
        present = set(self.mirror.store.names(f"{CHECKPOINTS_DIR}/{name}"))
        return [process for process in range(processes) if PART_DONE.format(process=process) not in present]

    def parts_written(self, name: str, partial: Path, processes: int) -> dict[str, list]:
        parts: dict[str, list] = {}
        for process in range(processes):
            parts.update(json.loads(self.mirror.store.read(f"{CHECKPOINTS_DIR}/{name}/"
                                                           f"{PART_DONE.format(process=process)}")))
        return parts

    def commit(self, name: str, partial: Path, manifest: str) -> Path:
        """The manifest written after every line this checkpoint has seen is in the store; staged, the manifest
        alone (for the checkpoints' order and retention)."""
        self.mirror.sync()
        self.mirror.store.write(f"{CHECKPOINTS_DIR}/{name}/{CHECKPOINT_META_FILE}", manifest.encode())
        final = self.checkpoints / name
        final.mkdir()
        write_synced(final / CHECKPOINT_META_FILE, manifest)
        return final

    def remove(self, folder: Path, meta: dict) -> None:
        """Uncommitted first (its manifest), then emptied of what it lists."""
        prefix, store = f"{CHECKPOINTS_DIR}/{folder.name}", self.mirror.store
        store.remove(f"{prefix}/{CHECKPOINT_META_FILE}")
        for name in [*meta["files"], *(PART_DONE.format(process=p) for p in range(meta["world_size"]))]:
            store.remove(f"{prefix}/{name}")
        shutil.rmtree(folder, ignore_errors=True)

    def fetch(self, accelerator: Accelerator, folder: Path, meta: dict) -> str | None:
        """The checkpoint's objects from the store into staging, once per machine: the machine's first process
        downloads them into a folder its processes share, checking each against the manifest's size and sha256, and
        each process links them into its own staging (a hard link, else a copy)."""
        fetched = self.mirror.fetched / folder.name
        trouble = self.download(fetched, folder.name, meta) if accelerator.is_local_main_process else None
        accelerator.wait_for_everyone()
        if trouble is None:
            trouble = linked(fetched, folder, meta)
        accelerator.wait_for_everyone()
        if accelerator.is_local_main_process:
            shutil.rmtree(fetched, ignore_errors=True)
        return trouble or damage(folder, meta, content=False)  # sizes: the download checked the content

    def download(self, into: Path, name: str, meta: dict) -> str | None:
        """Each object of checkpoint `name`, checked against its manifest's size and sha256; what is wrong, or None."""
        hashes = meta.get("sha256") or {}
        for file, size in meta["files"].items():
            path = into / file
            try:
                self.mirror.store.get(f"{CHECKPOINTS_DIR}/{name}/{file}", path)
            except FileNotFoundError:
                return f"{file} is missing in the store"
            if path.stat().st_size != size or sha256_of(path) != hashes.get(file):
                return f"{file} in the store is not the one its manifest describes (size or sha256)"
        return None


def files_in(partial: Path) -> list[Path]:
    """The files of a checkpoint's part written into `partial` (not the markers)."""
    return sorted(path for path in partial.iterdir() if path.is_file() and not path.name.startswith("."))


def linked(fetched: Path, folder: Path, meta: dict) -> str | None:
    """The files this machine's first process fetched (`fetched`), in `folder`; what is wrong, or None."""
    for name in meta["files"]:
        source, path = fetched / name, folder / name
        if not source.is_file():
            return f"{name} was not fetched from the store (by the first process on this machine)"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        try:
            os.link(source, path)
        except OSError:  # a file system without hard links
            shutil.copyfile(source, path)
    return None


class StagingClaimed(RunFolderHeld):
    """Another process of this machine stages the run folder at this URL (Mirror.claim): `pid`, as it wrote it."""

    def __init__(self, message: str, pid: str) -> None:
        super().__init__(message)
        self.pid = pid


class Worker:
    """Jobs run one at a time, in the order submitted, on a daemon thread: an upload that outlasts the end's bound
    must not hold the process (ThreadPoolExecutor's threads are joined at exit)."""

    def __init__(self, name: str) -> None:
        self.name, self.jobs, self.thread = name, queue.Queue(), None

    def submit(self, action: Callable, *args) -> Future:
        future = Future()
        self.jobs.put((future, action, args))
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, args=(self.jobs,), name=self.name, daemon=True)
            self.thread.start()
        return future

    def idle_within(self, seconds: float) -> bool:
        """Whether every job submitted so far ends within `seconds`."""
        try:
            self.submit(lambda: None).result(timeout=seconds)
        except FutureTimeout:
            return False
        return True

    def close(self) -> None:
        """The thread ends once the jobs submitted so far are done (a later submit starts another)."""
        if self.thread is not None:
            self.jobs.put(None)
            self.jobs, self.thread = queue.Queue(), None

    @staticmethod
    def _run(jobs: queue.Queue) -> None:
        while (job := jobs.get()) is not None:
            future, action, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(action(*args))
                except BaseException as err:  # handed to whoever waits for the job
                    future.set_exception(err)
            del job, future, action, args  # nothing of a finished job (its run, its loaders) is kept alive here


class Mirror:
    """One process's staging folder of a run at a URL, and the uploads that keep the store up to date with it.

    `whole`: a folder mirrored file for file, both ways (a sweep's: its study and its trials, each a run folder
    inside): a start pulls all of it, and a sync uploads every file that changed, each checkpoint's checkpoint.json
    after its other files, and removes from the store what staging no longer has."""

    def __init__(self, url: str, patience_s: float, whole: bool = False, ignore: tuple[str, ...] = ()) -> None:
        self.url, self.whole, self.ignore = url.rstrip("/"), whole, ignore
        self.staging = staging_of(url) / f"process-{launcher_environment().rank}"  # where this process writes the run
        self.fetched = staging_of(url) / "fetched"  # a resumed checkpoint's objects, downloaded once per machine
        self.store = Store(self.url, "output_dir", patience_s)
        self.worker = Worker("accel-train upload")
        self.sent: dict[str, tuple[int, int]] = {}  # staged file -> (size, mtime) of what the store has
        self.partial_checkpoints: list[str] = []
        self.last_sync, self.sync_pending, self.warned = 0.0, False, False
        self.claimed: int | None = None  # the descriptor that holds this process's claim on its staging folder

    def claim(self) -> None:
        """This process's staging folder claimed for as long as it stages the run (a POSIX lock of a file beside it:
        released when the process ends, however it ends, and not held by the processes it forks): another start of
        the run on this machine, which would empty it, is refused in one line naming the start there."""
        path = self.staging.with_name(f"{self.staging.name}.claim")
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                claimant = Holder.of(path.read_bytes())
                raise StagingClaimed(held_line(self.url, self._lease(), claimant),
                                     str(claimant.pid) if claimant else "?") from None
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:  # not removed by the claim's last holder meanwhile
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, Holder.this_process().record(), 0)  # who stages it, for the refusal of another start
        self.claimed = fd

    def store_of(self, folder: str) -> Store:
        """A folder of the run in the store, reached directly (the watchdog's stuck/: where processes that share no
        disk meet)."""
        return Store(f"{self.url}/{folder}", "output_dir", self.store.patience_s)

    def pull(self) -> None:
        """Staging as the store has the run: its files and trackers, and each committed checkpoint's manifest."""
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
        objects = self.store.files()
        if self.whole:
            for name in objects:
                self.store.get(name, self.staging / name)
                self._mark_sent(name)
            return
        manifests = {name for name in objects if name.count("/") == 2 and name.startswith(f"{CHECKPOINTS_DIR}/")
                     and name.endswith(f"/{CHECKPOINT_META_FILE}")}
        self.partial_checkpoints = sorted({name.split("/")[1] for name in objects if name.count("/") >= 2
                                           and name.startswith(f"{CHECKPOINTS_DIR}/")}
                                          - {name.split("/")[1] for name in manifests})
        for name in objects:
            if name in PULLED or name in manifests or name.startswith(f"{TRACKERS_DIR}/"):
                self.store.get(name, self.staging / name)
                self._mark_sent(name)

    def _mark_sent(self, name: str) -> None:
        stat = (self.staging / name).stat()
        self.sent[name] = (stat.st_size, stat.st_mtime_ns)

    def sync(self) -> None:
        """On the worker: every staged file of the run that changed since the store last got it (checkpoints go
        by their own commit). A store that is down is said once; the next sync tries again."""
        self.sync_pending = False
        staged = sorted(self.staging.rglob("*"), key=lambda path: (path.parent, path.name == CHECKPOINT_META_FILE,
                                                                   path.name))
        present = set()
        try:
            for path in staged:
                name = path.relative_to(self.staging).as_posix()
                if not path.is_file() or name in self.ignore or any(part.startswith(".") for part in name.split("/")) \
                        or (not self.whole and name.startswith(f"{CHECKPOINTS_DIR}/")):
                    continue
                present.add(name)
                stat = path.stat()
                if self.sent.get(name) != (stat.st_size, stat.st_mtime_ns):
                    self.store.put(path, name)
                    self.sent[name] = (stat.st_size, stat.st_mtime_ns)
            for name in sorted(set(self.sent) - present, key=lambda name: not name.endswith(CHECKPOINT_META_FILE)) \
                    if self.whole else []:  # a pruned checkpoint: uncommitted first
                self.store.remove(name)
                del self.sent[name]
        except StoreUnavailable as err:
            self.warn(f"{err}; the run goes on and tries again")

    def sync_soon(self) -> None:
        """A sync, unless one is waiting or the last began less than SYNC_EVERY_S ago (called at each line)."""
        if not self.sync_pending and time.monotonic() - self.last_sync >= SYNC_EVERY_S:
            self.sync_pending, self.last_sync = True, time.monotonic()
            self.worker.submit(self.sync)

    def drain(self, bound_s: float) -> bool:
        """A last sync, and every upload asked for, within `bound_s`; says so when the bound passes."""
        self.worker.submit(self.sync)
        if self.worker.idle_within(bound_s):
            self.discard()
            return True
        self.warn(f"uploads to {self.url} still under way after {bound_s:g} s (checkpoint.upload_wait_s); ending "
                  f"without them: the store has the run up to its newest committed checkpoint, and resume=auto "
                  f"continues from there")
        return False

    def _lease(self):
        """The run's lease as the store has it (run/lease.py), or None (none, or a store without conditional writes)."""
        try:
            return self.store.read_versioned(LEASE_FILE)
        except NoConditionalWrites:
            return None

    def discard(self) -> None:
        """This process's staging folder removed (the store holds the run), its claim given up, and the machine's
        folder for the URL once no process of it has one there any more."""
        shutil.rmtree(self.staging, ignore_errors=True)
        if self.claimed is not None:
            self.staging.with_name(f"{self.staging.name}.claim").unlink(missing_ok=True)
            os.close(self.claimed)
            self.claimed = None
        try:
            self.staging.parent.rmdir()
        except OSError:  # another process of this machine still stages the run (or fetched a checkpoint there)
            pass

    def warn(self, text: str) -> None:
        if not self.warned:
            self.warned = True
            logger.warning(text)
