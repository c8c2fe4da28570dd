"""Checkpoints in output_dir/checkpoints/: atomic, self-describing, pruned; and exact resume from them.

Here: when a save is due, how it is written and committed, retention, and the order of a resume. A checkpoint's
files (format, listing, which are kept) are run/checkpoint_files.py; what to resume and whether it fits, loading,
and the fetch from a store are run/resume.py; the copy into host memory is run/snapshot.py.

A checkpoint is the folder `accelerator.save_state` writes on every process (model.safetensors, the
optimizer, the LR scheduler, each process's RNG state) plus each process's loop state and checkpoint.json:
step, epoch, position in the epoch, eval metrics, the resolved config and the size of every file.

What survives a resume beside the model, optimizer and scheduler is one mapping of stateful parts, given
once (`Checkpoints(config, accelerator, place, states={"progress": ..., ...})`, as torchtitan's
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
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from accel_train import hooks
from accel_train.console import note, warn
from accel_train.distributed.collectives import any_process, first_message, main_value
from accel_train.errors import NonFiniteError, Preempted, UserError, writing
from accel_train.run.checkpoint_files import (
    FORMAT,
    PART_DONE,
    PARTIAL_PREFIX,
    TENSOR_PART,
    fsync,
    list_checkpoints,
    read_meta,
    save_tensor_part,
    sizes,
    to_keep,
    write_synced,
)
from accel_train.run.layout import (
    CHECKPOINT_META_FILE,
    CHECKPOINTS_DIR,
    LOOP_STATE_FILE,
    checkpoints_dir,
    usual_permissions,
)
from accel_train.run.location import RunPlace, Worker, sha256_of
from accel_train.run.resume import (
    damage,
    fetch_once_per_machine,
    load_checkpoint,
    merged_loop_states,
    note_schedule_changes,
    read_loop_state,
    refuse_other_identity,
    refuse_what_cannot_continue,
    reseed_processes,
    resume_folder,
    resume_position,
)
from accel_train.state import Progress, ResumePoint
from accel_train.storage import StoreUnavailable

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch
    from accelerate import Accelerator

    from accel_train.config import CheckpointConfig, Config
    from accel_train.run.snapshot import Prepared, Snapshot

ABANDON_WAIT_S = 30.0  # how long a run that fails waits for its own part of a save under way


class Stateful(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...




@dataclass
class UnderWay:
    """A save written in the background that the training thread has not yet seen end."""

    progress: Progress
    name: str  # its folder's, `.partial-NAME` until committed
    job: Future
    location: str  # where it will be, as the user knows it




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
        # A part with tensors (the EMA) is written as NAME.safetensors, not through Accelerate's
        # register_for_checkpointing, whose pickle Accelerate loads with weights_only=False (it could run code).
        self.tensor_parts = {name: part for name, part in states.items() if isinstance(part, torch.nn.Module)}
        if prepared is not None:
            prepared.parts.update(self.tensor_parts)
        self.states = {name: part for name, part in states.items() if name not in self.tensor_parts}

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
        if self.saves:
            note(logger, self.accelerator, f"checkpoints: {self.saves} saved; training blocked {self.blocked_s:.2f} s "
                                           f"by them, {self.done} in {self.written_s:.2f} s in all")

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
            warn(logger, accelerator,
                 f"the checkpoint of step {progress.step} is skipped: the two before it are still being "
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
                for part_name, part in self.tensor_parts.items() if accelerator.is_main_process else ():
                    save_tensor_part(part.state_dict(), partial / TENSOR_PART.format(name=part_name))
        blocked = time.perf_counter() - began
        saved = copy.copy(progress)  # the loop goes on changing `progress`
        job = self.worker.submit(self._write_and_commit, saved, evaluated, name, partial, snapshot, loop_state,
                                 blocked)
        self.pending = UnderWay(saved, name, job, self.where(self.directory / name))
        self.saves, self.blocked_s = self.saves + 1, self.blocked_s + blocked
        return self.pending.location

    def where(self, folder: Path) -> str:
        """A checkpoint folder as the user knows it: its URL for a run folder in a store."""
        return self.place.shown(folder)

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
                warn(logger, self.accelerator,
                     f"the checkpoint of step {pending.progress.step} is still being {self.done} "
                     f"after {bound_s:g} s (checkpoint.upload_wait_s); going on without it: it is "
                     "committed if it ends, and a later line says if it fails")
        if at_end:
            for save in self.overdue:
                warn(logger, self.accelerator,
                     f"the checkpoint of step {save.progress.step} is still being {self.done} "
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
            logger.warning(f"the checkpoint of step {save.progress.step} did not reach the store ({err}); training "
                           "goes on and the next save tries again (checkpoint.require_upload=true stops instead)")
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
        logger.warning(f"the checkpoint of step {save.progress.step} failed after training went on without it "
                       f"({reason.splitlines()[0]}); resume=auto takes the newest committed checkpoint")

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
            write_synced(partial / LOOP_STATE_FILE.format(process=process), json.dumps(loop_state))
            mine = sorted(path for path in partial.iterdir() if path.is_file() and not path.name.startswith("."))
            if snapshot is not None or self.mirror is not None:  # else save_state wrote them, synced at publishing
                usual_permissions(*mine)
                for path in mine:
                    fsync(path)
            if self.mirror is None:
                write_synced(partial / PART_DONE.format(process=process), "")
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
        size_mb = sum(meta_size for meta_size in sizes(parts).values()) / 2**20
        logger.info(f"checkpoint step {progress.step} saved in {self.where(final)}: blocked {blocked:.2f} s, "
                    f"{self.done} in {written:.2f} s ({size_mb:.1f} MiB)")
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
            return {str(path.relative_to(partial)): [path.stat().st_size, sha256_of(path)]
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
                fsync(partial / relative)
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
            "files": sizes(parts),
            "sha256": {file: part[1] for file, part in parts.items()},  # checked before anything is loaded
            "config": self.config.to_dict(),
        }
        text, final = json.dumps(meta, indent=1), self.directory / name
        if self.mirror is not None:
            self.mirror.sync()  # every line this checkpoint has seen is in the store before it counts
            self.mirror.store.write(f"{CHECKPOINTS_DIR}/{name}/{CHECKPOINT_META_FILE}", text.encode())
            final.mkdir()  # staged: the manifest alone, for the checkpoints' order and retention
            write_synced(final / CHECKPOINT_META_FILE, text)
            return final
        write_synced(partial / CHECKPOINT_META_FILE, text)
        os.replace(partial, final)
        fsync(self.directory)
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

    def _loop_states(self, folder: Path, meta: dict) -> tuple[str | None, dict | None]:
        """(what is damaged, None) or (None, this process's saved parts by name): its own loop state, or at another
        world size the saved processes' merged."""
        try:
            if meta["world_size"] == self.accelerator.num_processes:
                return None, read_loop_state(folder, self.accelerator.process_index, meta)
            return None, merged_loop_states(self.states, folder, meta)
        except (OSError, ValueError, TypeError, KeyError) as err:  # JSONDecodeError, UnicodeDecodeError: ValueError
            return f"a loop state does not read ({type(err).__name__}: {str(err).splitlines()[0][:200]})", None

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
                warn(logger, accelerator, f"ignoring {self.where(partial)}: a save that did not complete")
            if not candidates:
                note(logger, accelerator,
                     f"resume=auto: no checkpoint in {self.where(directory)}; starting from step 0")
                return ResumePoint()
        else:  # check_resume made sure, before any data loaded, that it is a checkpoint of this run
            candidates = [(resume_folder(config, self.place), read_meta(resume_folder(config, self.place)))]
        for folder, meta in reversed(candidates):
            if folder != candidates[-1][0]:  # the newest was checked before any data loaded (check_resume)
                refuse_other_identity(self.where(folder), meta, config)
            trouble = fetch_once_per_machine(accelerator, self.mirror, folder, meta) if self.mirror is not None \
                else None
            if trouble is None:  # before anything is read: sizes, and content (sha256) where the fetch did not check it
                trouble = damage(folder, meta, content=self.mirror is None and accelerator.is_local_main_process)
            if not any_process(trouble is not None, accelerator):  # every process loads, or none
                refuse_what_cannot_continue(folder, self.where(folder), meta, config, accelerator, model,
                                             steps_per_epoch)
                trouble, error = load_checkpoint(accelerator, folder, meta, self.tensor_parts)
                if trouble is None and error is None:
                    trouble, saved = self._loop_states(folder, meta)
                error = first_message(error, accelerator)
                if error:  # not damage: an older checkpoint would fail the same way, and this one is probably good
                    raise UserError(f"resume: cannot load {self.where(folder)}, whose files are whole: {error}; the "
                                    "checkpoint is left as it is")
                if not any_process(trouble is not None, accelerator):
                    break
            warn(logger, accelerator, f"checkpoint {self.where(folder)} is unusable "
                                      f"({trouble or 'another process found it damaged'}); trying the previous one")
        else:
            where = self.where(directory) if config.resume == "auto" else config.resume
            raise UserError(f"resume={config.resume}: no loadable checkpoint in {where}; set resume=null to start from "
                            "step 0")
        note_schedule_changes(self.where(folder), meta, config, accelerator)
        epoch, done = resume_position(meta)
        note(logger, accelerator,
             f"resuming from {self.where(folder)}: step {meta['step']}, epoch {epoch}, {done} batches "
             "of it done")
        if meta["step"] >= total_steps:
            note(logger, accelerator,
                 f"the checkpoint already has {meta['step']} of {total_steps} steps: nothing left to "
                 "train")
            epoch, done = config.train.epochs, 0
        # Accelerate's count of micro-batches, loaded with the RNG state, was made with the saved run's accumulation
        # steps (and is missing for a process that run did not have); a checkpoint is at an optimizer step, where
        # the count starts over.
        accelerator.step = 0
        if meta["world_size"] != accelerator.num_processes:
            reseed_processes(config.seed, meta["step"], accelerator)
        for name, part in self.states.items():
            if saved.get(name) is not None:
                part.load_state_dict(saved[name])
        return ResumePoint(step=meta["step"], epoch=epoch, steps_done_in_epoch=done, evaluated=meta["evaluated"],
                           in_output_dir=folder.parent.resolve() == directory.resolve(),
                           saved_world_size=meta["world_size"])
