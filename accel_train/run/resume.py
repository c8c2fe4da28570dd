"""What to resume and whether it fits: `resume=` checked before any data loads, a checkpoint refused in one line
when this run cannot continue from it (another run, other tensors, steps per epoch, shard order or EMA), each file
checked against its manifest (size and sha256) before any is read, loaded with `weights_only` or from safetensors
(nothing in a checkpoint runs code when read), told apart from damage, and each part's saved state read back,
merged across world sizes where the saved processes' states differ."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from accel_train.config import SHARD_ORDER_KEYS, DataConfig, refuse_contradictions, spelled
from accel_train.console import note, warn
from accel_train.distributed.collectives import first_message
from accel_train.errors import UserError, refused_call
from accel_train.run.checkpoint_files import ACCELERATE_CUSTOM, list_checkpoints, load_tensor_parts, meta_or_damage
from accel_train.run.layout import CHECKPOINTS_DIR, LOOP_STATE_FILE, MODEL_FILE, checkpoints_dir
from accel_train.run.weights import shape_mismatch
from accel_train.state import ResumePoint
from accel_train.storage import is_remote, join

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from accel_train.config import Config
    from accel_train.run.place import RunPlace


def load(folder: Path, shown: str, meta: dict, config: Config, accelerator: Accelerator, model: torch.nn.Module,
         steps_per_epoch: int, tensor_parts: dict, states: dict) -> tuple[str | None, dict | None]:
    """A checkpoint whose files are whole, loaded on every process: refused in one line when this run cannot continue
    from it, raised when it does not load for another reason than damage (an older checkpoint would fail the same
    way). (what is damaged, None), or (None, this process's saved `states` by name)."""
    refuse_what_cannot_continue(folder, shown, meta, config, accelerator, model, steps_per_epoch)
    trouble, error = load_checkpoint(accelerator, folder, meta, tensor_parts)
    saved = None
    if trouble is None and error is None:
        trouble, saved = saved_states(folder, meta, accelerator, states)
    error = first_message(error, accelerator)
    if error:  # not damage: an older checkpoint would fail the same way, and this one is probably good
        raise UserError(f"resume: cannot load {shown}, whose files are whole: {error}; the checkpoint is left as it "
                        "is")
    return trouble, saved


def saved_states(folder: Path, meta: dict, accelerator: Accelerator, states: dict) -> tuple[str | None, dict | None]:
    """(what is damaged, None) or (None, this process's saved parts by name): its own loop state, or at another
    world size the saved processes' merged."""
    try:
        if meta["world_size"] == accelerator.num_processes:
            return None, read_loop_state(folder, accelerator.process_index, meta)
        return None, merged_loop_states(states, folder, meta)
    except (OSError, ValueError, TypeError, KeyError) as err:  # JSONDecodeError, UnicodeDecodeError: ValueError
        return f"a loop state does not read ({type(err).__name__}: {str(err).splitlines()[0][:200]})", None


def continue_from(folder: Path, shown: str, meta: dict, config: Config, accelerator: Accelerator, total_steps: int,
                  in_output_dir: bool) -> ResumePoint:
    """Where training continues from the checkpoint just loaded, said; Accelerate's count of micro-batches started
    over, and at another world size each process's random streams reseeded."""
    note_schedule_changes(shown, meta, config, accelerator)
    epoch, done = resume_position(meta)
    note(logger, accelerator, f"resuming from {shown}: step {meta['step']}, epoch {epoch}, {done} batches of it done")
    if meta["step"] >= total_steps:
        note(logger, accelerator, f"the checkpoint already has {meta['step']} of {total_steps} steps: nothing left to "
                                  "train")
        epoch, done = config.train.epochs, 0
    # Accelerate's count of micro-batches, loaded with the RNG state, was made with the saved run's accumulation
    # steps (and is missing for a process that run did not have); a checkpoint is at an optimizer step, where
    # the count starts over.
    accelerator.step = 0
    if meta["world_size"] != accelerator.num_processes:
        reseed_processes(config.seed, meta["step"], accelerator)
    return ResumePoint(step=meta["step"], epoch=epoch, steps_done_in_epoch=done, evaluated=meta["evaluated"],
                       in_output_dir=in_output_dir, saved_world_size=meta["world_size"])


def resume_position(meta: dict) -> tuple[int, int]:
    """(epoch to continue, optimizer steps of it already taken) for a checkpoint's metadata: a checkpoint of an
    epoch's last step continues with the next epoch (that step's evaluation came before the save)."""
    epoch, done = meta["epoch"], meta["batches_done_in_epoch"]
    if done >= meta["steps_per_epoch"]:
        return epoch + 1, 0
    return epoch, done


def check_resume(config: Config, place: RunPlace) -> Path | None:
    """Before any data is loaded: `resume=PATH` is a checkpoint, and the checkpoint to resume is this run's. Returns
    the checkpoint folder resume=PATH names (the run resumes from it as found here); None for resume=auto, whose
    newest loadable checkpoint the run finds when it starts, and without resume."""
    if config.resume is None:
        return None
    own = checkpoints_dir(place.folder)
    if config.resume == "auto":
        found = list_checkpoints(own)
        if found:
            refuse_other_identity(place.shown(found[-1][0]), found[-1][1], config)
        return None
    folder = resume_folder(config, place)
    meta, damage = meta_or_damage(folder)
    if meta is None:
        raise UserError(f"resume={config.resume}: not a checkpoint ({damage}); pass a folder under "
                        "OUTPUT_DIR/checkpoints/, or resume=auto")
    refuse_other_identity(place.shown(folder), meta, config)
    if folder.resolve().parent != own.resolve():
        raise UserError(f"resume={config.resume} is a checkpoint of another folder than "
                        f"output_dir={config.output_dir}: resume continues output_dir's own run (resume=auto, or one "
                        f"of {join(config.output_dir, CHECKPOINTS_DIR)}/step-N); to start a new run from its weights, "
                        f"give model.init_from={config.resume} instead")
    return folder


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


def refuse_other_identity(shown: str, meta: dict, config: Config) -> None:
    """`shown`: the checkpoint as the user knows it (its URL for a run folder in a store)."""
    refuse_contradictions(meta["config"], config, f"resume: {shown} is from another run",
                          "use another output_dir or resume=null")


def read_loop_state(folder: Path, process: int, meta: dict) -> dict:
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


def refuse_what_cannot_continue(folder: Path, shown: str, meta: dict, config: Config, accelerator: Accelerator,
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


def reseed_processes(seed: int, step: int, accelerator: Accelerator) -> None:
    """After loading a checkpoint of another world size: each process's own random streams (dropout) anew from
    (seed, process, step), since the saved streams were those of other processes."""
    from accelerate.utils import set_seed

    digest = hashlib.sha256(f"{seed}:{accelerator.process_index}:{step}".encode()).digest()
    set_seed(int.from_bytes(digest[:4], "little"))


def note_schedule_changes(shown: str, meta: dict, config: Config, accelerator: Accelerator) -> None:
    """The scheduler's state (LRFactor's settings, base LRs) loads with the checkpoint, so say what it overrides."""
    saved, ours = meta["config"]["train"], config.to_dict()["train"]
    keys = ["lr", "schedule", "lr_gamma", "lr_step_epochs", "warmup_steps"]
    if ours["schedule"] == "cosine":  # the only schedule whose shape depends on the run's length
        keys += ["epochs", "max_steps"]
    changed = [f"train.{key} {saved.get(key)} -> {ours[key]}" for key in keys if saved.get(key) != ours[key]]
    if changed:
        warn(logger, accelerator, f"resuming {shown}: the LR schedule continues as saved there, ignoring "
                                   f"{', '.join(changed)}")


class Damaged(Exception):
    """A checkpoint file that reads, but not as what accel-train wrote there."""


RANDOM_STATES = ("random_state", "numpy_random_seed", "torch_manual_seed")  # what Accelerate restores on any device


def check_random_states(folder: Path, process: int, meta: dict) -> None:
    """This process's saved random states read as Accelerate reads them (weights_only): Accelerate's load_state
    swallows a file that fails to load (a line at info level) and the resume goes on, no longer exact. A process
    the saved run did not have has none, and is reseeded (reseed_processes)."""
    from accelerate.utils import RNG_STATE_NAME
    from accelerate.utils import load as accelerate_load

    if process >= meta["world_size"]:
        return
    name = f"{RNG_STATE_NAME}_{process}.pkl"
    try:
        states = accelerate_load(folder / name)
    except Exception as err:
        if is_damage(err) or "GLOBAL" in str(err) or isinstance(err, (PermissionError, ImportError)):
            raise
        # bytes that are no zip fall to torch's legacy unpickler, whose garbage errors are any kind (IndexError...)
        raise Damaged(f"{name} does not load ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
                      ) from err
    if not isinstance(states, dict) or any(key not in states for key in RANDOM_STATES):
        raise Damaged(f"{name} holds no random states")


def load_checkpoint(accelerator: Accelerator, folder: Path, meta: dict,
                    tensor_parts: dict | None = None) -> tuple[str | None, str | None]:
    """Load a checkpoint, and the parts accel-train wrote itself (`tensor_parts`, by name): (what is damaged, None),
    or (None, an error that is not damage), or (None, None). Nothing is unpickled but with weights_only."""
    try:
        check_random_states(folder, accelerator.process_index, meta)
        with without_accelerate_custom_objects(folder) as readable:
            # weights_only: the optimizer, scheduler and RNG files are pickles; only tensors and plain data may load.
            accelerator.load_state(str(readable), load_kwargs={"weights_only": True})
        load_tensor_parts(folder, tensor_parts or {})
    except Exception as err:
        refused = refused_call(err)
        if refused:  # whole, and naming a function: what a library that differs writes, or someone else
            return None, (f"a file holds a call to {refused}, which loading with weights_only refuses; "
                          "nothing in it was run (accel-train's own checkpoints hold no such call: a library that "
                          "differs wrote it, or someone else did)")
        text = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return (text, None) if is_damage(err) else (None, f"{text}; this is not damage in the checkpoint but a "
                                                          "library that differs from what accel-train expects (see "
                                                          "accel-train --version) or a bug")
    return None, None


@contextmanager
def without_accelerate_custom_objects(folder: Path):
    """`folder`, or where a checkpoint of an earlier version holds Accelerate's custom_checkpoint_I.pkl (which
    load_state would unpickle with weights_only=False, or refuse when nothing is registered), a folder of links to
    its other files: load_tensor_parts reads those with weights_only=True."""
    if not any(folder.glob(ACCELERATE_CUSTOM.format(index="*"))):
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="accel-train-resume-") as links:
        for path in folder.iterdir():
            if not re.fullmatch(ACCELERATE_CUSTOM.format(index=r"\d+").replace(".", r"\."), path.name):
                (Path(links) / path.name).symlink_to(path.resolve())
        yield Path(links)


def is_damage(err: Exception) -> bool:
    """Whether a load error means a file's bytes do not decode, rather than an API or a class that differs."""
    from safetensors import SafetensorError

    if isinstance(err, PermissionError):  # a file we may not read is whole: say so rather than skip it
        return False
    if isinstance(err, (SafetensorError, EOFError, OSError, Damaged)):
        return True
    if isinstance(err, pickle.UnpicklingError):  # torch's weights-only unpickler: garbage, or a class it refuses
        return "Unsupported global" not in str(err)
    return isinstance(err, RuntimeError) and "PytorchStreamReader" in str(err)  # torch's zip reader


def merged_loop_states(states: dict, folder: Path, meta: dict) -> dict:
    """Each part's state for this process from a checkpoint of another world size: a part whose state differs per
    process (the train meter's partial sums) merges the saved processes' states (`merge_states`); any other part is
    the same on every process, and process 0's is taken."""
    saved = [read_loop_state(folder, process, meta) for process in range(meta["world_size"])]
    merged = {}
    for name, part in states.items():
        states_saved = [state.get(name) for state in saved]
        if any(state is None for state in states_saved):
            continue
        merge = getattr(part, "merge_states", None)
        merged[name] = merge(states_saved) if merge is not None else states_saved[0]
    return merged
