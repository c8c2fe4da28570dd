"""Data: a dataset and what a model needs to know about it, and the registry of datasets by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torchvision
from torch.utils.data import Dataset
from torchvision import transforms as T

from accel_train.config import DataConfig
from accel_train.data.in_memory import InMemoryImages
from accel_train.errors import UserError
from accel_train.registry import Registry

SYNTHETIC_TRAIN_SIZE, SYNTHETIC_EVAL_SIZE = 512, 256  # data.synthetic: FakeData of the dataset's shape


class FakeImages(torchvision.datasets.FakeData):
    """torchvision's FakeData, sample for sample, each drawn from a generator seeded as FakeData seeds torch. By hand
    because FakeData's torch.manual_seed per sample also queues a CUDA seed with a formatted stack wherever CUDA is not
    initialised (a CPU run, a DataLoader worker): 0.4 to 3 ms a sample, by the depth of the caller's stack."""

    def __getitem__(self, index: int):
        if index >= len(self):
            raise IndexError(f"{type(self).__name__} index out of range")
        generator = torch.Generator().manual_seed(index + self.random_offset)
        image = T.ToPILImage()(torch.randn(*self.image_size, generator=generator))
        target = torch.randint(0, self.num_classes, size=(1,), dtype=torch.long, generator=generator)[0]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target.item()


@dataclass
class Data:
    """A dataset and what a model needs to know about it; what a Task's setup and build_model receive."""

    dataset: Dataset | None  # None where only the description is needed (predict)
    num_classes: int | None  # None for data without classes (a regression target)
    image_shape: tuple[int, ...]  # the shape of one input sample as the model sees it: (C, H, W) for images
    classes: list[str] | None = None  # class names in index order
    example: Any = None  # a user's dataset's first sample, for the task to check; None for the registry's
    # what turns a loaded batch into the model's input on the training device (uint8 images into normalised floats:
    # decode.ImagesToModelInput); None where batches come ready
    finish: Any = None

    @property
    def in_memory(self) -> bool:
        return isinstance(self.dataset, InMemoryImages)


DATASETS: Registry[Data] = Registry("dataset", "data.name")


def given_normalization(cfg: DataConfig, channels: int) -> tuple[tuple, tuple] | None:
    """data.mean / data.std (set by the user, or from pretrained weights), checked against the channels of the images
    the model is given."""
    if cfg.mean is None and cfg.std is None:
        return None
    if cfg.mean is None or cfg.std is None or len(cfg.mean) != channels or len(cfg.std) != channels:
        raise UserError(f"data.mean={cfg.mean} and data.std={cfg.std}: give both, one value per channel of the "
                        f"{channels}-channel images {cfg.name} gives the model")
    return tuple(cfg.mean), tuple(cfg.std)
