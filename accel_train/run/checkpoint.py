"""Checkpoints in output_dir/checkpoints/: atomic, self-describing, pruned; and exact resume from them.

The manager: when a save is due (the loop asks `due`, then calls `save`), the order of a save (every process copies
its part into host memory, a worker thread writes it, the place puts it where it goes, the main process commits it
once every part is there, with no collective off the training thread), what is said of each save (of those still
being written: run/background_saves.py), retention (only committed checkpoints, after a newer one is committed), and
the order of a resume (the newest loadable checkpoint, older ones past damage), which returns a ResumePoint. Where
and how the bytes go, a folder or a store, is the run's place (run/place.py); a checkpoint's files are
run/checkpoint_files.py; whether one fits and loading it, run/resume.py; the copy into host memory, run/snapshot.py.

What survives a resume beside the model, optimizer and scheduler is one mapping of stateful parts, given once
(`Checkpoints(config, accelerator, place, states={"progress": ..., ...})`, as torchtitan's CheckpointManager takes
them): a part with tensors (the EMA of the weights) is saved as NAME.safetensors, any other part's `state_dict()` in
that process's loop_state_P.json. A save waits first for the previous one, at most checkpoint.upload_wait_s; one the
wait gave up on goes on and commits itself, and the next save or the end (`with Checkpoints`) says how it ended.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from typing import TYPE_CHECKING

from accel_train import hooks
from accel_train.console import note, warn
from accel_train.distributed.collectives import any_process, main_value
from accel_train.errors import NonFiniteError, Preempted, UserError, writing
from accel_train.run.background_saves import BackgroundSaves, UnderWay
from accel_train.run.checkpoint_files import (
    PARTIAL_PREFIX,
    TENSOR_PART,
    damaged_checkpoints,
    list_checkpoints,
    manifest,
    read_meta,
    save_tensor_part,
    sizes,
    to_keep,
    write_synced,
)
from accel_train.run.layout import LOOP_STATE_FILE
from accel_train.run.resume import continue_from, load, refuse_other_identity
from accel_train.state import Progress, ResumePoint, Stateful

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from accelerate import Accelerator

    from accel_train.config import CheckpointConfig, Config
    from accel_train.run.place import RunPlace
    from accel_train.run.snapshot import Prepared, Snapshot

logger = logging.getLogger(__name__)

ABANDON_WAIT_S = 30.0  # how long a run that fails waits for its own part of a save under way


class Checkpoints:
    """When to save (the loop asks), saving (collectively, on every process), pruning, and resuming `states`."""

    def __init__(self, config: Config, accelerator: Accelerator, place: RunPlace,
                 states: dict[str, Stateful] | None = None, prepared: Prepared | None = None) -> None:
        """`place`: where the run folder lives; `prepared`: what the run prepared with Accelerate (run/snapshot.py);
        None: save_state writes each save while training waits."""
        import torch

        from accel_train.run.snapshot import Snapshots  # torch: not before the checks that need none

        self.config, self.accelerator = config, accelerator
        self.cfg: CheckpointConfig = config.checkpoint
        self.place, self.directory, self.worker = place, place.checkpoints, place.worker
        self.snapshots, self.abandoned, self.prepared = Snapshots(), False, prepared
        self.background = BackgroundSaves(accelerator, self.cfg, self.worker, place.save_verb)
        self.saves, self.blocked_s, self.written_s = 0, 0.0, 0.0
        states = states or {}
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
        run's last files reach where the run lives, within checkpoint.upload_wait_s. After another error the pending
        save is abandoned: a peer may be gone, whose part a commit would wait for; this process's own write is let
        finish (ABANDON_WAIT_S at most: a process must not end inside it), and the newest committed checkpoint stays."""
        if kind is not None and not issubclass(kind, (Preempted, NonFiniteError)):
            self.abandoned = True
            self.worker.idle_within(ABANDON_WAIT_S)
            self.worker.close()
            return
        self.settle(at_end=True)
        self.place.drain(self.cfg.upload_wait_s)
        self.worker.close()
        if self.saves:
            note(logger, self.accelerator, f"checkpoints: {self.saves} saved; training blocked {self.blocked_s:.2f} s "
                                           f"by them, {self.place.save_verb} in {self.written_s:.2f} s in all")

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
                 f"{self.place.save_verb} and hold host memory for two copies of the state; training goes on and "
                 "the next save tries again")
            return None
        hooks.every().checkpoint_saving(progress)
        name = main_value(self._free_name(progress.step) if accelerator.is_main_process else None, accelerator)
        loop_state = {part_name: part.state_dict() for part_name, part in self.states.items()}
        partial = self.directory / f"{PARTIAL_PREFIX}{name}"
        with writing(partial, f"saving the checkpoint of step {progress.step}"):
            self.place.clear_unfinished(self.background.overdue_names(), accelerator.is_main_process)
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
        location = self.place.shown(self.directory / name)
        self.background.add(UnderWay(saved, name, job, location))
        self.saves, self.blocked_s = self.saves + 1, self.blocked_s + blocked
        return location

    def settle(self, bound_s: float | None = None, at_end: bool = False) -> None:
        """Wait (at most `bound_s`, else checkpoint.upload_wait_s) for the pending save, and say each save that
        ended: run/background_saves.py."""
        self.background.settle(bound_s, at_end)

    def _free_name(self, step: int) -> str:
        name, suffix = f"step-{step:08d}", 1
        taken = {folder.name for folder in self.place.unfinished_saves()}
        while (self.directory / name).exists() or name in taken:  # e.g. a timeline abandoned by resume=PATH
            name, suffix = f"step-{step:08d}-{suffix}", suffix + 1
        return name

    def _write_and_commit(self, progress: Progress, evaluated: bool, name: str, partial: Path,
                          snapshot: Snapshot | None, loop_state: dict, blocked: float) -> None:
        """In the background: this process's part written (from the snapshot) and put in place; then on the main
        process, once every process's part is there, the checkpoint committed and old ones pruned."""
        started, accelerator = time.perf_counter(), self.accelerator
        with writing(partial, f"saving the checkpoint of step {progress.step}"):
            if snapshot is not None:
                self.snapshots.write(snapshot, partial)
            write_synced(partial / LOOP_STATE_FILE.format(process=accelerator.process_index), json.dumps(loop_state))
            self.place.put_part(name, partial, accelerator.process_index)
        if not accelerator.is_main_process:
            return
        parts = self._wait_for_parts(name, partial, progress.step)
        with writing(partial, f"saving the checkpoint of step {progress.step}"):
            existing = list_checkpoints(self.directory)
            final = self.place.commit(name, partial, manifest(
                progress, evaluated, parts, existing[-1][1]["serial"] + 1 if existing else 1,
                self.accelerator.num_processes, self.config.to_dict()))
        written = time.perf_counter() - started
        self.written_s += written
        size_mb = sum(meta_size for meta_size in sizes(parts).values()) / 2**20
        logger.info(f"checkpoint step {progress.step} saved in {self.place.shown(final)}: blocked {blocked:.2f} s, "
                    f"{self.place.save_verb} in {written:.2f} s ({size_mb:.1f} MiB)")
        self._prune()

    def _wait_for_parts(self, name: str, partial: Path, step: int) -> dict[str, list]:
        """{file: [size, sha256]} of every process's part, once all are there (polled, at most
        checkpoint.upload_wait_s: no collective runs off the training thread)."""
        processes, deadline = self.accelerator.num_processes, time.monotonic() + self.cfg.upload_wait_s
        while missing := self.place.missing_parts(name, partial, processes):
            if self.abandoned:
                raise UserError(f"the checkpoint of step {step} was abandoned: training ended with an error")
            if time.monotonic() > deadline:
                raise UserError(f"the checkpoint of step {step}: process(es) {', '.join(map(str, missing))} did not "
                                f"write their part within {self.cfg.upload_wait_s:g} s (checkpoint.upload_wait_s)")
            time.sleep(0.05)
        return self.place.parts_written(name, partial, processes)

    def _prune(self) -> None:
        """Checkpoints beyond checkpoint.keep_last (and not the best): only committed ones of this run, each by the
        files its manifest lists."""
        cfg = self.cfg
        checkpoints = list_checkpoints(self.directory)
        keep = to_keep(checkpoints, cfg.keep_last, cfg.best_metric, cfg.best_mode)
        for folder, meta in checkpoints:
            if folder not in keep:
                self.place.remove(folder, meta)

    def resume(self, model: torch.nn.Module, steps_per_epoch: int, total_steps: int, named: Path | None) -> ResumePoint:
        """Load the checkpoint `resume` names (all processes; resume=PATH: `named`, the folder check_resume found;
        resume=auto: the newest loadable one), restore every part in place, and say where training continues."""
        config, accelerator, shown = self.config, self.accelerator, self.place.shown
        if not config.resume:
            return ResumePoint()
        if config.resume == "auto":
            candidates, damaged = list_checkpoints(self.directory), damaged_checkpoints(self.directory)
            for partial in self.place.unfinished_saves():
                warn(logger, accelerator, f"ignoring {shown(partial)}: a save that did not complete")
            for folder, why in damaged:
                warn(logger, accelerator, f"checkpoint {shown(folder)} is unusable ({why}); passed over")
            if not candidates and not damaged:
                note(logger, accelerator,
                     f"resume=auto: no checkpoint in {shown(self.directory)}; starting from step 0")
                return ResumePoint()
        else:  # check_resume made sure, before any data loaded, that it is a checkpoint of this run
            candidates = [(named, read_meta(named))]
        for folder, meta in reversed(candidates):
            if folder != candidates[-1][0]:  # the newest was checked before any data loaded (check_resume)
                refuse_other_identity(shown(folder), meta, config)
            trouble = self.place.fetch(accelerator, folder, meta)  # sizes and content, before anything is read
            if not any_process(trouble is not None, accelerator):  # every process loads, or none
                trouble, saved = load(folder, shown(folder), meta, config, accelerator, model, steps_per_epoch,
                                      self.tensor_parts, self.states)
                if not any_process(trouble is not None, accelerator):
                    break
            warn(logger, accelerator, f"checkpoint {shown(folder)} is unusable "
                                      f"({trouble or 'another process found it damaged'}); trying the previous one")
        else:
            where = shown(self.directory) if config.resume == "auto" else config.resume
            raise UserError(f"resume={config.resume}: no loadable checkpoint in {where}; set resume=null to start from "
                            "step 0")
        point = continue_from(folder, shown(folder), meta, config, accelerator, total_steps,
                              in_output_dir=folder.parent.resolve() == self.directory.resolve())
        for name, part in self.states.items():
            if saved.get(name) is not None:
                part.load_state_dict(saved[name])
        return point
