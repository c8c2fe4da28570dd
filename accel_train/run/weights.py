"""Exported weights: one reader and one atomic export for the model, its EMA and the best model.

Every export goes through Accelerate's save_model (which gathers FSDP shards, so every process calls it) into a
staging folder beside the target, takes the run folder's permissions once, and is renamed into place: a reader
never sees half a file, and a crash leaves the previous export whole.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from accel_train.config import CONFIG_FILE
from accel_train.errors import DataNotFoundError, UnreadableFileError, UserError, writing
from accel_train.run.layout import (
    CHECKPOINT_META_FILE,
    CHECKPOINTS_DIR,
    CLASSES_FILE,
    MODEL_FILE,
    read_classes,
    usual_permissions,
)

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator


def export(accelerator: Accelerator, model: torch.nn.Module, path: Path) -> None:
    """`model`'s weights as `path` (a .safetensors file), on every process. A model that Accelerate shards (over
    10 GB) keeps its shard and index names beside `path`."""
    staging = path.parent / f".{path.stem}"
    with writing(path, f"exporting {path.name}"):
        accelerator.save_model(model, str(staging))
        # save_model lists the folder on every process: none may still be in it when the main one removes it.
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            files = sorted(file for file in staging.iterdir() if file.is_file())
            usual_permissions(*files)
            for file in files:
                os.replace(file, path if file.name == MODEL_FILE else path.parent / file.name)
            shutil.rmtree(staging, ignore_errors=True)
        accelerator.wait_for_everyone()  # on every process, the file is in place once export returns


def weights_file(checkpoint: str, key: str = "checkpoint") -> Path:
    """The model.safetensors of a run folder, of a checkpoint folder, or the file itself, local or at a URL (copied
    into the read cache); `key` is the setting that named it, for the line that says it is not there."""
    from accel_train.run.read_cache import readable_weights

    weights = readable_weights(checkpoint, key)
    if weights.is_dir():
        weights = weights / MODEL_FILE
    if not weights.is_file():
        raise DataNotFoundError(f"{key}={checkpoint}: no {MODEL_FILE} there; pass the output_dir of a run, "
                                "a checkpoint folder or the file")
    _refuse_other_content(weights, f"{key}={checkpoint}")
    return weights


def _refuse_other_content(weights: Path, named: str) -> None:
    """A checkpoint's weights whose sha256 is not the one its checkpoint.json records, or which its damaged
    checkpoint.json cannot vouch for: one line, before any read."""
    from accel_train.run.checkpoint_files import meta_or_damage, sha256_of

    folder = weights.parent
    if not ((folder / CHECKPOINT_META_FILE).exists() or folder.parent.name == CHECKPOINTS_DIR
            and (folder.parent.parent / CONFIG_FILE).is_file()):
        return  # not a checkpoint: a run folder's exported weights, or a file of the user's
    meta, damage = meta_or_damage(folder)
    if meta is None:
        raise UnreadableFileError(f"{named}: {folder} is a checkpoint whose {weights.name} cannot be checked: "
                                  f"{damage}; use another checkpoint of the run")
    recorded = (meta.get("sha256") or {}).get(weights.name)
    if recorded and sha256_of(weights) != recorded:
        raise UnreadableFileError(f"{named}: {weights.name} is not the file that was written (its sha256 differs from "
                                  f"{weights.parent / 'checkpoint.json'}): damaged or replaced; use another checkpoint "
                                  "of the run")


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or one line saying the file is damaged."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as err:  # safetensors' own error for a bad header, OSError for a short read
        raise UnreadableFileError(f"{path} is not a readable safetensors file ({str(err).splitlines()[0]}); it may "
                                  "be truncated or damaged: train again, or evaluate a checkpoint under "
                                  "OUTPUT_DIR/checkpoints/") from None


def load_weights(model: torch.nn.Module, state: dict, checkpoint: str, described: str,
                 key: str = "checkpoint") -> torch.nn.Module:
    """`model` with the tensors of `state`, or one line saying that the weights at `checkpoint` (named by `key`) do
    not fit the model `described` (e.g. "model.name=resnet18 on cifar10")."""
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        detail = str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
        raise UserError(f"{key}={checkpoint} does not fit {described}: {detail}") from None
    return model


def initial_weights(model: torch.nn.Module, weights: Path, source: str, described: str) -> torch.nn.Module:
    """model.init_from=`source`: `model` with the weights of an earlier run (its model.safetensors), one of its
    checkpoints or a .safetensors file, `weights` as weights_file found it; a new run starts from them. Tensors of
    other names or shapes: one line naming the first."""
    mismatch = shape_mismatch(weights, model)
    if mismatch:
        raise UserError(f"model.init_from={source} does not fit {described}: {mismatch}; start from weights of the "
                        "same model.name and data shape")
    return load_weights(model, read_weights(weights), source, described, key="model.init_from")


def shape_mismatch(weights: Path, model: torch.nn.Module) -> str | None:
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


def class_names(checkpoint: str, num_classes: int | None) -> list[str]:
    """classes.json of the run the weights at `checkpoint` belong to; where its data named no classes (a dataset
    without `classes`), their indices, 0 to data.num_classes - 1."""
    classes = read_classes(checkpoint)
    if classes is not None:
        return classes
    if num_classes:
        return [str(index) for index in range(num_classes)]
    raise DataNotFoundError(f"checkpoint={checkpoint}: no {CLASSES_FILE} in its run folder and no data.num_classes; "
                            "predict names each label by the class names training writes there, or by its index "
                            "up to data.num_classes: set data.num_classes")
