"""The read cache: this machine's copy of runs at a URL, for the commands that read a run (eval, predict, train RUN,
runs, plot, model.init_from). Only the files a reader needs are copied (never a checkpoint's optimizer state), into a
folder named by the URL under the staging root, refreshed at each call; a local path is read as it is."""

from __future__ import annotations

from pathlib import Path

from accel_train.config import CONFIG_FILE
from accel_train.distributed.environment import staging_root
from accel_train.run.layout import (
    BEST_FILE,
    CHECKPOINT_META_FILE,
    CHECKPOINTS_DIR,
    CLASSES_FILE,
    CURVES_FILE,
    EMA_FILE,
    METRICS_FILE,
    MODEL_FILE,
)
from accel_train.run.place import PULLED, staging_of
from accel_train.storage import Store, check_location, is_remote

READ_FILES = (*PULLED, MODEL_FILE, EMA_FILE, BEST_FILE, CURVES_FILE)  # what eval, predict, runs and plot read


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
    store, copy = Store(run_url, "run"), _copy_folder(run_url)
    _copy_run(store, "", copy, files, set(store.names()))
    if checkpoint:
        prefix = f"{CHECKPOINTS_DIR}/{checkpoint}/"
        _copy_run(store, prefix, copy / prefix, (CHECKPOINT_META_FILE, MODEL_FILE),
                  {f"{prefix}{name}" for name in store.names(prefix)})
        return copy / prefix
    return copy


def readable_weights(location: str, key: str) -> Path:
    """Weights as model.init_from or checkpoint= name them (a run folder, one of its checkpoints, or a .safetensors
    file): a local path as it is; at a URL, copied into the read cache: the local run folder, checkpoint folder or
    file."""
    if not is_remote(location):
        return Path(location)
    check_location(location, key)
    url = location.rstrip("/")
    if not url.endswith(".safetensors"):
        return readable_run(url, (CONFIG_FILE, CLASSES_FILE, MODEL_FILE))
    folder, _, name = url.rpartition("/")
    store, copy = Store(folder, key), _copy_folder(folder)
    if store.exists(name):
        store.get(name, copy / name)
    return copy / name


def readable_runs(location: str) -> Path:
    """A folder holding runs, or one run: a local path as it is; at a URL, every run under it (a folder with
    config.yaml and metrics.jsonl) copied into the read cache in the same tree, without its weights."""
    check_location(location, "runs")
    if not is_remote(location):
        return Path(location)
    store, copy = Store(location, "runs"), _copy_folder(location)
    present = set(store.files())
    for config in sorted(name for name in present if name.rsplit("/", 1)[-1] == CONFIG_FILE):
        prefix = config[:-len(CONFIG_FILE)]
        if f"{prefix}{METRICS_FILE}" in present and not prefix.count(f"/{CHECKPOINTS_DIR}/"):
            _copy_run(store, prefix, copy / prefix, (*PULLED, CURVES_FILE), present)
    return copy


def _copy_folder(location: str) -> Path:
    """A copy's folder, named as the URL's last part (the name `runs` and `plot` show)."""
    return staging_root() / "read" / staging_of(location).name / location.rstrip("/").rsplit("/", 1)[-1]


def _copy_run(store: Store, prefix: str, copy: Path, files: tuple[str, ...], present: set[str]) -> None:
    """Those of `files` under `prefix` that the store has (`present`: names relative to the store's root)."""
    for name in files:
        if f"{prefix}{name}" in present:
            store.get(f"{prefix}{name}", copy / name)
