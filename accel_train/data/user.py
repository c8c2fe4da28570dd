"""A user's own Dataset: by import path in a recipe (data.name: my_data:build), or an object given to
accel_train.train; checked where it is called, and described (classes, input shape) for the task."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import Subset

from accel_train.config import DataConfig
from accel_train.data.registry import Data
from accel_train.errors import UserError
from accel_train.import_paths import building, check_call, import_object, is_import_path


def user_function(cfg: DataConfig) -> Callable | None:
    """The function data.name names as an import path, imported and checked to take train= and data.args (once: a
    run calls it for each split); None for any other name."""
    if not is_import_path(cfg.name):
        return None
    factory = import_object(cfg.name, "data.name")
    check_call(factory, "data.name", cfg.name, "data.args", {"train": True}, cfg.args)
    return factory


def user_dataset(cfg: DataConfig, train: bool, function: Callable) -> Data:
    """The dataset `function` (data.name's, as user_function found it) returns, called with train= and data.args."""
    with building(f"data.name={cfg.name}", data=True):
        dataset = function(**{"train": train, **cfg.args})  # as checked: data.args after train=
    return from_dataset(dataset, cfg, train, f"data.name={cfg.name}")


def from_dataset(dataset, cfg: DataConfig, train: bool, where: str) -> Data:
    """A user's Dataset (by import path, or an object given to accel_train.train) with its classes and input shape;
    data.train_subset / data.eval_subset apply. It is served by a DataLoader (workers, pinned memory)."""
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise UserError(f"{where}: found {type(dataset).__name__}, expected a torch Dataset (__getitem__ and __len__)")
    classes = getattr(dataset, "classes", None)
    classes = [str(name) for name in classes] if classes is not None else None
    num_classes = cfg.num_classes or (len(classes) if classes else None)
    limit = cfg.train_subset if train else cfg.eval_subset
    if limit is not None:
        dataset = Subset(dataset, range(min(limit, len(dataset))))
    if len(dataset) == 0:
        raise UserError(f"{where}: the {'training' if train else 'evaluation'} dataset is empty")
    with building(where, data=True, doing="reading its first sample"):
        first = dataset[0]
    inputs = first[0] if isinstance(first, (tuple, list)) else first
    shape = tuple(inputs.shape) if torch.is_tensor(inputs) else ()
    if cfg.channels is not None and len(shape) == 3 and shape[0] != cfg.channels:
        raise UserError(f"data.channels={cfg.channels} (the channels the model takes): {where} gives "
                        f"{shape[0]}-channel inputs {shape}, which a dataset of one's own makes itself (accel-train "
                        f"converts none); give the model {cfg.channels}-channel inputs, or choose a model that takes "
                        f"{shape[0]}")
    return Data(dataset, num_classes, shape, classes, first)
