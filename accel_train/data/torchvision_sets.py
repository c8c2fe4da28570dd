"""The torchvision datasets of the registry (mnist, fashion_mnist, cifar10, stl10), found locally before anything
is downloaded (Debian's Fashion-MNIST among the places), and held in memory as uint8 tensors."""

from __future__ import annotations

import gzip
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision
from torchvision.transforms import v2

from accel_train.config import DataConfig
from accel_train.data.channels import converted_normalization, model_channels
from accel_train.data.in_memory import InMemoryImages
from accel_train.data.registry import (
    DATASETS,
    SYNTHETIC_EVAL_SIZE,
    SYNTHETIC_TRAIN_SIZE,
    Data,
    FakeImages,
    given_normalization,
)
from accel_train.errors import DataNotFoundError, writing


@dataclass(frozen=True)
class TorchvisionSource:
    """How to get one torchvision dataset and turn it into uint8 NCHW tensors."""

    factory: Callable  # (root, train, download) -> torchvision dataset
    to_tensors: Callable  # dataset -> (uint8 images NCHW, int labels)
    num_classes: int
    shape: tuple[int, int, int]
    mean: tuple
    std: tuple
    local_copy: Callable[[Path], bool] | None = None  # installs a distribution's copy into root


def _mnist_tensors(ds):
    return ds.data.unsqueeze(1), ds.targets


def _cifar_tensors(ds):
    return torch.from_numpy(ds.data).permute(0, 3, 1, 2), torch.tensor(ds.targets)


def _stl_tensors(ds):
    return torch.from_numpy(ds.data), torch.from_numpy(ds.labels).long()


FASHION_MNIST_DEBIAN = Path("/usr/share/datasets/fashion-mnist")


def _install_debian_fashion_mnist(root: Path) -> bool:
    """Debian's dataset-fashion-mnist ships the idx .gz files; torchvision reads them unpacked from root."""
    if not FASHION_MNIST_DEBIAN.is_dir():
        return False
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for packed in FASHION_MNIST_DEBIAN.glob("*-ubyte.gz"):
        target = raw / packed.stem
        if not target.exists():
            partial = target.with_suffix(".partial")
            with gzip.open(packed, "rb") as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            partial.rename(target)
    return True


SOURCES = {
    "mnist": TorchvisionSource(
        lambda root, train, download: torchvision.datasets.MNIST(root, train=train, download=download),
        _mnist_tensors, 10, (1, 28, 28), (0.1307,), (0.3081,)),
    "fashion_mnist": TorchvisionSource(
        lambda root, train, download: torchvision.datasets.FashionMNIST(root, train=train, download=download),
        _mnist_tensors, 10, (1, 28, 28), (0.2860,), (0.3530,), _install_debian_fashion_mnist),
    "cifar10": TorchvisionSource(
        lambda root, train, download: torchvision.datasets.CIFAR10(root, train=train, download=download),
        _cifar_tensors, 10, (3, 32, 32), (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "stl10": TorchvisionSource(
        lambda root, train, download: torchvision.datasets.STL10(root, split="train" if train else "test",
                                                                 download=download),
        _stl_tensors, 10, (3, 96, 96), (0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)),
}


def _find_torchvision(cfg: DataConfig, name: str, source: TorchvisionSource, train: bool):
    """data.root if it holds the data -> a local distribution copy -> torchvision's download -> one clear error."""
    root = Path(cfg.root)
    try:
        return source.factory(root, train, False)
    except RuntimeError:
        pass
    if source.local_copy is not None:
        with writing(root, f"unpacking the local copy of {name} into data.root",
                     "set data.root to a folder you can write"):
            unpacked = source.local_copy(root)
        if unpacked:
            return source.factory(root, train, False)
    failure = "data.download=false"
    if cfg.download:
        try:
            return source.factory(root, train, True)
        except Exception as err:  # torchvision raises URLError, RuntimeError or OSError depending on the mirror
            failure = f"download failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
    local = " or install the distribution copy (apt-get install dataset-fashion-mnist)" if source.local_copy else ""
    raise DataNotFoundError(
        f"dataset '{name}' not found in data.root={root}{local}, and {failure}; put the files in data.root, "
        f"allow data.download=true on a machine with internet, or set data.root to a folder that has them"
    )


def _synthetic_tensors(cfg: DataConfig, shape, num_classes: int, train: bool):
    size = (cfg.train_subset or SYNTHETIC_TRAIN_SIZE) if train else (cfg.eval_subset or SYNTHETIC_EVAL_SIZE)
    fake = FakeImages(size, image_size=shape, num_classes=num_classes, transform=v2.PILToTensor(),
                      random_offset=0 if train else 10**6)
    images, labels = zip(*(fake[i] for i in range(size)))
    return torch.stack(images), torch.tensor(labels)


def in_memory_dataset(cfg: DataConfig, name: str, train: bool) -> Data:
    source = SOURCES[name]
    if cfg.synthetic:
        images, labels = _synthetic_tensors(cfg, source.shape, source.num_classes, train)
        classes = [str(index) for index in range(source.num_classes)]
    else:
        found = _find_torchvision(cfg, name, source, train)
        images, labels = source.to_tensors(found)
        classes = [str(name) for name in found.classes]
    limit = cfg.train_subset if train else cfg.eval_subset
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    size = cfg.image_size or source.shape[-1]
    mean, std = normalization(cfg, source)
    dataset = InMemoryImages(images, labels, mean, std, augment=train and cfg.augment, size=size)
    return Data(dataset, source.num_classes, (len(mean), size, size), classes)


def normalization(cfg: DataConfig, source: TorchvisionSource) -> tuple[tuple, tuple]:
    """The mean and std the images are normalised by, one value a channel the model is given (data.channels: the
    images are converted to as many, data/channels.py)."""
    channels = model_channels(cfg, source.shape[0], f"data.name={cfg.name}")
    if not cfg.normalize:
        return (0.0,) * channels, (1.0,) * channels
    return given_normalization(cfg, channels) or converted_normalization(source.mean, source.std, channels)


for _name in SOURCES:
    DATASETS.register(_name)(lambda cfg, train, classes=None, _name=_name: in_memory_dataset(cfg, _name, train))
