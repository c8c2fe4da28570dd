"""Where a run folder's bytes live. output_dir is a local folder, or a URL (s3://, gs://, az://): then each process
writes the run into a staging folder on its own machine's disk, and its Mirror brings what changed to the store in
the background, one upload at a time in the order asked (a checkpoint's manifest after its objects, metrics.jsonl
before the manifest that counts on its lines).

The store holds the truth. A start empties its staging folder and pulls the run's files and the manifests of its
checkpoints back from the store; a checkpoint's objects come down only when it is resumed. Staging belongs to the
implementation: the end of a run removes it, and the next start on the machine replaces whatever a crash left.
Readers (eval, predict, train RUN, runs, plot) work on a copy of a run at a URL in a read cache (`readable_run`).

metrics.jsonl and starts.jsonl reach the store at most `SYNC_EVERY_S` after a line is written, before each
checkpoint is committed (so a resume finds every line its checkpoint had seen), and at the end of the run.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from accel_train.config import CONFIG_FILE
from accel_train.distributed.environment import launcher_environment, staging_root
from accel_train.run.layout import (
    BEST_FILE,
    CHECKPOINT_META_FILE,
    CHECKPOINTS_DIR,
    CLASSES_FILE,
    CURVES_FILE,
    EMA_FILE,
    METRICS_FILE,
    MODEL_FILE,
    STARTS_FILE,
    TRACKERS_DIR,
)
from accel_train.storage import Store, StoreUnavailable, check_location, is_remote

logger = logging.getLogger(__name__)

SYNC_EVERY_S = 10.0  # how stale the store's metrics.jsonl may be while a run trains
PULLED = (CONFIG_FILE, METRICS_FILE, STARTS_FILE, CLASSES_FILE)  # what a start needs of the run, beside its trackers
READ_FILES = (*PULLED, MODEL_FILE, EMA_FILE, BEST_FILE, CURVES_FILE)  # what eval, predict, runs and plot read


def local_dir(output_dir: str | Path) -> Path:
    """The folder this process writes the run into: output_dir itself, or for a URL this process's staging folder."""
    if not is_remote(str(output_dir)):
        return Path(output_dir)
    return _staging_of(str(output_dir)) / f"process-{launcher_environment().rank}"


def _staging_of(url: str) -> Path:
    return staging_root() / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


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
        self.url, self.staging, self.whole, self.ignore = url.rstrip("/"), local_dir(url), whole, ignore
        self.fetched = _staging_of(url) / "fetched"  # a resumed checkpoint's objects, downloaded once per machine
        self.store = Store(self.url, "output_dir", patience_s)
        self.worker = Worker("accel-train upload")
        self.sent: dict[str, tuple[int, int]] = {}  # staged file -> (size, mtime) of what the store has
        self.partial_checkpoints: list[str] = []
        self.last_sync, self.sync_pending, self.warned = 0.0, False, False

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

    def discard(self) -> None:
        """This process's staging folder removed (the store holds the run), and the machine's folder for the URL
        once no process of it has one there any more."""
        shutil.rmtree(self.staging, ignore_errors=True)
        try:
            self.staging.parent.rmdir()
        except OSError:  # another process of this machine still stages the run (or fetched a checkpoint there)
            pass

    def warn(self, text: str) -> None:
        if not self.warned:
            self.warned = True
            logger.warning(text)


class RunPlace:
    """Where a run folder's bytes live, made once from output_dir and handed to whoever reads or writes them
    (the checks, Checkpoints, the run folder's files, the watchdog, model selection, the end of training): `folder`,
    where this process writes the run (output_dir itself, or for a URL its staging folder), and for a URL, once
    `open`, the Mirror that brings it to the store. Nothing here is global: two runs in one process have one each."""

    def __init__(self, output_dir: str | Path) -> None:
        self.output_dir = str(output_dir)
        self.folder = local_dir(self.output_dir)
        self.mirror: Mirror | None = None

    def open(self, patience_s: float) -> RunPlace:
        """Before anything reads the run folder: for a URL, the store is checked (credentials, bucket: one line,
        exit 2) and this process's staging folder pulled from it."""
        if is_remote(self.output_dir) and self.mirror is None:
            check_location(self.output_dir, "output_dir")
            mirror = Mirror(self.output_dir, patience_s)
            mirror.store.names()  # access problems answer here, before any data loads
            mirror.pull()
            self.mirror = mirror
        return self

    @property
    def shared(self) -> bool:
        """Whether every process writes into one folder (a local output_dir, on a disk the machines share); in a
        store each process has a staging folder of its own."""
        return self.mirror is None

    def shown(self, path: Path) -> str:
        """A path under `folder` as the user knows it: under the run's URL for a run folder in a store."""
        if self.mirror is None:
            return str(path)
        relative = path.relative_to(self.folder).as_posix()
        return self.mirror.url if relative == "." else f"{self.mirror.url}/{relative}"

    def discard(self) -> None:
        """A run refused or failed: this process's staging removed (a local output_dir is left as it is)."""
        if self.mirror is not None:
            self.mirror.discard()

    def sync_soon(self) -> None:
        """New lines of the run's files reach the store within SYNC_EVERY_S (nothing to do for a local folder)."""
        if self.mirror is not None:
            self.mirror.sync_soon()


def run_folder_patience(config) -> float:
    """How long the run folder's reads and writes retry a store (checkpoint.store_patience_s, else the data's)."""
    return config.checkpoint.store_patience_s or config.data.store_patience_s


def open_run(output_dir: str, patience_s: float) -> RunPlace:
    """The place of the run at output_dir, opened (RunPlace.open)."""
    return RunPlace(output_dir).open(patience_s)


def open_folder(url: str, patience_s: float, ignore: tuple[str, ...] = ()) -> Mirror:
    """A folder at a URL mirrored whole into this machine's staging (a sweep's): checked and pulled."""
    check_location(url, "output_dir")
    mirror = Mirror(url, patience_s, whole=True, ignore=ignore)
    mirror.store.names()  # access problems answer here
    mirror.pull()
    return mirror


def readable_run(location: str, files: tuple[str, ...] = READ_FILES) -> Path:
    """A run folder to read: a local path as it is; a URL copied (those of its files that exist) into the read
    cache, refreshed at each call. A checkpoint's URL (RUN/checkpoints/step-N) is copied with its run's files, into
    the same place under the run's copy; a weights file's (.safetensors) with the folder it is in."""
    check_location(location, "run")
    if not is_remote(location):
        return Path(location)
    if location.endswith(".safetensors"):  # a weights file: copied with the run (or checkpoint) it is in
        folder, _, name = location.rpartition("/")
        return readable_run(folder, (*files, name)) / name
    run_url, _, checkpoint = location.rstrip("/").partition(f"/{CHECKPOINTS_DIR}/")
    store, copy = Store(run_url, "run"), _read_cache(run_url)
    _copy_run(store, "", copy, files, set(store.names()))
    if checkpoint:
        prefix = f"{CHECKPOINTS_DIR}/{checkpoint}/"
        _copy_run(store, prefix, copy / prefix, (CHECKPOINT_META_FILE, MODEL_FILE),
                  {f"{prefix}{name}" for name in store.names(prefix)})
        return copy / prefix
    return copy


def readable_weights(location: str, key: str) -> Path:
    """Weights at a URL, as model.init_from or checkpoint= name them (a run folder, one of its checkpoints, or a
    .safetensors file), copied into the read cache: the local run folder, checkpoint folder or file."""
    check_location(location, key)
    url = location.rstrip("/")
    if not url.endswith(".safetensors"):
        return readable_run(url, (CONFIG_FILE, CLASSES_FILE, MODEL_FILE))
    folder, _, name = url.rpartition("/")
    store, copy = Store(folder, key), _read_cache(folder)
    if store.exists(name):
        store.get(name, copy / name)
    return copy / name


def readable_runs(location: str) -> Path:
    """A folder holding runs, or one run: a local path as it is; at a URL, every run under it (a folder with
    config.yaml and metrics.jsonl) copied into the read cache in the same tree, without its weights."""
    check_location(location, "runs")
    if not is_remote(location):
        return Path(location)
    store, copy = Store(location, "runs"), _read_cache(location)
    present = set(store.files())
    for config in sorted(name for name in present if name.rsplit("/", 1)[-1] == CONFIG_FILE):
        prefix = config[:-len(CONFIG_FILE)]
        if f"{prefix}{METRICS_FILE}" in present and not prefix.count(f"/{CHECKPOINTS_DIR}/"):
            _copy_run(store, prefix, copy / prefix, (*PULLED, CURVES_FILE), present)
    return copy


def _read_cache(location: str) -> Path:
    """A copy's folder, named as the URL's last part (the name `runs` and `plot` show)."""
    return staging_root() / "read" / _staging_of(location).name / location.rstrip("/").rsplit("/", 1)[-1]


def _copy_run(store: Store, prefix: str, copy: Path, files: tuple[str, ...], present: set[str]) -> None:
    """Those of `files` under `prefix` that the store has (`present`: names relative to the store's root)."""
    for name in files:
        if f"{prefix}{name}" in present:
            store.get(f"{prefix}{name}", copy / name)
