"""Datasets that fit in memory (the MNIST family, CIFAR-10, STL-10), kept as one uint8 tensor.

With data.on_device the tensor moves once to the training device and is served a whole batch at a time from there
(augmentation and resizing batched on the device); with data.on_device=false, PerSampleImages serves the same tensor
the usual torchvision way, a PIL image and per-sample transforms at a time, in DataLoader workers.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset
from torchvision import transforms as T

from accel_train.data.channels import to_channels
from accel_train.data.decode import ImagesToModelInput
from accel_train.data.keyed import sample_keys


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
        self.indices_with_samples = False  # each batch's sample indices last (dropout keyed by sample)

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
        made = to_model_input(images, self.size, self.mean, self.std), self.labels[index]
        return (*made, index) if self.indices_with_samples else made


def to_model_input(images: torch.Tensor, size: int | None, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 NCHW images -> the float batch the model sees, with a channel for each value of `mean` (data.channels:
    converted just before normalising). The same operations, in the same order, as ToTensor (+ Resize) + Normalize:
    bit-identical inputs either way."""
    images = images.float().div_(255)
    if size and images.shape[-1] != size:
        images = F.interpolate(images, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    if images.shape[-3] != mean.shape[-3]:
        return to_channels(images, mean.shape[-3]).sub(mean).div_(std)
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
        self.draws_from = augment_draws(source.augment)  # trivial augment and erasing only where augmenting
        self.transform = per_sample_transform(self.images.shape[-1], source.mean.flatten().tolist(),
                                              source.std.flatten().tolist(), source.augment, source.size,
                                              trivial_augment, random_erasing)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.transform(pil_image(self.images[index])), self.labels[index]


def pil_image(pixels: torch.Tensor) -> Image.Image:
    """A uint8 image tensor (channels, height, width; 1 or 3 channels) as a PIL image: grey ("L") or RGB."""
    array = pixels.permute(1, 2, 0).numpy()
    return Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array)


def per_sample_transform(side: int, mean, std, augment: bool, size: int | None, trivial_augment: bool = False,
                         random_erasing: float = 0.0) -> T.Compose:
    """A PIL image of `side` px -> the model's input, as the on-device path computes it (padded random crop and flip
    when augmenting, resized to `size`, normalised); shards written from these datasets use it too."""
    steps = [T.TrivialAugmentWide()] if trivial_augment and augment else []
    steps.append(T.ToTensor())
    if augment:
        steps += [T.RandomCrop(side, padding=pad_for(side)), T.RandomHorizontalFlip()]
    if size and size != side:
        steps.append(T.Resize((size, size), antialias=True))
    steps.append(ConvertingNormalize(list(mean), list(std)))
    if random_erasing and augment:
        steps.append(T.RandomErasing(random_erasing))
    return T.Compose(steps)


class ConvertingNormalize(T.Normalize):
    """Normalize, the image first converted to a channel for each value of the mean (data.channels), as
    to_model_input converts on the device."""

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        return super().forward(to_channels(tensor, len(self.mean)))


def pixels_transform() -> T.Compose:
    """A PIL image or uint8 tensor -> uint8 (C, H, W): the registry's images as PixelsToModelInput takes them."""
    return T.Compose([T.Lambda(as_pixels)])


def as_pixels(image) -> torch.Tensor:
    """A PIL image as its uint8 (C, H, W) tensor; a tensor as it is."""
    return image if torch.is_tensor(image) else T.functional.pil_to_tensor(image)


class PixelsToModelInput(ImagesToModelInput):
    """uint8 batches of the registry's images -> the model's input where the batch is, by to_model_input: the same
    operations in the same order as per_sample_transform's ToTensor, Resize and Normalize on the host, so the same
    inputs. Float images (made on the host, where TrivialAugment and random erasing run) pass as they are.

    A batch (images, labels, keys) is cropped and flipped first, where it is, by random_crop_flip from its keys (as
    the on-device path augments): the host only copies pixels."""

    def __init__(self, mean, std, size: int | None) -> None:
        super().__init__(mean, std)
        self.size = size

    def __call__(self, batch):
        if len(batch) == 3:  # keyed: augmented here
            images, labels, keys = batch
            return self.images(random_crop_flip(images, pad_for(images.shape[-1]), keys)), labels
        return super().__call__(batch)

    def images(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8:
            return images
        mean, std = self.normalization_on(images.device)
        one = images.dim() == 3  # predict's single image
        made = to_model_input(images[None] if one else images, self.size, mean, std)
        return made[0] if one else made


def augment_draws(augmenting: bool) -> frozenset[str]:
    """The generators our transforms draw from (KeyedSamples seeds those alone): torchvision's draw from torch's
    alone, and only to augment."""
    return frozenset({"torch"}) if augmenting else frozenset()


def keep_batch(batch):
    """collate_fn for datasets whose `__getitems__` already returns a batch."""
    return batch


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
