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

from accel_train.errors import DataNotFoundError, UnreadableFileError, UserError, writing
from accel_train.run.layout import CLASSES_FILE, MODEL_FILE, read_classes, usual_permissions

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


def weights_file(checkpoint: str) -> Path:
    """The model.safetensors of a run folder, of a checkpoint folder, or the file itself."""
    weights = Path(checkpoint)
    if weights.is_dir():
        weights = weights / MODEL_FILE
    if not weights.is_file():
        raise DataNotFoundError(f"checkpoint={checkpoint}: no {MODEL_FILE} there; pass the output_dir of a run, "
                                "a checkpoint folder or the file")
    return weights


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or one line saying the file is damaged."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as err:  # safetensors' own error for a bad header, OSError for a short read
        raise UnreadableFileError(f"{path} is not a readable safetensors file ({str(err).splitlines()[0]}); it may "
                                  "be truncated or damaged: train again, or evaluate a checkpoint under "
                                  "OUTPUT_DIR/checkpoints/") from None


def load_weights(model: torch.nn.Module, state: dict, checkpoint: str, described: str) -> torch.nn.Module:
    """`model` with the tensors of `state`, or one line saying that the weights at `checkpoint` do not fit the
    model `described` (e.g. "model.name=resnet18 on cifar10")."""
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        detail = str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
        raise UserError(f"checkpoint={checkpoint} does not fit {described}: {detail}") from None
    return model


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
