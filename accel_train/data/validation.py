"""The validation split: ImageFolder's own val/ beside test/, or a fraction of the training set drawn by seed."""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch
from torch.utils.data import Dataset, Subset

from accel_train.config import DataConfig
from accel_train.data.imagefolder import imagefolder_data, imagefolder_transform, own_validation_folder
from accel_train.data.in_memory import InMemoryImages
from accel_train.data.registry import Data
from accel_train.distributed.environment import launcher_environment
from accel_train.errors import UserError
from accel_train.import_paths import source_of

logger = logging.getLogger(__name__)


def hold_out_validation(cfg: DataConfig, seed: int, train: Data, test: Data | None = None) -> tuple[Data, Data | None]:
    """(training data, validation data or None). The validation split is ImageFolder's own val/ beside test/, or
    data.val_fraction of the training set drawn by `seed` before any process takes its share: every world size
    holds out the same samples. It is evaluated as the `test` split is (no augmentation), limited by
    data.eval_subset."""
    return validation_split(cfg, seed, train, test, from_hub=source_of(cfg.name) == "hf")


def validation_split(cfg: DataConfig, seed: int, train: Data, test: Data | None,
                     from_hub: bool) -> tuple[Data, Data | None]:
    """hold_out_validation's, with whether data.name is a Hub dataset decided (run_data's DataSource)."""
    if from_hub:
        from accel_train.data.hub import holds_out_evaluation

        if holds_out_evaluation(cfg):  # data.val_fraction made the evaluation split: none other is held out
            return train, None
    if cfg.name == "shards" and not cfg.val_fraction:
        from accel_train.data.shards.dataset import validation_split

        return train, validation_split(cfg, train.classes)
    own = own_validation_folder(cfg)
    if own is not None:
        if cfg.val_fraction:
            raise UserError(f"data.val_fraction={cfg.val_fraction}: data.root={cfg.root} has a validation split of "
                            f"its own ({own}); set data.val_fraction=0 to use it, or remove the folder")
        return train, imagefolder_data(cfg, own, imagefolder_transform(cfg, train=False), cfg.eval_subset,
                                       classes=train.classes)
    if not cfg.val_fraction:
        return train, None
    dataset, total = train.dataset, len(train.dataset)
    count = round(total * cfg.val_fraction)
    if not 0 < count < total:
        raise UserError(f"data.val_fraction={cfg.val_fraction} holds out {count} of the {total} training samples; "
                        "choose a fraction that leaves samples in both splits")
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    held, kept = order[:count].sort().values, order[count:].sort().values
    if cfg.eval_subset is not None:
        held = held[:cfg.eval_subset]
    if isinstance(dataset, InMemoryImages):
        training, validation = dataset.subset(kept, dataset.augment), dataset.subset(held, augment=False)
    else:
        training, validation = Subset(dataset, kept.tolist()), Subset(_as_evaluated(dataset, cfg, test, from_hub),
                                                                      held.tolist())
    return dataclasses.replace(train, dataset=training), dataclasses.replace(train, dataset=validation)


def _as_evaluated(dataset: Dataset, cfg: DataConfig, test: Data | None, from_hub: bool) -> Dataset:
    """The training samples served as the test split serves its own: the registry's imagefolder with evaluation's
    transform; a user's dataset with the `transform` of its test split where both have one (torchvision's datasets
    do), else as it is, with one warning."""
    inner = dataset.dataset if isinstance(dataset, Subset) else dataset
    if cfg.name == "imagefolder" or from_hub:
        transform = imagefolder_transform(cfg, train=False)
    else:
        evaluated = test.dataset if test is not None else None
        evaluated = evaluated.dataset if isinstance(evaluated, Subset) else evaluated
        transform = getattr(evaluated, "transform", None)
        if transform is None or not hasattr(inner, "transform"):
            if launcher_environment().is_reporting_process:
                logger.warning(f"data.val_fraction: the validation samples of data.name={cfg.name} come from its "
                               "training dataset, with its transforms (augmentation too); give its datasets a "
                               "`transform` attribute (the test split's is then used) to evaluate them as the test "
                               "split is")
            return dataset
    copied = copy.copy(inner)
    copied.transform = transform
    unaugmented = {"draws_from": frozenset(), "augments_on_device": False, "collate_fn": None}
    for name, value in unaugmented.items():  # what the loader learns of its augmentation: none here
        if hasattr(copied, name):
            setattr(copied, name, value)
    return Subset(copied, dataset.indices) if isinstance(dataset, Subset) else copied
