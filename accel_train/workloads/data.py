"""Datasets by name, found locally before anything is downloaded, and the DataLoaders over them.

Datasets that fit in memory (the MNIST family, CIFAR-10, STL-10) are kept as one uint8 tensor and, with
data.on_device, moved once to the training device and served a whole batch at a time from there
(augmentation and resizing batched on the device). With data.on_device=false, and always for ImageFolder and
a user's dataset, a DataLoader runs per-sample transforms (in worker processes where cores allow), each sample's
random draws keyed by (seed, epoch, its index) as the on-device augmentation is (KeyedSamples).
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import transforms as T
from torchvision.transforms import v2

from accel_train.config import DataConfig
from accel_train.errors import DataNotFoundError, UnreadableFileError, UserError, writing
from accel_train.import_paths import check_call, import_object, is_given_object, is_import_path
from accel_train.launch.distributed import cores_per_process, dataloader_workers
from accel_train.workloads.registry import Registry

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SYNTHETIC_TRAIN_SIZE, SYNTHETIC_EVAL_SIZE = 512, 256


@dataclass
class Data:
    """A dataset and what a model needs to know about it; what a Task's setup and build_model receive."""

    dataset: Dataset | None  # None where only the description is needed (predict)
    num_classes: int | None  # None for data without classes (a regression target)
    image_shape: tuple[int, ...]  # the shape of one input sample as the model sees it: (C, H, W) for images
    classes: list[str] | None = None  # class names in index order
    example: Any = None  # a user's dataset's first sample, for the task to check; None for the registry's

    @property
    def in_memory(self) -> bool:
        return isinstance(self.dataset, InMemoryImages)


DATASETS: Registry[Data] = Registry("dataset", "data.name")


class InMemoryImages(Dataset):
    """uint8 images in one tensor; `__getitems__` slices, augments and normalises a whole batch where the tensor lives.

    A DataLoader over it only produces index lists, so Accelerate shards, pads (even batches) and
    de-duplicates (gather_for_metrics) exactly as for any dataset, while the pixels stay on the device.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean, std, augment=False, size=None) -> None:
        self.images, self.labels = images.contiguous(), labels.long()
        self.mean = torch.tensor(mean).view(1, -1, 1, 1)
        self.std = torch.tensor(std).view(1, -1, 1, 1)
        self.augment, self.size = augment, size
        self.seed = self.epoch = 0  # augmentation of a sample is a function of (seed, epoch, its index)

    def set_epoch(self, epoch: int, seed: int | None = None) -> None:
        """Called by start_epoch, and by Accelerate (epoch only) for loaders whose sampler has no set_epoch."""
        self.epoch = epoch
        self.seed = self.seed if seed is None else seed

    def subset(self, indices: torch.Tensor, augment: bool) -> InMemoryImages:
        part = copy.copy(self)
        part.images, part.labels, part.augment = self.images[indices], self.labels[indices], augment
        return part

    def to(self, device: torch.device) -> InMemoryImages:
        """A view of the same data held on `device` (one copy, made once)."""
        moved = copy.copy(self)
        for name in ("images", "labels", "mean", "std"):
            setattr(moved, name, getattr(self, name).to(device))
        return moved

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        images, labels = self.__getitems__([index])
        return images[0], labels[0]

    def __getitems__(self, indices: list[int]):
        index = torch.as_tensor(indices)
        if self.images.is_cuda:  # from pinned memory the copy is asynchronous: the step does not wait for it
            index = index.pin_memory()
        index = index.to(self.images.device, non_blocking=True)
        images = self.images[index]
        if self.augment:  # on uint8: a quarter of the memory traffic of augmenting floats, same result
            images = random_crop_flip(images, pad_for(images.shape[-1]), sample_keys(index, self.epoch, self.seed))
        return to_model_input(images, self.size, self.mean, self.std), self.labels[index]


def to_model_input(images: torch.Tensor, size: int | None, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 NCHW images -> the float batch the model sees. The same operations, in the same order, as ToTensor
    (+ Resize) + Normalize: bit-identical inputs either way."""
    images = images.float().div_(255)
    if size and images.shape[-1] != size:
        images = F.interpolate(images, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return images.sub_(mean).div_(std)


def pad_for(side: int) -> int:
    """Random-crop padding: 3 px for 28 px images, 4 px for 32 px (the usual CIFAR setting), side/8 in general."""
    return max(1, side // 8)


class PerSampleImages(Dataset):
    """The usual torchvision way over the same uint8 tensor: a PIL image per sample, then per-sample transforms.

    Serves data.on_device=false (and is the bench's input-pipeline baseline); runs in DataLoader workers.
    """

    def __init__(self, source: InMemoryImages, trivial_augment: bool = False, random_erasing: float = 0.0) -> None:
        self.images, self.labels = source.images.cpu(), source.labels.cpu()
        side = self.images.shape[-1]
        steps = [T.TrivialAugmentWide()] if trivial_augment and source.augment else []
        steps.append(T.ToTensor())
        if source.augment:
            steps += [T.RandomCrop(side, padding=pad_for(side)), T.RandomHorizontalFlip()]
        if source.size and source.size != side:
            steps.append(T.Resize((source.size, source.size), antialias=True))
        steps.append(T.Normalize(source.mean.flatten().tolist(), source.std.flatten().tolist()))
        if random_erasing and source.augment:
            steps.append(T.RandomErasing(random_erasing))
        self.transform = T.Compose(steps)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        pixels = self.images[index].permute(1, 2, 0).numpy()
        image = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)
        return self.transform(image), self.labels[index]


def keep_batch(batch):
    """collate_fn for datasets whose `__getitems__` already returns a batch."""
    return batch


_LOW_33_BITS = (1 << 33) - 1


def sample_keys(indices: torch.Tensor, epoch: int, seed: int) -> torch.Tensor:
    """A random 62-bit number per (seed, epoch, sample index), computed where the indices live.

    Drawing augmentation from the global RNG would tie it to which process loads a sample and to when
    (Accelerate prefetches one batch ahead), so a resumed run or another world size would crop differently.
    A counter-based hash (the splitmix64 finaliser, with masked shifts since torch's >> is arithmetic) makes
    the crops and flips of an epoch identical however the run is split or interrupted.
    """
    offset = ((seed * 1_000_003 + epoch + 1) * 0x5851F42D4C957F2D) % 2**64
    keys = indices.long() * 0x2545F4914F6CDD1D + (offset - 2**64 if offset >= 2**63 else offset)
    for multiplier in (0x3F58476D1CE4E5B9, 0x14057B7EF767814F):
        keys = (keys ^ ((keys >> 31) & _LOW_33_BITS)) * multiplier
    return (keys ^ ((keys >> 31) & _LOW_33_BITS)) & ((1 << 62) - 1)


def random_crop_flip(images: torch.Tensor, padding: int, keys: torch.Tensor) -> torch.Tensor:
    """Per-image random crop (zero padding) and horizontal flip for a whole batch: one gather, no Python loop.

    `keys` (one random integer per image, see sample_keys) decide each image's offsets and flip.
    """
    n, c, h, w = images.shape
    device = images.device
    padded_width = w + 2 * padding
    padded = F.pad(images, (padding,) * 4).view(n, c, -1)
    keys = keys.view(n, 1, 1)
    top = keys % (2 * padding + 1)
    left = (keys >> 20) % (2 * padding + 1)
    flip = ((keys >> 40) & 1).bool()
    columns = torch.arange(w, device=device).view(1, 1, w)
    columns = left + torch.where(flip, w - 1 - columns, columns)
    rows = top + torch.arange(h, device=device).view(1, h, 1)
    index = (rows * padded_width + columns).view(n, 1, h * w).expand(n, c, h * w)
    return padded.gather(2, index).view(n, c, h, w)


class KeyedSamples(Dataset):
    """A dataset served sample by sample, every random draw of its transforms a function of (seed, epoch, index).

    Before each sample, torch's CPU generator, Python's `random` and numpy's global generator are seeded from
    sample_keys(index, epoch, seed); afterwards the caller's states are put back. So a sample is augmented alike at
    any world size, with any number of DataLoader workers and after a resume, and the training process's own streams
    (dropout draws from them; with num_workers=0 the transforms run there) do not move. Not reseeded: a
    numpy.random.Generator or random.Random that the dataset makes itself. The index is the one the DataLoader
    passes, the same whichever process loads the sample.
    """

    def __init__(self, samples: Dataset) -> None:
        self.samples = samples
        # [seed, epoch] in shared memory: persistent DataLoader workers keep the copy of this object made when they
        # started, and must see every later epoch. Evaluation loaders keep epoch 0 of seed 0.
        self.seed_and_epoch = torch.zeros(2, dtype=torch.long).share_memory_()

    def key_epoch(self, epoch: int, seed: int) -> None:
        """Called by start_epoch, before the epoch's iterator fetches anything. Not named set_epoch: Accelerate
        calls a dataset's set_epoch with its own count of iterations, evaluation loaders' too."""
        self.seed_and_epoch.copy_(torch.tensor([seed, epoch]))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list:
        # A batch at a time (the DataLoader's fetcher calls this), so the states are saved and put back once a batch;
        # each sample still comes from the dataset's own __getitem__ and its own key, even where the dataset could
        # fetch a whole batch (a Hugging Face datasets.Dataset).
        seed, epoch = self.seed_and_epoch.tolist()
        keys = sample_keys(torch.as_tensor(indices), epoch, seed).tolist()
        saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
        try:
            samples = []
            for index, key in zip(indices, keys):
                torch.default_generator.manual_seed(key)  # the CPU's alone: torch.manual_seed would reseed CUDA's too
                random.seed(key)
                # Its high 32 bits: torch's MT19937 takes the low 32, and numpy's with the same seed would draw the same
                np.random.seed(key >> 30)
                samples.append(self.samples[index])
            return samples
        finally:
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])


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
    fake = torchvision.datasets.FakeData(size, image_size=shape, num_classes=num_classes,
                                         transform=v2.PILToTensor(), random_offset=0 if train else 10**6)
    images, labels = zip(*(fake[i] for i in range(size)))
    return torch.stack(images), torch.tensor(labels)


def _in_memory(cfg: DataConfig, name: str, train: bool) -> Data:
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
    mean, std = _normalization(cfg, source)
    dataset = InMemoryImages(images, labels, mean, std, augment=train and cfg.augment, size=size)
    return Data(dataset, source.num_classes, (source.shape[0], size, size), classes)


def _normalization(cfg: DataConfig, source: TorchvisionSource) -> tuple[tuple, tuple]:
    channels = len(source.mean)
    if not cfg.normalize:
        return (0.0,) * channels, (1.0,) * channels
    return given_normalization(cfg, channels) or (source.mean, source.std)


def given_normalization(cfg: DataConfig, channels: int) -> tuple[tuple, tuple] | None:
    """data.mean / data.std (set by the user, or from pretrained weights), checked against the images' channels."""
    if cfg.mean is None and cfg.std is None:
        return None
    if cfg.mean is None or cfg.std is None or len(cfg.mean) != channels or len(cfg.std) != channels:
        raise UserError(f"data.mean={cfg.mean} and data.std={cfg.std}: give both, one value per channel of "
                        f"{cfg.name}'s {channels}-channel images")
    return tuple(cfg.mean), tuple(cfg.std)


for _name in SOURCES:
    DATASETS.register(_name)(lambda cfg, train, _name=_name: _in_memory(cfg, _name, train))


@DATASETS.register("imagefolder")
def imagefolder(cfg: DataConfig, train: bool) -> Data:
    """The user's own data: data.root/train/<class>/*.jpg, and data.root/test/ (or val/) the same way."""
    size = cfg.image_size or 224
    transform = _imagefolder_transform(cfg, train)
    if cfg.synthetic:
        count = (cfg.train_subset or SYNTHETIC_TRAIN_SIZE) if train else (cfg.eval_subset or SYNTHETIC_EVAL_SIZE)
        dataset = torchvision.datasets.FakeData(count, image_size=(3, size, size), num_classes=10, transform=transform)
        return Data(dataset, 10, (3, size, size), [str(index) for index in range(10)])
    root = Path(cfg.root)
    _imagefolder_split(root, not train)  # report a missing train or test folder before reading either
    return _imagefolder_data(cfg, _imagefolder_split(root, train), transform,
                             cfg.train_subset if train else cfg.eval_subset)


def _imagefolder_data(cfg: DataConfig, split_dir: Path, transform, limit: int | None) -> Data:
    size = cfg.image_size or 224
    try:
        dataset = torchvision.datasets.ImageFolder(str(split_dir), transform=transform, loader=load_image)
    except FileNotFoundError as err:
        raise DataNotFoundError(f"imagefolder: {err}; expected {split_dir}/<class>/<images>") from None
    classes = list(dataset.classes)
    if limit is not None:
        dataset = Subset(dataset, range(min(limit, len(dataset))))
    return Data(dataset, len(classes), (3, size, size), classes)


def _imagefolder_transform(cfg: DataConfig, train: bool) -> v2.Compose:
    size = cfg.image_size or 224
    if train:
        transform = [v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()] if cfg.augment \
            else [v2.Resize(size, antialias=True), v2.CenterCrop(size)]
        transform += [v2.TrivialAugmentWide()] if cfg.trivial_augment else []  # on uint8, as it expects
    else:
        transform = [v2.Resize(int(size * 256 / 224), antialias=True), v2.CenterCrop(size)]
    normalize = [v2.Normalize(*(given_normalization(cfg, 3) or (IMAGENET_MEAN, IMAGENET_STD)))] if cfg.normalize else []
    erase = [v2.RandomErasing(cfg.random_erasing)] if train and cfg.random_erasing else []  # after normalising: timm's
    return v2.Compose([v2.PILToTensor(), v2.RGB(), *transform, v2.ToDtype(torch.float32, scale=True), *normalize,
                       *erase])


def load_image(path: str, reader: str = "imagefolder") -> Image.Image:
    """torchvision's loader, with a damaged file named in one line (from a DataLoader worker too); the line starts
    with `reader`, what the user asked to read it (a dataset, or predict)."""
    try:
        return torchvision.datasets.folder.default_loader(path)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        what = "delete or replace that file" if reader == "imagefolder" else "give image files only"
        raise UnreadableFileError(f"{reader}: cannot read {path} as an image ({err}); {what}") from None


def _imagefolder_split(root: Path, train: bool) -> Path:
    names = ("train",) if train else ("test", "val", "validation")
    for name in names:
        if (root / name).is_dir():
            return root / name
    raise DataNotFoundError(
        f"imagefolder: no {' / '.join(names)} folder in data.root={root}; expected "
        f"{root}/train/<class>/<images> and {root}/test/<class>/<images>"
    )


def _imagefolder_own_val(cfg: DataConfig) -> Path | None:
    """ImageFolder's val/ (or validation/) is a validation split of its own when test/ is there too."""
    root = Path(cfg.root)
    if cfg.name != "imagefolder" or cfg.synthetic or not (root / "test").is_dir():
        return None
    return next((root / name for name in ("val", "validation") if (root / name).is_dir()), None)


def hold_out_validation(cfg: DataConfig, seed: int, train: Data) -> tuple[Data, Data | None]:
    """(training data, validation data or None). The validation split is ImageFolder's own val/ beside test/, or
    data.val_fraction of the training set drawn by `seed` before any process takes its share: every world size
    holds out the same samples. It is evaluated as the test set is (no augmentation), limited by data.eval_subset."""
    own = _imagefolder_own_val(cfg)
    if own is not None:
        if cfg.val_fraction:
            raise UserError(f"data.val_fraction={cfg.val_fraction}: data.root={cfg.root} has a validation split of "
                            f"its own ({own}); set data.val_fraction=0 to use it, or remove the folder")
        return train, _imagefolder_data(cfg, own, _imagefolder_transform(cfg, train=False), cfg.eval_subset)
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
        training, validation = Subset(dataset, kept.tolist()), Subset(_as_evaluated(dataset, cfg), held.tolist())
    return dataclasses.replace(train, dataset=training), dataclasses.replace(train, dataset=validation)


def _as_evaluated(dataset: Dataset, cfg: DataConfig) -> Dataset:
    """The registry's imagefolder with evaluation's transform (no augmentation); a user's dataset as it is."""
    if cfg.name != "imagefolder":
        return dataset
    inner = dataset.dataset if isinstance(dataset, Subset) else dataset
    evaluated = copy.copy(inner)
    evaluated.transform = _imagefolder_transform(cfg, train=False)
    return Subset(evaluated, dataset.indices) if isinstance(dataset, Subset) else evaluated


def build_dataset(cfg: DataConfig, train: bool, given: Dataset | None = None) -> Data:
    """The dataset data.name names (one of the registry, or the user's by import path), or the one `given`."""
    if given is not None:
        return from_dataset(given, cfg, train, "train_dataset" if train else "eval_dataset")
    if is_import_path(cfg.name):
        factory = import_object(cfg.name, "data.name")
        dataset = factory(**check_call(factory, "data.name", cfg.name, "data.args", {"train": train}, cfg.args))
        return from_dataset(dataset, cfg, train, f"data.name={cfg.name}")
    if is_given_object(cfg.name):
        raise UserError(f"data.name={cfg.name}: this run's data was given as a Python object; pass it again "
                        "(accel_train.evaluate(..., eval_dataset=...))")
    return DATASETS.get(cfg.name)(cfg, train)


def check_data_name(cfg: DataConfig) -> None:
    """Before any data loads: a registered name, or an import path to a function that takes train= and data.args;
    per-sample augmentation only where samples are transformed one by one."""
    if (cfg.trivial_augment or cfg.random_erasing) and not (cfg.name == "imagefolder" or
                                                            (cfg.name in SOURCES and not cfg.on_device)):
        where = "set data.on_device=false to transform samples one by one in DataLoader workers" \
            if cfg.name in SOURCES else "a dataset by import path applies its own transforms"
        raise UserError(f"data.trivial_augment / data.random_erasing apply to file-backed data (imagefolder, or "
                        f"{', '.join(SOURCES)} with data.on_device=false); data.name={cfg.name}: {where}")
    if is_import_path(cfg.name):
        factory = import_object(cfg.name, "data.name")
        check_call(factory, "data.name", cfg.name, "data.args", {"train": True}, cfg.args)
    elif not is_given_object(cfg.name):
        DATASETS.get(cfg.name)


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
    first = dataset[0]
    inputs = first[0] if isinstance(first, (tuple, list)) else first
    return Data(dataset, num_classes, tuple(inputs.shape) if torch.is_tensor(inputs) else (), classes, first)


def image_converter(cfg: DataConfig) -> tuple[Callable[[Image.Image], torch.Tensor], tuple[int, ...]]:
    """How evaluation turns one image into the model's input (channels, size, normalisation), and that input's
    shape, without loading the dataset: what accel-train predict applies to each file."""
    if cfg.name == "imagefolder":
        size = cfg.image_size or 224
        return _imagefolder_transform(cfg, train=False), (3, size, size)
    if cfg.name not in SOURCES:
        raise UserError(f"predict reads image files as a dataset of the registry does (mnist, fashion_mnist, "
                        f"cifar10, stl10, imagefolder); data.name={cfg.name} is not one: call accel_train.predict "
                        "from Python with your own inputs")
    source = SOURCES[cfg.name]
    channels, height, width = source.shape
    size = cfg.image_size or width
    mean, std = (torch.tensor(values).view(1, -1, 1, 1) for values in _normalization(cfg, source))

    def convert(image: Image.Image) -> torch.Tensor:
        # As the dataset's own images: its channels at its own resolution, then the eval data's resize and scaling.
        image = image.convert("L" if channels == 1 else "RGB")
        if image.size != (width, height):
            image = image.resize((width, height), Image.Resampling.BILINEAR)
        return to_model_input(v2.functional.pil_to_tensor(image)[None], size, mean, std)[0]

    return convert, (channels, size, size)


def start_epoch(loader: DataLoader, epoch: int, seed: int) -> None:
    """Data order (Accelerate's seedable sampler) and augmentation both become functions of (seed, epoch). Called
    before the epoch's iterator is made: it fetches the first batches (in workers too) as it starts."""
    loader.set_epoch(epoch)  # Accelerate passes it to the sampler only, not to the dataset
    if isinstance(loader.dataset, InMemoryImages):
        loader.dataset.set_epoch(epoch, seed)
    elif isinstance(loader.dataset, KeyedSamples):
        loader.dataset.key_epoch(epoch, seed)


def slow_input_advice(cfg: DataConfig, data: Data) -> str:
    """The knob that feeds this data path's steps faster, for the warning a high data_wait brings."""
    if data.in_memory and cfg.on_device:  # batches are cut and augmented on the device, in the step's stream
        return "these batches are cut and augmented on the device: lower data.image_size or turn data.augment off"
    on_device = "set data.on_device=true (the dataset moves to the device once, augmented a batch at a time), or " \
        if data.in_memory else ""
    workers, cores = dataloader_workers(cfg.num_workers), cores_per_process()
    if workers < cores:
        return f"{on_device}raise data.num_workers (now {workers}; {cores} CPU cores per process here)"
    return (f"{on_device}lower data.image_size, lighten augmentation or read from faster storage: all {workers} "
            f"DataLoader workers are busy ({cores} CPU cores per process here)")


def make_loader(data: Data, cfg: DataConfig, global_batch: int, train: bool, device: torch.device,
                accumulation: int = 1) -> DataLoader:
    """A loader over GLOBAL batches, or over their `accumulation` equal micro-batches; Accelerate's prepare
    (split_batches) hands each process its slice."""
    if train and len(data.dataset) < global_batch:
        raise UserError(f"the training set has {len(data.dataset)} samples, fewer than "
                        f"train.batch_size={global_batch}; "
                        "lower train.batch_size or raise data.train_subset")
    # A loader of its own generator: otherwise each new iterator draws its seed from the global RNG, the
    # stream dropout uses, and a resumed run (whose iterator starts mid-epoch) would see other dropout masks.
    # The order of samples is the seedable sampler's, a function of (seed, epoch) alone; the seeds the workers
    # get from this generator reach no transform (KeyedSamples seeds every sample).
    generator = torch.Generator().manual_seed(0)
    dataset, global_batch = data.dataset, global_batch // accumulation
    if data.in_memory:
        if cfg.on_device:  # no workers: a batch is a few kernels on the device, not per-image Python
            return DataLoader(dataset.to(device), batch_size=global_batch, shuffle=train, drop_last=train,
                              collate_fn=keep_batch, generator=generator)
        dataset = PerSampleImages(dataset, cfg.trivial_augment, cfg.random_erasing)
    workers = dataloader_workers(cfg.num_workers)
    return DataLoader(KeyedSamples(dataset), batch_size=global_batch, shuffle=train, drop_last=train,
                      num_workers=workers, pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                      generator=generator)
