"""A checkpoint as files: the folder `accelerator.save_state` writes, the parts accel-train writes itself, and
checkpoint.json, which describes them (each file's size and sha256); found and ordered by that file (never by name);
which of them retention keeps; whether they are still as written; and the fsync helpers a commit uses."""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from accel_train.run.layout import CHECKPOINT_META_FILE

if TYPE_CHECKING:
    from accel_train.state import Progress

FORMAT = 1
PARTIAL_PREFIX = ".partial-"
PART_DONE = ".part-{process}.json"  # a process's part of a checkpoint is complete (in a store: its files' hashes)
# A stateful part with tensors (the EMA of the weights): written by accel-train as safetensors, read back without
# unpickling anything. Checkpoints written before kept it where Accelerate's register_for_checkpointing does, as a
# pickle that Accelerate always loads with weights_only=False; those are read with weights_only=True.
TENSOR_PART = "{name}.safetensors"
ACCELERATE_CUSTOM = "custom_checkpoint_{index}.pkl"


# What every reader of checkpoint.json counts on, by type: a manifest without one of them is damaged.
META_KEYS = {"serial": int, "step": int, "epoch": int, "batches_done_in_epoch": int, "steps_per_epoch": int,
             "evaluated": bool, "metrics": dict, "world_size": int, "files": dict, "config": dict}


def read_meta(folder: Path) -> dict | None:
    return meta_or_damage(folder)[0]


def meta_or_damage(folder: Path) -> tuple[dict | None, str | None]:
    """(checkpoint.json's contents, None), or (None, what is wrong with it: missing, not JSON, without a key every
    reader counts on, or of a format this version does not write)."""
    try:
        meta = json.loads((folder / CHECKPOINT_META_FILE).read_text())
    except FileNotFoundError:
        return None, f"it has no {CHECKPOINT_META_FILE}"
    except (OSError, ValueError) as err:  # JSONDecodeError, UnicodeDecodeError: ValueError
        return None, f"its {CHECKPOINT_META_FILE} does not read: {type(err).__name__}: {str(err).splitlines()[0]}"
    if not isinstance(meta, dict):
        return None, f"its {CHECKPOINT_META_FILE} holds no mapping"
    if meta.get("format") != FORMAT:
        return None, (f"its {CHECKPOINT_META_FILE} is of format {meta.get('format')}, not {FORMAT}: written by "
                      "another version of accel-train, or damaged")
    wrong = next((key for key, kind in META_KEYS.items() if not isinstance(meta.get(key), kind)), None)
    if wrong is not None:
        return None, f"its {CHECKPOINT_META_FILE} has no {META_KEYS[wrong].__name__} {wrong}"
    return meta, None


def manifest(progress: Progress, evaluated: bool, parts: dict[str, list], serial: int, world_size: int,
             config: dict) -> str:
    """checkpoint.json: where training continues from the checkpoint, the files it holds ({file: [size, sha256]} in
    `parts`), the resolved config; `serial` orders it after every checkpoint before."""
    return json.dumps({
        "format": FORMAT,
        "serial": serial,
        "step": progress.step,
        "epoch": progress.epoch,
        "batches_done_in_epoch": progress.batches_done_in_epoch(),
        "steps_per_epoch": progress.steps_per_epoch,
        "evaluated": evaluated,
        "metrics": dict(progress.last_eval) if evaluated else {},
        "world_size": world_size,
        "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "files": sizes(parts),
        "sha256": {file: part[1] for file, part in parts.items()},  # checked before anything is loaded
        "config": config,
    }, indent=1)


def list_checkpoints(directory: Path) -> list[tuple[Path, dict]]:
    """Checkpoints whose metadata reads, oldest save first. Partial folders have none and are never listed."""
    found = [(folder, meta) for folder, meta, _ in _checkpoint_folders(directory) if meta is not None]
    return sorted(found, key=lambda item: item[1]["serial"])


def damaged_checkpoints(directory: Path) -> list[tuple[Path, str]]:
    """The committed checkpoints (folders a save renamed into place) whose checkpoint.json does not read, with what
    is wrong with it: never listed, so a resume passes over them, saying so."""
    return sorted((folder, why) for folder, meta, why in _checkpoint_folders(directory) if meta is None)


def _checkpoint_folders(directory: Path) -> list[tuple[Path, dict | None, str | None]]:
    """(folder, metadata or None, what is wrong with it) of each folder a save renamed into place (a save in progress
    is a .partial- folder)."""
    if not directory.is_dir():
        return []
    return [(folder, *meta_or_damage(folder)) for folder in directory.iterdir()
            if folder.is_dir() and not folder.name.startswith(".")]


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


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def damage(folder: Path, meta: dict, content: bool = True) -> str | None:
    """What is wrong with a checkpoint's files before any is read: a file missing, of another size, or (`content`)
    whose sha256 is not the one its manifest records (checkpoints written before hashes were recorded locally: sizes
    only); None when they are as written."""
    hashes = meta.get("sha256") or {}
    for name, size in meta["files"].items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written"
        if content and hashes.get(name) and sha256_of(path) != hashes[name]:
            return f"{name} is not the file that was written (its sha256 differs from the manifest's)"
    return None


def sizes(parts: dict[str, list]) -> dict[str, int]:
    return {file: part[0] for file, part in parts.items()}


def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_tensor_part(state: dict, path: Path) -> None:
    """A part's state_dict (tensors only) as safetensors, from copies: safetensors refuses tensors that share memory."""
    from accelerate.utils import save

    save({key: value.detach().to("cpu", copy=True).contiguous() for key, value in state.items()}, path,
         safe_serialization=True)


def load_tensor_parts(folder: Path, parts: dict) -> None:
    """Each part's state from `folder` into the part: NAME.safetensors, else (an older checkpoint) Accelerate's
    custom_checkpoint_I.pkl, numbered in the order the parts were registered, read with weights_only=True."""
    import torch
    from safetensors.torch import load_file

    for index, (name, part) in enumerate(parts.items()):
        path = folder / TENSOR_PART.format(name=name)
        if path.is_file() or not (folder / ACCELERATE_CUSTOM.format(index=index)).is_file():
            state = load_file(path)
        else:
            state = torch.load(folder / ACCELERATE_CUSTOM.format(index=index), map_location="cpu", weights_only=True)
        part.load_state_dict(state)
