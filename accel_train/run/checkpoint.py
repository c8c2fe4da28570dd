"""Checkpoints in output_dir/checkpoints/: atomic, self-describing, pruned; and exact resume from them.

A checkpoint is the folder `accelerator.save_state` writes on every process (model.safetensors, the
optimizer, the LR scheduler, each process's RNG state) plus each process's loop state and checkpoint.json:
step, epoch, position in the epoch, eval metrics, the resolved config and the size of every file.

What survives a resume beside the model, optimizer and scheduler is one mapping of stateful parts, given
once (`Checkpoints(config, accelerator, states={"progress": ..., "meter": ..., ...})`, as torchtitan's
CheckpointManager takes them): a part with tensors (a torch module, such as the EMA of the weights) is saved
with Accelerate's state, any other part's `state_dict()` goes into that process's loop_state_P.json. Resume
loads every part in place; adding a part is one entry. A checkpoint resumes at another world size: a part whose
state differs per process (the train meter's partial sums) says how the saved processes' states merge
(`merge_states`); any other part is the same on every process.

A save holds training only while each process copies its part into host memory (run/snapshot.py); a worker
thread writes it as `.partial-step-N` (and, for a run folder at a URL, uploads it: run/location.py) and marks it
complete. The main process commits the checkpoint once every part is there, with no collective off the training
thread: locally checkpoint.json is written and the folder renamed; in a store the manifest, checkpoint.json with each
object's size and sha256, is written after every object and after metrics.jsonl. A crash at any moment leaves the
previous checkpoints or the complete new one. Checkpoints are found and ordered by their checkpoint.json, never by
name; retention deletes only committed ones, after a newer one is committed.

The loop asks whether a step is to be saved (`due`: the manager decides) and calls `save`, which first waits for the
previous save (at most checkpoint.upload_wait_s; a save that finds the writer still holding two is skipped, saying so:
run/snapshot.py); the end of the run waits for the last (`with Checkpoints`). A save the wait gave up on goes on in
the background and commits itself when it ends; the next save or the end says how it ended, and no save deletes its
`.partial-` folder meanwhile. `resume` restores the parts and returns where training continues as a ResumePoint.
Loading goes through `accelerator.load_state` with `weights_only=True` (safetensors for the model): nothing in a
checkpoint can run code when it is read.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from accel_train import hooks
from accel_train.config import SHARD_ORDER_KEYS, DataConfig, refuse_contradictions, spelled
from accel_train.console import say, warn
from accel_train.distributed.collectives import any_process, first_message, main_value
from accel_train.errors import NonFiniteError, Preempted, UserError, writing
from accel_train.run.layout import (
    CHECKPOINT_META_FILE,
    CHECKPOINTS_DIR,
    LOOP_STATE_FILE,
    MODEL_FILE,
    checkpoints_dir,
    usual_permissions,
)
from accel_train.run.location import RunPlace, Worker, sha256_of
from accel_train.run.weights import shape_mismatch
from accel_train.state import Progress, ResumePoint
from accel_train.storage import StoreUnavailable, is_remote, join

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch
    from accelerate import Accelerator

    from accel_train.config import CheckpointConfig, Config
    from accel_train.run.snapshot import Prepared, Snapshot

FORMAT = 1
PARTIAL_PREFIX = ".partial-"
PART_DONE = ".part-{process}.json"  # a process's part of a checkpoint is complete (in a store: its files' hashes)
ABANDON_WAIT_S = 30.0  # how long a run that fails waits for its own part of a save under way


class Stateful(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


def read_meta(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / CHECKPOINT_META_FILE).read_text())
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


def _sizes(parts: dict[str, list]) -> dict[str, int]:
    return {file: part[0] for file, part in parts.items()}


@dataclass
class UnderWay:
    """A save written in the background that the training thread has not yet seen end."""

    progress: Progress
    name: str  # its folder's, `.partial-NAME` until committed
    job: Future
    location: str  # where it will be, as the user knows it


def resume_position(meta: dict) -> tuple[int, int]:
    """(epoch to continue, optimizer steps of it already taken) for a checkpoint's metadata: a checkpoint of an
    epoch's last step continues with the next epoch (that step's evaluation came before the save)."""
    epoch, done = meta["epoch"], meta["batches_done_in_epoch"]
    if done >= meta["steps_per_epoch"]:
        return epoch + 1, 0
    return epoch, done


class Checkpoints:
    """When to save (the loop asks), saving (collectively, on every process), pruning, and resuming `states`."""

    def __init__(self, config: Config, accelerator: Accelerator, place: RunPlace,
                 states: dict[str, Stateful] | None = None, prepared: Prepared | None = None) -> None:
        """`place`: where the run folder lives; `prepared`: what the run prepared with Accelerate (run/snapshot.py);
        None: save_state writes each save while training waits."""
        import torch

        self.config, self.accelerator = config, accelerator
        self.cfg: CheckpointConfig = config.checkpoint
        self.place, self.mirror = place, place.mirror  # mirror None: a local output_dir
        self.directory = checkpoints_dir(place.folder)
        self.worker = self.mirror.worker if self.mirror is not None else Worker("accel-train checkpoint")
        self.done = "uploaded" if self.mirror is not None else "written"  # what the background does, as lines say it
        from accel_train.run.snapshot import Snapshots  # torch: not before the checks that need none

        self.snapshots, self.abandoned = Snapshots(), False
        self.pending: UnderWay | None = None  # the newest save, waited for by the next save or the end
        self.overdue: list[UnderWay] = []  # saves that wait gave up on, oldest first: still under way, or not yet said
        self.saves, self.blocked_s, self.written_s = 0, 0.0, 0.0
        states = states or {}
        self.prepared = prepared
        for part in states.values():
            if isinstance(part, torch.nn.Module):  # before load_state: a resume restores it
                accelerator.register_for_checkpointing(part)
                if prepared is not None:
                    prepared.custom.append(part)
        self.states = {name: part for name, part in states.items() if not isinstance(part, torch.nn.Module)}

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, kind, error, trace) -> None:
        """When training ends (its end, a stop signal, the non-finite stop), the pending save is committed and the
        run's last files reach the store, within checkpoint.upload_wait_s. After another error the pending save is
        abandoned: a peer may be gone, whose part a commit would wait for; this process's own write is let finish
        (ABANDON_WAIT_S at most: a process must not end inside it), and the newest committed checkpoint stays."""
        if kind is not None and not issubclass(kind, (Preempted, NonFiniteError)):
            self.abandoned = True
            self.worker.idle_within(ABANDON_WAIT_S)
            self.worker.close()
            return
        self.settle(at_end=True)
        if self.mirror is not None:
            self.mirror.drain(self.cfg.upload_wait_s)
        self.worker.close()
        if self.saves and self.accelerator.is_main_process:
            say(f"checkpoints: {self.saves} saved; training blocked {self.blocked_s:.2f} s by them, {self.done} in "
                f"{self.written_s:.2f} s in all")

    def due(self, progress: Progress, last: bool) -> bool:
        """Whether the step just taken is saved: every checkpoint.every_steps optimizer steps, after each epoch's
        evaluation (checkpoint.at_epoch_end), and at the run's `last` step (its end, or early stopping) when saving
        is on at all."""
        every = bool(self.cfg.every_steps) and progress.step % self.cfg.every_steps == 0
        saving = self.cfg.at_epoch_end or bool(self.cfg.every_steps)
        return every or (progress.at_epoch_end and self.cfg.at_epoch_end) or (last and saving)

    def save(self, progress: Progress, evaluated: bool) -> str | None:
        """Every process copies its part of the state to host memory, and training goes on while it is written
        (and uploaded) in the background; the main process commits the checkpoint once every part is there. Waits
        first for the previous save. `evaluated`: after the step's evaluation (its metrics go into checkpoint.json).
        Returns where the checkpoint will be; None when it is skipped, the writer still holding two before it."""
        began = time.perf_counter()
        self.settle()
        accelerator = self.accelerator
        if any_process(not self.snapshots.free(), accelerator):  # every process skips, or none (run/snapshot.py)
            warn(accelerator, f"the checkpoint of step {progress.step} is skipped: the two before it are still being "
                              f"{self.done} and hold host memory for two copies of the state; training goes on and "
                              "the next save tries again")
            return None
        hooks.every().checkpoint_saving(progress)
        name = main_value(self._free_name(progress.step) if accelerator.is_main_process else None, accelerator)
        loop_state = {part_name: part.state_dict() for part_name, part in self.states.items()}
        partial = self.directory / f"{PARTIAL_PREFIX}{name}"
        with writing(partial, f"saving the checkpoint of step {progress.step}"):
            if accelerator.is_main_process or self.mirror is not None:  # a staging folder is this process's own
                self.directory.mkdir(parents=True, exist_ok=True)
                # locally the main process's saves stand for every process's: each is under way there until it has
                # committed (every part written) or given up; in a store nothing deletes a partial prefix
                under_way = {f"{PARTIAL_PREFIX}{save.name}" for save in self.overdue}
                for stale in self.directory.glob(f"{PARTIAL_PREFIX}*"):
                    if stale.name not in under_way:  # left by a save that a crash cut short
                        shutil.rmtree(stale, ignore_errors=True)
            accelerator.wait_for_everyone()
            snapshot = self.snapshots.take(accelerator, self.prepared) if self.prepared is not None else None
            if snapshot is None:
                accelerator.save_state(str(partial))
        blocked = time.perf_counter() - began
        saved = copy.copy(progress)  # the loop goes on changing `progress`
        job = self.worker.submit(self._write_and_commit, saved, evaluated, name, partial, snapshot, loop_state,
                                 blocked)
        self.pending = UnderWay(saved, name, job, self.where(self.directory / name))
        self.saves, self.blocked_s = self.saves + 1, self.blocked_s + blocked
        return self.pending.location

    def where(self, folder: Path) -> str:
        """A checkpoint folder as the user knows it: its URL for a run folder in a store."""
        if self.mirror is None:
            return str(folder)
        return join(self.mirror.url, CHECKPOINTS_DIR, *([folder.name] if folder != self.directory else []))

    def settle(self, bound_s: float | None = None, at_end: bool = False) -> None:
        """Wait (at most `bound_s`, else checkpoint.upload_wait_s) for the pending save: its checkpoint_saved hook
        runs on this thread, or its failure is said (raised with checkpoint.require_upload, or when the disk
        failed). A save this wait gives up on goes on (it commits itself) and is said once it has ended, at a later
        settle: its hook, or one warning; the end waits for it too, and says which it ends without."""
        bound_s = self.cfg.upload_wait_s if bound_s is None else bound_s
        if self.pending is not None or (at_end and self.overdue):
            self.worker.idle_within(bound_s)  # every job so far, run in the order submitted: these saves' among them
        for save in [save for save in self.overdue if save.job.done()]:
            self.overdue.remove(save)
            self._said_late(save)
        pending, self.pending = self.pending, None
        if pending is not None and pending.job.done():
            self._said(pending)
        elif pending is not None:
            self.overdue.append(pending)
            if not at_end:
                warn(self.accelerator, f"the checkpoint of step {pending.progress.step} is still being {self.done} "
                                       f"after {bound_s:g} s (checkpoint.upload_wait_s); going on without it: it is "
                                       "committed if it ends, and a later line says if it fails")
        if at_end:
            for save in self.overdue:
                warn(self.accelerator, f"the checkpoint of step {save.progress.step} is still being {self.done} "
                                       f"after {bound_s:g} s (checkpoint.upload_wait_s); ending without it: "
                                       "resume=auto takes the newest committed checkpoint")
            self.overdue = []

    def _said(self, save: UnderWay) -> None:
        """A save the training thread waited for, ended."""
        try:
            save.job.result(timeout=0)
        except StoreUnavailable as err:
            if self.cfg.require_upload:
                raise
            say(f"accel-train: warning: the checkpoint of step {save.progress.step} did not reach the store ({err}); "
                "training goes on and the next save tries again (checkpoint.require_upload=true stops instead)",
                error=True)
            return
        hooks.every().checkpoint_saved(save.progress, save.location)

    def _said_late(self, save: UnderWay) -> None:
        """A save training went on without, ended: committed (its worker did it), or failed, which is a warning, not
        an error: the run already goes on without it. Each process says its own failure (errors.py)."""
        error = save.job.exception(timeout=0)
        if error is None:
            hooks.every().checkpoint_saved(save.progress, save.location)
            return
        reason = str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"  # ours: one line
        say(f"accel-train: warning: the checkpoint of step {save.progress.step} failed after training went on without "
            f"it ({reason.splitlines()[0]}); resume=auto takes the newest committed checkpoint", error=True)

    def _free_name(self, step: int) -> str:
        name, suffix = f"step-{step:08d}", 1
        taken = set(self.mirror.partial_checkpoints) if self.mirror is not None else set()
        while (self.directory / name).exists() or name in taken:  # e.g. a timeline abandoned by resume=PATH
            name, suffix = f"step-{step:08d}-{suffix}", suffix + 1
        return name

    def _write_and_commit(self, progress: Progress, evaluated: bool, name: str, partial: Path,
                          snapshot: Snapshot | None, loop_state: dict, blocked: float) -> None:
        """In the background: this process's part written (from the snapshot) and, for a store, uploaded; then on
        the main process, once every process's part is there, the checkpoint committed and old ones pruned."""
        started, accelerator = time.perf_counter(), self.accelerator
        process = accelerator.process_index
        with writing(partial, f"saving the checkpoint of step {progress.step}"):
            if snapshot is not None:
                self.snapshots.write(snapshot, partial)
            _write_synced(partial / LOOP_STATE_FILE.format(process=process), json.dumps(loop_state))
            mine = sorted(path for path in partial.iterdir() if path.is_file() and not path.name.startswith("."))
            if snapshot is not None or self.mirror is not None:  # else save_state wrote them, synced at publishing
                usual_permissions(*mine)
                for path in mine:
                    _fsync(path)
            if self.mirror is None:
                _write_synced(partial / PART_DONE.format(process=process), "")
        if self.mirror is not None:
            self._upload_part(name, mine)
            if not accelerator.is_main_process:  # the store has them
                shutil.rmtree(partial, ignore_errors=True)
        if not accelerator.is_main_process:
            return
        parts = self._wait_for_parts(name, partial, progress.step)
        with writing(partial, f"saving the checkpoint of step {progress.step}"):
            final = self._publish(progress, evaluated, partial, name, parts)
        if self.mirror is not None:  # the store has them; staging keeps the manifest
            shutil.rmtree(partial, ignore_errors=True)
        written = time.perf_counter() - started
        self.written_s += written
        size_mb = sum(meta_size for meta_size in _sizes(parts).values()) / 2**20
        say(f"checkpoint step {progress.step} saved in {self.where(final)}: blocked {blocked:.2f} s, {self.done} in "
            f"{written:.2f} s ({size_mb:.1f} MiB)")
        self._prune()

    def _upload_part(self, name: str, paths: list[Path]) -> None:
        """This process's files under the checkpoint's prefix, then the record of them that tells the main process
        this part is complete."""
        store, record = self.mirror.store, {}
        for path in paths:
            store.put(path, f"{CHECKPOINTS_DIR}/{name}/{path.name}")
            record[path.name] = [path.stat().st_size, sha256_of(path)]
        store.write(f"{CHECKPOINTS_DIR}/{name}/{PART_DONE.format(process=self.accelerator.process_index)}",
                    json.dumps(record).encode())

    def _wait_for_parts(self, name: str, partial: Path, step: int) -> dict[str, list]:
        """{file: [size, sha256 or None]} of every process's part, once all are there (polled, at most
        checkpoint.upload_wait_s: no collective runs off the training thread)."""
        processes, deadline = self.accelerator.num_processes, time.monotonic() + self.cfg.upload_wait_s
        markers = [PART_DONE.format(process=process) for process in range(processes)]
        while True:
            if self.mirror is not None:
                present = set(self.mirror.store.names(f"{CHECKPOINTS_DIR}/{name}"))
            else:
                present = {path.name for path in partial.iterdir()}
            missing = [process for process, marker in enumerate(markers) if marker not in present]
            if not missing:
                break
            if self.abandoned:
                raise UserError(f"the checkpoint of step {step} was abandoned: training ended with an error")
            if time.monotonic() > deadline:
                raise UserError(f"the checkpoint of step {step}: process(es) {', '.join(map(str, missing))} did not "
                                f"write their part within {self.cfg.upload_wait_s:g} s (checkpoint.upload_wait_s)")
            time.sleep(0.05)
        if self.mirror is None:
            for marker in markers:
                (partial / marker).unlink()
            return {str(path.relative_to(partial)): [path.stat().st_size, None]
                    for path in sorted(partial.rglob("*")) if path.is_file()}
        parts: dict[str, list] = {}
        for marker in markers:
            parts.update(json.loads(self.mirror.store.read(f"{CHECKPOINTS_DIR}/{name}/{marker}")))
        return parts

    def _publish(self, progress: Progress, evaluated: bool, partial: Path, name: str, parts: dict) -> Path:
        """The checkpoint.json that marks the checkpoint complete, written last: locally the folder renamed into
        place; in a store the manifest (each object's size and sha256) after every object and metrics.jsonl."""
        existing = list_checkpoints(self.directory)
        if self.mirror is None:
            usual_permissions(*(partial / relative for relative in parts))
            for relative in parts:  # durable before the rename publishes them
                _fsync(partial / relative)
        meta = {
            "format": FORMAT,
            "serial": existing[-1][1]["serial"] + 1 if existing else 1,
            "step": progress.step,
            "epoch": progress.epoch,
            "batches_done_in_epoch": progress.batches_done_in_epoch(),
            "steps_per_epoch": progress.steps_per_epoch,
            "evaluated": evaluated,
            "metrics": dict(progress.last_eval) if evaluated else {},
            "world_size": self.accelerator.num_processes,
            "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "files": _sizes(parts),
            **({"sha256": {file: part[1] for file, part in parts.items()}} if self.mirror is not None else {}),
            "config": self.config.to_dict(),
        }
        text, final = json.dumps(meta, indent=1), self.directory / name
        if self.mirror is not None:
            self.mirror.sync()  # every line this checkpoint has seen is in the store before it counts
            self.mirror.store.write(f"{CHECKPOINTS_DIR}/{name}/{CHECKPOINT_META_FILE}", text.encode())
            final.mkdir()  # staged: the manifest alone, for the checkpoints' order and retention
            _write_synced(final / CHECKPOINT_META_FILE, text)
            return final
        _write_synced(partial / CHECKPOINT_META_FILE, text)
        os.replace(partial, final)
        _fsync(self.directory)
        return final

    def _prune(self) -> None:
        """Checkpoints beyond checkpoint.keep_last (and not the best): only committed ones of this run, each by the
        files its manifest lists."""
        cfg = self.cfg
        checkpoints = list_checkpoints(self.directory)
        keep = to_keep(checkpoints, cfg.keep_last, cfg.best_metric, cfg.best_mode)
        for folder, meta in checkpoints:
            if folder not in keep:
                self._delete(folder, meta)

    def _delete(self, folder: Path, meta: dict) -> None:
        """A committed checkpoint; in a store, uncommitted first (its manifest), then emptied of what it lists."""
        if self.mirror is not None:
            prefix = f"{CHECKPOINTS_DIR}/{folder.name}"
            self.mirror.store.remove(f"{prefix}/{CHECKPOINT_META_FILE}")
            for name in [*meta["files"], *(PART_DONE.format(process=p) for p in range(meta["world_size"]))]:
                self.mirror.store.remove(f"{prefix}/{name}")
        shutil.rmtree(folder, ignore_errors=True)

    def resume(self, model: torch.nn.Module, steps_per_epoch: int, total_steps: int) -> ResumePoint:
        """Load the checkpoint `resume` names (all processes), restore every part in place, and say where training
        continues."""
        config, accelerator, directory = self.config, self.accelerator, self.directory
        if not config.resume:
            return ResumePoint()
        if config.resume == "auto":
            candidates = list_checkpoints(directory)
            partials = sorted(directory.glob(f"{PARTIAL_PREFIX}*")) if directory.is_dir() else []
            for partial in [*partials, *(directory / name for name in self.mirror.partial_checkpoints)] \
                    if self.mirror is not None else partials:
                warn(accelerator, f"ignoring {self.where(partial)}: a save that did not complete")
            if not candidates:
                accelerator.print(f"resume=auto: no checkpoint in {self.where(directory)}; starting from step 0")
                return ResumePoint()
        else:  # check_resume made sure, before any data loaded, that it is a checkpoint of this run
            candidates = [(resume_folder(config, self.place), read_meta(resume_folder(config, self.place)))]
        for folder, meta in reversed(candidates):
            if folder != candidates[-1][0]:  # the newest was checked before any data loaded (check_resume)
                _refuse_other_identity(self.where(folder), meta, config)
            trouble = self._fetch(folder, meta) if self.mirror is not None else None
            if trouble is None:
                _refuse_what_cannot_continue(folder, self.where(folder), meta, config, accelerator, model,
                                             steps_per_epoch)
                trouble = _damage(folder, meta)
            error = None
            if trouble is None:
                trouble, error = _load(accelerator, folder)
            error = first_message(error, accelerator)
            if error:  # not damage: an older checkpoint would fail the same way, and this one is probably good
                raise UserError(f"resume: cannot load {self.where(folder)}, whose files are whole: {error}; this is "
                                "not damage in the checkpoint but a library that differs from what accel-train "
                                "expects (see accel-train --version) or a bug; the checkpoint is left as it is")
            if not any_process(trouble is not None, accelerator):
                break
            warn(accelerator, f"checkpoint {self.where(folder)} is unusable "
                              f"({trouble or 'another process could not load it'}); trying the previous one")
        else:
            where = self.where(directory) if config.resume == "auto" else config.resume
            raise UserError(f"resume={config.resume}: no loadable checkpoint in {where}; set resume=null to start from "
                            "step 0")
        _note_schedule_changes(self.where(folder), meta, config, accelerator)
        epoch, done = resume_position(meta)
        accelerator.print(f"resuming from {self.where(folder)}: step {meta['step']}, epoch {epoch}, {done} batches "
                          "of it done")
        if meta["step"] >= total_steps:
            accelerator.print(f"the checkpoint already has {meta['step']} of {total_steps} steps: nothing left to "
                              "train")
            epoch, done = config.train.epochs, 0
        # Accelerate's count of micro-batches, loaded with the RNG state, was made with the saved run's accumulation
        # steps (and is missing for a process that run did not have); a checkpoint is at an optimizer step, where
        # the count starts over.
        accelerator.step = 0
        if meta["world_size"] == accelerator.num_processes:
            saved = _read_loop_state(folder, accelerator.process_index, meta)
        else:
            saved = self._merged_loop_states(folder, meta)
            _reseed_processes(config.seed, meta["step"], accelerator)
        for name, part in self.states.items():
            if saved.get(name) is not None:
                part.load_state_dict(saved[name])
        return ResumePoint(step=meta["step"], epoch=epoch, steps_done_in_epoch=done, evaluated=meta["evaluated"],
                           in_output_dir=folder.parent.resolve() == directory.resolve(),
                           saved_world_size=meta["world_size"])

    def _fetch(self, folder: Path, meta: dict) -> str | None:
        """A committed checkpoint's objects from the store into staging, once per machine: the machine's first
        process downloads them into a folder its processes share, and each process links them into its own staging
        (a hard link, else a copy). What is wrong, or None."""
        accelerator, fetched = self.accelerator, self.mirror.fetched / folder.name
        trouble = self._download(fetched, folder.name, meta) if accelerator.is_local_main_process else None
        accelerator.wait_for_everyone()
        if trouble is None:
            trouble = _linked(fetched, folder, meta)
        accelerator.wait_for_everyone()
        if accelerator.is_local_main_process:
            shutil.rmtree(fetched, ignore_errors=True)
        return trouble

    def _download(self, into: Path, name: str, meta: dict) -> str | None:
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

    def _merged_loop_states(self, folder: Path, meta: dict) -> dict:
        """Each part's state for this process from a checkpoint of another world size: a part whose state differs
        per process (the train meter's partial sums) merges the saved processes' states (`merge_states`); any
        other part is the same on every process, and process 0's is taken."""
        saved = [_read_loop_state(folder, process, meta) for process in range(meta["world_size"])]
        merged = {}
        for name, part in self.states.items():
            states = [state.get(name) for state in saved]
            if any(state is None for state in states):
                continue
            merge = getattr(part, "merge_states", None)
            merged[name] = merge(states) if merge is not None else states[0]
        return merged


def check_resume(config: Config, place: RunPlace) -> None:
    """Before any data is loaded: `resume=PATH` is a checkpoint, and the checkpoint to resume is this run's."""
    if config.resume is None:
        return
    own = checkpoints_dir(place.folder)
    if config.resume == "auto":
        found = list_checkpoints(own)
        if found:
            _refuse_other_identity(place.shown(found[-1][0]), found[-1][1], config)
        return
    folder = resume_folder(config, place)
    meta = read_meta(folder)
    if meta is None:
        raise UserError(f"resume={config.resume}: not a checkpoint (no readable {CHECKPOINT_META_FILE}); pass a folder "
                        f"under OUTPUT_DIR/checkpoints/, or resume=auto")
    _refuse_other_identity(place.shown(folder), meta, config)
    if folder.resolve().parent != own.resolve():
        raise UserError(f"resume={config.resume} is a checkpoint of another folder than "
                        f"output_dir={config.output_dir}: resume continues output_dir's own run (resume=auto, or one "
                        f"of {join(config.output_dir, CHECKPOINTS_DIR)}/step-N); to start a new run from its weights, "
                        f"give model.init_from={config.resume} instead")


def resume_folder(config: Config, place: RunPlace) -> Path:
    """The folder `resume=PATH` names; for a run folder in a store, a checkpoint URL under output_dir is its staged
    copy (whose manifest the start pulled)."""
    if not is_remote(config.resume):
        return Path(config.resume)
    prefix = join(config.output_dir, CHECKPOINTS_DIR) + "/"
    if is_remote(config.output_dir) and config.resume.startswith(prefix):
        return checkpoints_dir(place.folder) / config.resume[len(prefix):].strip("/")
    raise UserError(f"resume={config.resume} is not a checkpoint of output_dir={config.output_dir}: resume continues "
                    f"output_dir's own run (resume=auto, or {prefix}step-N); to start a new run from its weights, "
                    f"give model.init_from=... instead")


def _refuse_other_identity(shown: str, meta: dict, config: Config) -> None:
    """`shown`: the checkpoint as the user knows it (its URL for a run folder in a store)."""
    refuse_contradictions(meta["config"], config, f"resume: {shown} is from another run",
                          "use another output_dir or resume=null")


def _read_loop_state(folder: Path, process: int, meta: dict) -> dict:
    """This process's saved parts by name. A loop state without named parts (the train meter's sums at the top
    level, the progress in checkpoint.json alone) is read into the parts."""
    path = folder / LOOP_STATE_FILE.format(process=process)
    state = json.loads(path.read_text()) if path.is_file() else {}
    if "progress" not in state:
        state = {"meter": {key: state[key] for key in ("names", "sums", "counted")} if "names" in state else None,
                 "selection": state.get("selection"),
                 "progress": {"step": meta["step"], "last_eval": meta["metrics"],
                              "elapsed_s": state.get("elapsed_s", 0.0)}}
    return state


def _refuse_what_cannot_continue(folder: Path, shown: str, meta: dict, config: Config, accelerator: Accelerator,
                                 model: torch.nn.Module, steps_per_epoch: int) -> None:
    """A checkpoint whose tensors or steps per epoch this run cannot continue from (any world size can: the
    global batch, and so the steps per epoch, are the same at every world size that divides it)."""
    mismatch = shape_mismatch(folder / MODEL_FILE, accelerator.unwrap_model(model))
    if mismatch:
        raise UserError(f"resume: {shown} does not fit model.name={config.model.name} on {config.data.name}: "
                        f"{mismatch}; use another output_dir or resume=null")
    if meta["steps_per_epoch"] != steps_per_epoch:
        raise UserError(f"resume: {shown} has {meta['steps_per_epoch']} steps per epoch, this run "
                        f"{steps_per_epoch}; train.batch_size or data.train_subset changed since it was saved")
    if config.data.name == "shards":  # the order over shards is a function of these too: a resumed epoch must see it
        saved_data = meta["config"].get("data") or {}
        for key in SHARD_ORDER_KEYS:
            saved, now = saved_data.get(key, getattr(DataConfig(), key)), getattr(config.data, key)
            if saved != now:
                raise UserError(f"resume: {shown} was trained with data.{key}={saved}, this run has data.{key}={now}: "
                                "the order of the samples over the shards depends on it, so the resumed epoch would "
                                "repeat some samples and skip others; set it back, or start a new run "
                                "(model.init_from takes the weights)")
    saved_ema = (meta["config"].get("train") or {}).get("ema_decay")
    if bool(saved_ema) != bool(config.train.ema_decay):  # the EMA is a part of the checkpoint, saved or not
        raise UserError(f"resume: {shown} was saved with train.ema_decay={spelled(saved_ema)}, this run has "
                        f"train.ema_decay={spelled(config.train.ema_decay)}: an EMA of the weights is saved and "
                        "restored with the checkpoint, so it cannot be added or dropped on the way; set it as the "
                        "checkpoint had it, or start a new run (model.init_from takes the weights)")


def _reseed_processes(seed: int, step: int, accelerator: Accelerator) -> None:
    """After loading a checkpoint of another world size: each process's own random streams (dropout) anew from
    (seed, process, step), since the saved streams were those of other processes."""
    from accelerate.utils import set_seed

    digest = hashlib.sha256(f"{seed}:{accelerator.process_index}:{step}".encode()).digest()
    set_seed(int.from_bytes(digest[:4], "little"))


def _note_schedule_changes(shown: str, meta: dict, config: Config, accelerator: Accelerator) -> None:
    """The scheduler's state (LRFactor's settings, base LRs) loads with the checkpoint, so say what it overrides."""
    saved, ours = meta["config"]["train"], config.to_dict()["train"]
    keys = ["lr", "schedule", "lr_gamma", "lr_step_epochs", "warmup_steps"]
    if ours["schedule"] == "cosine":  # the only schedule whose shape depends on the run's length
        keys += ["epochs", "max_steps"]
    changed = [f"train.{key} {saved.get(key)} -> {ours[key]}" for key in keys if saved.get(key) != ours[key]]
    if changed:
        warn(accelerator, f"resuming {shown}: the LR schedule continues as saved there, ignoring "
                           f"{', '.join(changed)}")


def _linked(fetched: Path, folder: Path, meta: dict) -> str | None:
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


def _damage(folder: Path, meta: dict) -> str | None:
    for name, size in meta["files"].items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written"
    return None


def _load(accelerator: Accelerator, folder: Path) -> tuple[str | None, str | None]:
    """Load a checkpoint: (what is damaged, None), or (None, an error that is not damage), or (None, None)."""
    try:
        # weights_only: the optimizer, scheduler and RNG files are pickles; only tensors and plain data may load.
        accelerator.load_state(str(folder), load_kwargs={"weights_only": True})
    except Exception as err:
        text = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return (text, None) if _is_damage(err) else (None, text)
    return None, None


def _is_damage(err: Exception) -> bool:
    """Whether a load error means a file's bytes do not decode, rather than an API or a class that differs."""
    from safetensors import SafetensorError

    if isinstance(err, PermissionError):  # a file we may not read is whole: say so rather than skip it
        return False
    if isinstance(err, (SafetensorError, EOFError, OSError)):
        return True
    if isinstance(err, pickle.UnpicklingError):  # torch's weights-only unpickler: garbage, or a class it refuses
        return "Unsupported global" not in str(err)
    return isinstance(err, RuntimeError) and "PytorchStreamReader" in str(err)  # torch's zip reader


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
