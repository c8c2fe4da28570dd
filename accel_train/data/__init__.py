"""Data: datasets by name (the torchvision sets in memory, ImageFolder trees, a user's dataset by import path),
the validation split, and the loaders that feed the loop; every augmentation keyed by (seed, epoch, sample).

Datasets that fit in memory (the MNIST family, CIFAR-10, STL-10) are kept as one uint8 tensor and, with
data.on_device, moved once to the training device and served a whole batch at a time from there (in_memory.py).
With data.on_device=false, and always for ImageFolder and a user's dataset, a DataLoader runs per-sample transforms
(in worker processes where cores allow), each sample's random draws keyed by (seed, epoch, its index) as the
on-device augmentation is (keyed.py).
"""

from __future__ import annotations

from torch.utils.data import Dataset

from accel_train.config import DataConfig
from accel_train.data import imagefolder, torchvision_sets  # noqa: F401  (registration)
from accel_train.data.classes import labelled_by
from accel_train.data.imagefolder import load_image
from accel_train.data.in_memory import InMemoryImages
from accel_train.data.keyed import KeyedSamples, sample_keys
from accel_train.data.loaders import make_loader, slow_input_advice, start_epoch
from accel_train.data.predict_inputs import image_converter
from accel_train.data.registry import DATASETS, Data
from accel_train.data.shards import dataset as _shards  # noqa: F401  (registration)
from accel_train.data.torchvision_sets import SOURCES
from accel_train.data.user import check_user_dataset, from_dataset, user_dataset
from accel_train.data.validation import hold_out_validation
from accel_train.errors import UserError
from accel_train.import_paths import is_given_object, is_import_path, source_of

__all__ = ["DATASETS", "Data", "InMemoryImages", "KeyedSamples", "build_dataset", "check_data_name", "from_dataset",
           "hold_out_validation", "image_converter", "load_image", "make_loader", "sample_keys", "slow_input_advice",
           "start_epoch"]


def build_dataset(cfg: DataConfig, train: bool, given: Dataset | None = None,
                  classes: list[str] | None = None) -> Data:
    """The dataset data.name names (one of the registry, or the user's by import path), or the one `given`. An
    evaluation split's labels index `classes` (the run's: its training split's names) by name; None: the data's own
    training split's, where it has one of its own (an ImageFolder tree, shards)."""
    if given is not None:
        data = from_dataset(given, cfg, train, "train_dataset" if train else "eval_dataset")
    elif is_import_path(cfg.name):
        data = user_dataset(cfg, train)
    elif is_given_object(cfg.name):
        raise UserError(f"data.name={cfg.name}: this run's data was given as a Python object; pass it again "
                        "(accel_train.evaluate(..., eval_dataset=...))")
    elif source_of(cfg.name) == "hf":
        from accel_train.data.hub import hub_dataset

        data = hub_dataset(cfg, train, classes=None if train else classes)
    else:
        data = DATASETS.get(cfg.name)(cfg, train, classes=None if train else classes)
    if train or data.in_memory:  # the registry's in-memory sets: one fixed list of classes, the same in both splits
        return data
    return labelled_by(data, classes, f"data.name={cfg.name}: the evaluation split")


def check_data_name(cfg: DataConfig) -> None:
    """Before any data loads: a registered name, or an import path to a function that takes train= and data.args;
    per-sample augmentation only where samples are transformed one by one."""
    if (cfg.trivial_augment or cfg.random_erasing) and not (cfg.name in ("imagefolder", "shards") or
                                                            source_of(cfg.name) == "hf" or
                                                            (cfg.name in SOURCES and not cfg.on_device)):
        where = "set data.on_device=false to transform samples one by one in DataLoader workers" \
            if cfg.name in SOURCES else "a dataset by import path applies its own transforms"
        raise UserError(f"data.trivial_augment / data.random_erasing apply to file-backed data (imagefolder, shards, "
                        f"or {', '.join(SOURCES)} with data.on_device=false); data.name={cfg.name}: {where}")
    if is_import_path(cfg.name):
        check_user_dataset(cfg)
    elif source_of(cfg.name) == "hf":
        from accel_train.data.hub import check_hub_data

        check_hub_data(cfg)
    elif source_of(cfg.name) is not None:
        raise UserError(f"data.name={cfg.name}: datasets come from the Hub as hf:NAME; {cfg.name.partition(':')[0]}: "
                        "names models only")
    elif not is_given_object(cfg.name):
        DATASETS.get(cfg.name)
