"""Checkpoints in output_dir/checkpoints/: atomic, self-describing, pruned; and exact resume from them.

A checkpoint is the folder `accelerator.save_state` writes on every process (model.safetensors, the
optimizer, the LR scheduler, each process's RNG state) plus checkpoint.json: step, epoch, position in
the epoch, eval metrics, the resolved config and the size of every file. It is written as
`.partial-step-N` and renamed when complete, so a crash at any moment leaves the previous checkpoints
or the complete new one. Checkpoints are found and ordered by their checkpoint.json, never by name.

Loading goes through `accelerator.load_state` with `weights_only=True` (safetensors for the model):
nothing in a checkpoint can run code when it is read.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from accel_train.distributed import StopSignals, any_process, stop_requested
from accel_train.errors import Preempted, UserError
from accel_train.hooks import METRICS_FILE, Hook, RunState

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from accel_train.config import Config

META_FILE = "checkpoint.json"
FORMAT = 1
PARTIAL_PREFIX = ".partial-"
# Config keys that decide what the saved tensors mean; a checkpoint that differs in one is another run's.
IDENTITY_KEYS = ("task", "model.name", "data.name")


@dataclass
class ResumePoint:
    epoch: int = 0  # the epoch to continue
    skip: int = 0  # batches of that epoch already trained


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def read_meta(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def list_checkpoints(directory: Path) -> list[tuple[Path, dict]]:
    """Checkpoints whose metadata reads, oldest save first. Partial folders have none and are never listed."""
    found = []
    if directory.is_dir():
        for folder in directory.iterdir():
            meta = read_meta(folder) if folder.is_dir() and not folder.name.startswith(".") else None
            if meta is not None:
                found.append((folder, meta))
    return sorted(found, key=lambda item: item[1]["serial"])


def to_keep(checkpoints: list[tuple[Path, dict]], keep_last: int, best_metric: str | None,
            best_mode: str) -> set[Path]:
    """The newest `keep_last` saves, plus the earliest one with the best `best_metric` among evaluated ones."""
    keep = {folder for folder, _ in checkpoints[-keep_last:]}
    scored = [(folder, meta["metrics"][best_metric]) for folder, meta in checkpoints
              if isinstance(meta["metrics"].get(best_metric), (int, float))] if best_metric else []
    if scored:
        pick = max if best_mode == "max" else min
        keep.add(pick(scored, key=lambda item: item[1])[0])
    return keep


class CheckpointManager:
    """Saves (collectively, on every process) and prunes checkpoints of one run."""

    def __init__(self, config: Config, accelerator: Accelerator) -> None:
        self.config, self.accelerator = config, accelerator
        self.directory = checkpoints_dir(config.output_dir)
        self._warned_metric = False

    def save(self, run: RunState, evaluated: bool) -> Path:
        accelerator, name = self.accelerator, f"step-{run.step:08d}"
        partial = self.directory / f"{PARTIAL_PREFIX}{name}"
        if accelerator.is_main_process:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(f"{PARTIAL_PREFIX}*"):  # left by a save that a crash cut short
                shutil.rmtree(stale, ignore_errors=True)
        accelerator.wait_for_everyone()
        started = time.perf_counter()
        accelerator.save_state(str(partial))
        # Every process has written its RNG state before the folder can become visible as complete.
        accelerator.wait_for_everyone()
        final = self.directory / name
        if accelerator.is_main_process:
            final = self._publish(run, evaluated, partial, name, time.perf_counter() - started)
            self._prune()
        accelerator.wait_for_everyone()
        return final

    def _publish(self, run: RunState, evaluated: bool, partial: Path, name: str, seconds: float) -> Path:
        fsync_started = time.perf_counter()
        existing = list_checkpoints(self.directory)
        files = {str(path.relative_to(partial)): path.stat().st_size for path in sorted(partial.rglob("*"))
                 if path.is_file()}
        for relative in files:  # durable before the rename publishes them
            _fsync(partial / relative)
        seconds += time.perf_counter() - fsync_started
        metrics_path = run.output_dir / METRICS_FILE
        meta = {
            "format": FORMAT,
            "serial": existing[-1][1]["serial"] + 1 if existing else 1,
            "step": run.step,
            "epoch": run.epoch,
            "batches_done_in_epoch": run.step - run.epoch * run.steps_per_epoch,
            "steps_per_epoch": run.steps_per_epoch,
            "evaluated": evaluated,
            "metrics": dict(run.last_eval) if evaluated else {},
            "metrics_lines": len(metrics_path.read_text().splitlines()) if metrics_path.is_file() else 0,
            "world_size": run.accelerator.num_processes,
            "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "save_seconds": round(seconds, 3),
            "files": files,
            "config": self.config.to_dict(),
        }
        _write_synced(partial / META_FILE, json.dumps(meta, indent=1))
        final = self.directory / name
        suffix = 1
        while final.exists():  # same step saved before, e.g. in a timeline abandoned by resume=PATH
            final, suffix = self.directory / f"{name}-{suffix}", suffix + 1
        os.replace(partial, final)
        _fsync(self.directory)
        size_mb = sum(files.values()) / 2**20
        print(f"checkpoint step {run.step} saved in {final} ({size_mb:.1f} MiB, {seconds:.2f} s)", flush=True)
        return final

    def _prune(self) -> None:
        cfg = self.config.checkpoint
        checkpoints = list_checkpoints(self.directory)
        if cfg.best_metric and not self._warned_metric:
            reported = {name for _, meta in checkpoints for name in meta["metrics"]}
            if reported and cfg.best_metric not in reported:
                self._warned_metric = True
                _warn(self.accelerator, f"checkpoint.best_metric={cfg.best_metric} is not an eval metric "
                                        f"(eval reports {', '.join(sorted(reported))}); keeping only the newest")
        keep = to_keep(checkpoints, cfg.keep_last, cfg.best_metric, cfg.best_mode)
        for folder, _ in checkpoints:
            if folder not in keep:
                shutil.rmtree(folder, ignore_errors=True)


class Checkpointer(Hook):
    """Saves at the configured points, and on SIGTERM / SIGINT saves at the next step boundary and stops."""

    def __init__(self, config: Config, accelerator: Accelerator) -> None:
        self.cfg = config.checkpoint
        self.enabled = bool(self.cfg.every_steps) or self.cfg.at_epoch_end
        self.signals = StopSignals(config.train.collective_timeout_s)
        self.manager = CheckpointManager(config, accelerator)

    def _due(self, run: RunState) -> bool:
        return bool(self.cfg.every_steps) and run.step % self.cfg.every_steps == 0

    def on_step_end(self, run: RunState) -> None:
        if stop_requested(self.signals, run.accelerator):
            self._stop(run, self.manager.save(run, evaluated=False))
        # The loop evaluates right after these steps; saving then also records the metrics.
        eval_follows = run.step % run.steps_per_epoch == 0 or run.step >= run.total_steps or run.should_stop
        if self._due(run) and not eval_follows:
            self.manager.save(run, evaluated=False)

    def on_eval(self, run: RunState, metrics: dict) -> None:
        stopping = stop_requested(self.signals, run.accelerator)
        ending = run.step >= run.total_steps or run.should_stop
        if stopping or (self.enabled and (self.cfg.at_epoch_end or ending or self._due(run))):
            saved = self.manager.save(run, evaluated=True)
            if stopping:
                self._stop(run, saved)

    def _stop(self, run: RunState, saved: Path) -> None:
        raise Preempted(f"stopped by {self.signals.received or 'a signal to another process'} at step {run.step}; "
                        f"checkpoint saved in {saved}; run the same command with resume=auto to continue")


def check_resume(config: Config) -> None:
    """Reject a `resume=PATH` that is not a checkpoint before any data is loaded."""
    if config.resume not in (None, "auto") and read_meta(Path(config.resume)) is None:
        raise UserError(f"resume={config.resume}: not a checkpoint (no readable {META_FILE}); pass a folder "
                        f"under OUTPUT_DIR/checkpoints/, or resume=auto")


def resume(config: Config, accelerator: Accelerator, model: torch.nn.Module, run: RunState) -> ResumePoint:
    """Load the checkpoint `config.resume` names (all processes) and say where training continues."""
    if not config.resume:
        return ResumePoint()
    directory = checkpoints_dir(config.output_dir)
    if config.resume == "auto":
        candidates = list_checkpoints(directory)
        for partial in sorted(directory.glob(f"{PARTIAL_PREFIX}*")) if directory.is_dir() else []:
            _warn(accelerator, f"ignoring {partial}: a save that did not complete")
        if not candidates:
            accelerator.print(f"resume=auto: no checkpoint in {directory}; starting from step 0")
            return ResumePoint()
    else:
        check_resume(config)
        candidates = [(Path(config.resume), read_meta(Path(config.resume)))]
    for folder, meta in reversed(candidates):
        _refuse_other_runs(folder, meta, config, accelerator, model, run)
        trouble = _damage(folder, meta) or _load(accelerator, folder)
        if not any_process(trouble is not None, accelerator):
            break
        _warn(accelerator, f"checkpoint {folder} is unusable ({trouble or 'another process could not load it'}); "
                           "trying the previous one")
    else:
        where = directory if config.resume == "auto" else config.resume
        raise UserError(f"resume={config.resume}: no loadable checkpoint in {where}; set resume=null to start from step 0")
    _note_schedule_changes(folder, meta, config, accelerator)
    run.step = meta["step"]
    run.last_eval = dict(meta["metrics"])
    if folder.parent.resolve() == directory.resolve():
        run.resumed_metrics_lines = meta["metrics_lines"]
    epoch, done = meta["epoch"], meta["batches_done_in_epoch"]
    if done >= meta["steps_per_epoch"] and meta["evaluated"]:
        epoch, done = epoch + 1, 0
    accelerator.print(f"resuming from {folder}: step {run.step}, epoch {epoch}, {done} batches of it done")
    if run.step >= run.total_steps:
        accelerator.print(f"the checkpoint already has {run.step} of {run.total_steps} steps: nothing left to train")
        return ResumePoint(epoch=config.train.epochs)
    return ResumePoint(epoch=epoch, skip=done)


def _refuse_other_runs(folder: Path, meta: dict, config: Config, accelerator: Accelerator,
                       model: torch.nn.Module, run: RunState) -> None:
    def value(tree: dict, key: str):
        for part in key.split("."):
            tree = tree.get(part, {}) if isinstance(tree, dict) else {}
        return tree

    saved, ours = meta["config"], config.to_dict()
    differ = [key for key in IDENTITY_KEYS if value(saved, key) != value(ours, key)]
    if differ:
        raise UserError(f"resume: {folder} is from another run ({', '.join(f'{k}={value(saved, k)}' for k in differ)}; "
                        f"this run has {', '.join(f'{k}={value(ours, k)}' for k in differ)}); use another output_dir "
                        "or resume=null")
    mismatch = _shape_mismatch(folder / "model.safetensors", accelerator.unwrap_model(model))
    if mismatch:
        raise UserError(f"resume: {folder} does not fit model.name={config.model.name} on {config.data.name}: "
                        f"{mismatch}; use another output_dir or resume=null")
    if meta["world_size"] != accelerator.num_processes:
        raise UserError(f"resume: {folder} was saved by {meta['world_size']} process(es), this run has "
                        f"{accelerator.num_processes}; resume with --num_processes {meta['world_size']}")
    if meta["steps_per_epoch"] != run.steps_per_epoch:
        raise UserError(f"resume: {folder} has {meta['steps_per_epoch']} steps per epoch, this run "
                        f"{run.steps_per_epoch}; train.batch_size or data.train_subset changed since it was saved")


def _note_schedule_changes(folder: Path, meta: dict, config: Config, accelerator: Accelerator) -> None:
    """The scheduler's state (LRFactor's settings, base LRs) loads with the checkpoint, so say what it overrides."""
    saved, ours = meta["config"]["train"], config.to_dict()["train"]
    keys = ["lr", "schedule", "lr_gamma", "lr_step_epochs", "warmup_steps"]
    if ours["schedule"] == "cosine":  # the only schedule whose shape depends on the run's length
        keys += ["epochs", "max_steps"]
    changed = [f"train.{key} {saved.get(key)} -> {ours[key]}" for key in keys if saved.get(key) != ours[key]]
    if changed:
        _warn(accelerator, f"resuming {folder}: the LR schedule continues as saved there, ignoring "
                           f"{', '.join(changed)}")


def _shape_mismatch(weights: Path, model: torch.nn.Module) -> str | None:
    """Compare tensor names and shapes from the safetensors header alone (no tensor is read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as saved:
            shapes = {key: tuple(saved.get_slice(key).get_shape()) for key in saved.keys()}
    except Exception:  # unreadable header: reported as damage by the loader, not as another run's
        return None
    expected = {key: tuple(tensor.shape) for key, tensor in model.state_dict().items()}
    for key in sorted(expected.keys() | shapes.keys()):
        if key not in shapes:
            return f"it has no tensor {key}"
        if key not in expected:
            return f"it has a tensor {key} this model lacks"
        if shapes[key] != expected[key]:
            return f"{key} has shape {list(shapes[key])} there, {list(expected[key])} here"
    return None


def _damage(folder: Path, meta: dict) -> str | None:
    for name, size in meta["files"].items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written"
    return None


def _load(accelerator: Accelerator, folder: Path) -> str | None:
    try:
        # weights_only: the optimizer, scheduler and RNG files are pickles; only tensors and plain data may load.
        accelerator.load_state(str(folder), load_kwargs={"weights_only": True})
    except Exception as err:  # a damaged file surfaces as any of safetensors', torch's or pickle's errors
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def _warn(accelerator: Accelerator, text: str) -> None:
    if accelerator.is_main_process:
        print(f"accel-train: warning: {text}", file=sys.stderr, flush=True)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
