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

A checkpoint is written as `.partial-step-N` and renamed when complete, so a crash at any moment leaves the
previous checkpoints or the complete new one. Checkpoints are found and ordered by
their checkpoint.json, never by name.

The loop asks whether a step is to be saved (`due`: the manager decides) and calls `save`; `resume` restores the
parts and returns where training continues as a ResumePoint. Loading goes through `accelerator.load_state` with
`weights_only=True` (safetensors for the model): nothing in a checkpoint can run code when it is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from accel_train import hooks
from accel_train.config import SHARD_ORDER_KEYS, DataConfig, refuse_contradictions, spelled
from accel_train.console import say, warn
from accel_train.distributed.collectives import any_process, first_message
from accel_train.errors import UserError, writing
from accel_train.run.layout import (
    CHECKPOINT_META_FILE,
    LOOP_STATE_FILE,
    MODEL_FILE,
    checkpoints_dir,
    usual_permissions,
)
from accel_train.run.weights import shape_mismatch
from accel_train.state import Progress, ResumePoint

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from accel_train.config import CheckpointConfig, Config

FORMAT = 1
PARTIAL_PREFIX = ".partial-"


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


def resume_position(meta: dict) -> tuple[int, int]:
    """(epoch to continue, optimizer steps of it already taken) for a checkpoint's metadata: a checkpoint of an
    epoch's last step continues with the next epoch (that step's evaluation came before the save)."""
    epoch, done = meta["epoch"], meta["batches_done_in_epoch"]
    if done >= meta["steps_per_epoch"]:
        return epoch + 1, 0
    return epoch, done


class Checkpoints:
    """When to save (the loop asks), saving (collectively, on every process), pruning, and resuming `states`."""

    def __init__(self, config: Config, accelerator: Accelerator, states: dict[str, Stateful] | None = None) -> None:
        import torch

        self.config, self.accelerator = config, accelerator
        self.cfg: CheckpointConfig = config.checkpoint
        self.directory = checkpoints_dir(config.output_dir)
        states = states or {}
        for part in states.values():
            if isinstance(part, torch.nn.Module):  # before load_state: a resume restores it
                accelerator.register_for_checkpointing(part)
        self.states = {name: part for name, part in states.items() if not isinstance(part, torch.nn.Module)}

    def due(self, progress: Progress, last: bool) -> bool:
        """Whether the step just taken is saved: every checkpoint.every_steps optimizer steps, after each epoch's
        evaluation (checkpoint.at_epoch_end), and at the run's `last` step (its end, or early stopping) when saving
        is on at all."""
        every = bool(self.cfg.every_steps) and progress.step % self.cfg.every_steps == 0
        saving = self.cfg.at_epoch_end or bool(self.cfg.every_steps)
        return every or (progress.at_epoch_end and self.cfg.at_epoch_end) or (last and saving)

    def save(self, progress: Progress, evaluated: bool) -> Path:
        """Every process writes its part; the main process publishes the folder once all have. `evaluated`: after
        the step's evaluation (its metrics go into checkpoint.json)."""
        hooks.every().checkpoint_saving(progress)
        accelerator, name = self.accelerator, f"step-{progress.step:08d}"
        loop_state = {part_name: part.state_dict() for part_name, part in self.states.items()}
        partial = self.directory / f"{PARTIAL_PREFIX}{name}"
        with writing(partial, f"saving the checkpoint of step {progress.step}"):
            if accelerator.is_main_process:
                self.directory.mkdir(parents=True, exist_ok=True)
                for stale in self.directory.glob(f"{PARTIAL_PREFIX}*"):  # left by a save that a crash cut short
                    shutil.rmtree(stale, ignore_errors=True)
            accelerator.wait_for_everyone()
            started = time.perf_counter()
            accelerator.save_state(str(partial))
            _write_synced(partial / LOOP_STATE_FILE.format(process=accelerator.process_index), json.dumps(loop_state))
            # Every process has written its own files before the folder can become visible as complete.
            accelerator.wait_for_everyone()
            final = self.directory / name
            if accelerator.is_main_process:
                final = self._publish(progress, evaluated, partial, name, time.perf_counter() - started)
                self._prune()
        accelerator.wait_for_everyone()
        hooks.every().checkpoint_saved(progress, final)
        return final

    def _publish(self, progress: Progress, evaluated: bool, partial: Path, name: str, seconds: float) -> Path:
        fsync_started = time.perf_counter()
        existing = list_checkpoints(self.directory)
        files = {str(path.relative_to(partial)): path.stat().st_size for path in sorted(partial.rglob("*"))
                 if path.is_file()}
        usual_permissions(*(partial / relative for relative in files))
        for relative in files:  # durable before the rename publishes them
            _fsync(partial / relative)
        seconds += time.perf_counter() - fsync_started
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
            "save_seconds": round(seconds, 3),
            "files": files,
            "config": self.config.to_dict(),
        }
        _write_synced(partial / CHECKPOINT_META_FILE, json.dumps(meta, indent=1))
        final = self.directory / name
        suffix = 1
        while final.exists():  # same step saved before, e.g. in a timeline abandoned by resume=PATH
            final, suffix = self.directory / f"{name}-{suffix}", suffix + 1
        os.replace(partial, final)
        _fsync(self.directory)
        size_mb = sum(files.values()) / 2**20
        say(f"checkpoint step {progress.step} saved in {final} ({size_mb:.1f} MiB, {seconds:.2f} s)")
        return final

    def _prune(self) -> None:
        cfg = self.cfg
        checkpoints = list_checkpoints(self.directory)
        keep = to_keep(checkpoints, cfg.keep_last, cfg.best_metric, cfg.best_mode)
        for folder, _ in checkpoints:
            if folder not in keep:
                shutil.rmtree(folder, ignore_errors=True)

    def resume(self, model: torch.nn.Module, steps_per_epoch: int, total_steps: int) -> ResumePoint:
        """Load the checkpoint `resume` names (all processes), restore every part in place, and say where training
        continues."""
        config, accelerator, directory = self.config, self.accelerator, self.directory
        if not config.resume:
            return ResumePoint()
        if config.resume == "auto":
            candidates = list_checkpoints(directory)
            for partial in sorted(directory.glob(f"{PARTIAL_PREFIX}*")) if directory.is_dir() else []:
                warn(accelerator, f"ignoring {partial}: a save that did not complete")
            if not candidates:
                accelerator.print(f"resume=auto: no checkpoint in {directory}; starting from step 0")
                return ResumePoint()
        else:  # check_resume made sure, before any data loaded, that it is a checkpoint of this run
            candidates = [(Path(config.resume), read_meta(Path(config.resume)))]
        for folder, meta in reversed(candidates):
            if folder != candidates[-1][0]:  # the newest was checked before any data loaded (check_resume)
                _refuse_other_identity(folder, meta, config)
            _refuse_what_cannot_continue(folder, meta, config, accelerator, model, steps_per_epoch)
            trouble, error = _damage(folder, meta), None
            if trouble is None:
                trouble, error = _load(accelerator, folder)
            error = first_message(error, accelerator)
            if error:  # not damage: an older checkpoint would fail the same way, and this one is probably good
                raise UserError(f"resume: cannot load {folder}, whose files are whole: {error}; this is not damage "
                                "in the checkpoint but a library that differs from what accel-train expects (see "
                                "accel-train --version) or a bug; the checkpoint is left as it is")
            if not any_process(trouble is not None, accelerator):
                break
            warn(accelerator, f"checkpoint {folder} is unusable ({trouble or 'another process could not load it'}); "
                              "trying the previous one")
        else:
            where = directory if config.resume == "auto" else config.resume
            raise UserError(f"resume={config.resume}: no loadable checkpoint in {where}; set resume=null to start from "
                            "step 0")
        _note_schedule_changes(folder, meta, config, accelerator)
        epoch, done = resume_position(meta)
        accelerator.print(f"resuming from {folder}: step {meta['step']}, epoch {epoch}, {done} batches of it done")
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


def check_resume(config: Config) -> None:
    """Before any data is loaded: `resume=PATH` is a checkpoint, and the checkpoint to resume is this run's."""
    if config.resume is None:
        return
    if config.resume == "auto":
        found = list_checkpoints(checkpoints_dir(config.output_dir))
        if found:
            _refuse_other_identity(*found[-1], config)
        return
    meta = read_meta(Path(config.resume))
    if meta is None:
        raise UserError(f"resume={config.resume}: not a checkpoint (no readable {CHECKPOINT_META_FILE}); pass a folder "
                        f"under OUTPUT_DIR/checkpoints/, or resume=auto")
    _refuse_other_identity(Path(config.resume), meta, config)
    own = checkpoints_dir(config.output_dir)
    if Path(config.resume).resolve().parent != own.resolve():
        raise UserError(f"resume={config.resume} is a checkpoint of another folder than "
                        f"output_dir={config.output_dir}: resume continues output_dir's own run (resume=auto, or one "
                        f"of {own}/step-N); to start a new run from its weights, give "
                        f"model.init_from={config.resume} instead")


def _refuse_other_identity(folder: Path, meta: dict, config: Config) -> None:
    refuse_contradictions(meta["config"], config, f"resume: {folder} is from another run",
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


def _refuse_what_cannot_continue(folder: Path, meta: dict, config: Config, accelerator: Accelerator,
                                 model: torch.nn.Module, steps_per_epoch: int) -> None:
    """A checkpoint whose tensors or steps per epoch this run cannot continue from (any world size can: the
    global batch, and so the steps per epoch, are the same at every world size that divides it)."""
    mismatch = shape_mismatch(folder / MODEL_FILE, accelerator.unwrap_model(model))
    if mismatch:
        raise UserError(f"resume: {folder} does not fit model.name={config.model.name} on {config.data.name}: "
                        f"{mismatch}; use another output_dir or resume=null")
    if meta["steps_per_epoch"] != steps_per_epoch:
        raise UserError(f"resume: {folder} has {meta['steps_per_epoch']} steps per epoch, this run "
                        f"{steps_per_epoch}; train.batch_size or data.train_subset changed since it was saved")
    if config.data.name == "shards":  # the order over shards is a function of these too: a resumed epoch must see it
        saved_data = meta["config"].get("data") or {}
        for key in SHARD_ORDER_KEYS:
            saved, now = saved_data.get(key, getattr(DataConfig(), key)), getattr(config.data, key)
            if saved != now:
                raise UserError(f"resume: {folder} was trained with data.{key}={saved}, this run has data.{key}={now}: "
                                "the order of the samples over the shards depends on it, so the resumed epoch would "
                                "repeat some samples and skip others; set it back, or start a new run "
                                "(model.init_from takes the weights)")
    saved_ema = (meta["config"].get("train") or {}).get("ema_decay")
    if bool(saved_ema) != bool(config.train.ema_decay):  # the EMA is a part of the checkpoint, saved or not
        raise UserError(f"resume: {folder} was saved with train.ema_decay={spelled(saved_ema)}, this run has "
                        f"train.ema_decay={spelled(config.train.ema_decay)}: an EMA of the weights is saved and "
                        "restored with the checkpoint, so it cannot be added or dropped on the way; set it as the "
                        "checkpoint had it, or start a new run (model.init_from takes the weights)")


def _reseed_processes(seed: int, step: int, accelerator: Accelerator) -> None:
    """After loading a checkpoint of another world size: each process's own random streams (dropout) anew from
    (seed, process, step), since the saved streams were those of other processes."""
    from accelerate.utils import set_seed

    digest = hashlib.sha256(f"{seed}:{accelerator.process_index}:{step}".encode()).digest()
    set_seed(int.from_bytes(digest[:4], "little"))


def _note_schedule_changes(folder: Path, meta: dict, config: Config, accelerator: Accelerator) -> None:
    """The scheduler's state (LRFactor's settings, base LRs) loads with the checkpoint, so say what it overrides."""
    saved, ours = meta["config"]["train"], config.to_dict()["train"]
    keys = ["lr", "schedule", "lr_gamma", "lr_step_epochs", "warmup_steps"]
    if ours["schedule"] == "cosine":  # the only schedule whose shape depends on the run's length
        keys += ["epochs", "max_steps"]
    changed = [f"train.{key} {saved.get(key)} -> {ours[key]}" for key in keys if saved.get(key) != ours[key]]
    if changed:
        warn(accelerator, f"resuming {folder}: the LR schedule continues as saved there, ignoring "
                           f"{', '.join(changed)}")


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
