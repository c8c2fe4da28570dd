"""A checkpoint as files: the folder `accelerator.save_state` writes, the parts accel-train writes itself, and
checkpoint.json, which describes them (each file's size and sha256); found and ordered by that file (never by name);
which of them retention keeps; and the fsync helpers a commit uses."""

from __future__ import annotations

import json
import os
from pathlib import Path

from accel_train.run.layout import CHECKPOINT_META_FILE

FORMAT = 1
PARTIAL_PREFIX = ".partial-"
PART_DONE = ".part-{process}.json"  # a process's part of a checkpoint is complete (in a store: its files' hashes)
# A stateful part with tensors (the EMA of the weights): written by accel-train as safetensors, read back without
# unpickling anything. Checkpoints written before kept it where Accelerate's register_for_checkpointing does, as a
# pickle that Accelerate always loads with weights_only=False; those are read with weights_only=True.
TENSOR_PART = "{name}.safetensors"
ACCELERATE_CUSTOM = "custom_checkpoint_{index}.pkl"


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
