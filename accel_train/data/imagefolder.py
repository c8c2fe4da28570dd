"""The user's own images in folders: data.root/train/<class>/*.jpg, data.root/test/ (or val/) the same way, decoded
straight into uint8 tensors (decode.py; JPEGs at the scale their crop needs with data.decode=scaled) and transformed
per sample as uint8 (torchvision's ImageFolder and transforms v2); the batches are scaled and normalised on the
device (decode.ImagesToModelInput)."""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path

import torch
import torchvision
from PIL import Image
from torch.utils.data import Subset
from torchvision import transforms as T
from torchvision.transforms import v2

from accel_train.config import MAX_IMAGE_PIXELS, DataConfig
from accel_train.data.channels import converted_normalization, model_channels, to_channels
from accel_train.data.classes import label_indices
from accel_train.data.decode import (
    DCT_FACTORS,
    EncodedJpeg,
    ImagesToModelInput,
    decoded,
    decoded_at,
    open_image,
    read_encoded,
    read_image,
    scaling_decoder,
    unreadable_image,
)
from accel_train.data.in_memory import augment_draws
from accel_train.data.registry import (
    DATASETS,
    SYNTHETIC_EVAL_SIZE,
    SYNTHETIC_TRAIN_SIZE,
    Data,
    FakeImages,
    given_normalization,
)
from accel_train.distributed.environment import launcher_environment
from accel_train.errors import DataNotFoundError

logger = logging.getLogger(__name__)

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DEFAULT_CROP_FRACTION = 0.875  # torchvision's evaluation: 224 px of 256


@DATASETS.register("imagefolder")
def imagefolder(cfg: DataConfig, train: bool, classes: list[str] | None = None) -> Data:
    """The user's own data: data.root/train/<class>/*.jpg, and data.root/test/ (or val/) the same way. An evaluation
    split's labels index `classes` (the run's) by its folders' names; None: the names of train/'s folders."""
    size = cfg.image_size or 224
    transform = imagefolder_transform(cfg, train)
    if cfg.synthetic:
        count = (cfg.train_subset or SYNTHETIC_TRAIN_SIZE) if train else (cfg.eval_subset or SYNTHETIC_EVAL_SIZE)
        dataset = FakeImages(count, image_size=(3, size, size), num_classes=10, transform=transform)
        return Data(dataset, 10, imagefolder_shape(cfg), [str(index) for index in range(10)],
                    finish=imagefolder_finish(cfg))
    root = Path(cfg.root)
    if train or classes is None:
        _imagefolder_split(root, not train)  # report a missing train or test folder before reading either
    if train:
        return training_split(cfg)
    return imagefolder_data(cfg, _imagefolder_split(root, train), transform, cfg.eval_subset,
                            classes=classes or training_classes(root))


def training_split(cfg: DataConfig) -> Data:
    """data.root/train, whether or not an evaluation split is there (bench --input, shards of the training split)."""
    return imagefolder_data(cfg, _imagefolder_split(Path(cfg.root), True), imagefolder_transform(cfg, True),
                            cfg.train_subset, augmenting=augments(cfg, True))


def training_classes(root: Path) -> list[str]:
    """The class names of root/train (its folders, sorted as ImageFolder sorts them): the run's classes."""
    train = _imagefolder_split(root, True)
    try:
        return torchvision.datasets.folder.find_classes(str(train))[0]
    except FileNotFoundError as err:
        raise DataNotFoundError(f"imagefolder: {err}; expected {train}/<class>/<images>") from None


def augments(cfg: DataConfig, train: bool) -> bool:
    """Whether the transforms of a split draw at random (only to augment the training split)."""
    return train and bool(cfg.augment or cfg.trivial_augment or cfg.random_erasing)


class ImageFolderByName(torchvision.datasets.ImageFolder):
    """ImageFolder whose labels index `classes` (the run's) by each class folder's name, not by the folder's place
    among its own: an evaluation split that lacks a class, or orders them otherwise, is labelled right."""

    def __init__(self, root: str, classes: list[str], **kwargs) -> None:
        self.run_classes = list(classes)
        super().__init__(root, **kwargs)

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        own, _ = super().find_classes(directory)
        indices = label_indices(own, self.run_classes, f"imagefolder: {directory}")
        return self.run_classes, dict(zip(own, indices))


def imagefolder_data(cfg: DataConfig, split_dir: Path, transform, limit: int | None, augmenting: bool = False,
                     classes: list[str] | None = None) -> Data:
    """An ImageFolder split; `classes`: the run's class names, which its labels index (None: its own folders')."""
    # JPEGs decoded by the transform, at their scale; either way no file larger than data.max_image_pixels decoded
    loader = functools.partial(read_encoded if decodes_scaled(cfg) else read_image, max_pixels=cfg.max_image_pixels)
    try:
        if classes is None:
            dataset = torchvision.datasets.ImageFolder(str(split_dir), transform=transform, loader=loader)
        else:
            dataset = ImageFolderByName(str(split_dir), classes, transform=transform, loader=loader)
    except FileNotFoundError as err:
        raise DataNotFoundError(f"imagefolder: {err}; expected {split_dir}/<class>/<images>") from None
    dataset.draws_from = augment_draws(augmenting)  # the generators our transforms draw from (KeyedSamples)
    classes = list(dataset.classes)
    if limit is not None:
        dataset = Subset(dataset, range(min(limit, len(dataset))))
    return Data(dataset, len(classes), imagefolder_shape(cfg), classes, finish=imagefolder_finish(cfg))


def imagefolder_transform(cfg: DataConfig, train: bool, normalization: tuple | None = None) -> v2.Compose:
    """ImageFolder's transforms, from a uint8 tensor (or a PIL image) to uint8 (3, size, size): scaled and normalised
    on the device by imagefolder_finish. Random erasing (data.random_erasing) erases normalised pixels, as timm does:
    where it is on, the training samples are normalised here, on the host, with the same operations."""
    size, mode = cfg.image_size or 224, interpolation_of(cfg)
    # The same draws, from a JPEG's header size where data.decode=scaled (the loader then gives EncodedJpeg)
    crop, resize = (RandomResizedCropAtScale, ResizeAtScale) if decodes_scaled(cfg) else \
        (v2.RandomResizedCrop, v2.Resize)
    if train:
        transform = [crop(size, interpolation=mode, antialias=True), v2.RandomHorizontalFlip()] \
            if cfg.augment else [resize(size, interpolation=mode, antialias=True), v2.CenterCrop(size)]
        transform += [v2.TrivialAugmentWide()] if cfg.trivial_augment else []  # on uint8, as it expects
    else:
        transform = [resize(evaluation_resize(cfg), interpolation=mode, antialias=True), v2.CenterCrop(size)]
    on_host = []
    if train and cfg.random_erasing:  # after normalising, as timm erases
        mean, std = imagefolder_normalization(cfg, normalization)
        on_host = [v2.ToDtype(torch.float32, scale=True), v2.Lambda(functools.partial(to_channels, channels=len(mean))),
                   v2.Normalize(mean, std), v2.RandomErasing(cfg.random_erasing)]
    return v2.Compose([v2.PILToTensor(), v2.RGB(), *transform, *on_host])


def decodes_scaled(cfg: DataConfig) -> bool:
    """Whether an ImageFolder's JPEGs are decoded at the scale their crop needs: data.decode=scaled, simplejpeg
    installed (else one note, and full size)."""
    if cfg.name != "imagefolder" or cfg.decode != "scaled":
        return False
    if scaling_decoder() is None:
        _note_full_size_decoding()
        return False
    return True


@functools.cache
def _note_full_size_decoding() -> None:
    if launcher_environment().is_reporting_process:
        logger.warning("data.decode=scaled: simplejpeg is not installed (pip install simplejpeg), so JPEGs are "
                       "decoded at full size, as data.decode=full does")


class RandomResizedCropAtScale(v2.RandomResizedCrop):
    """RandomResizedCrop that also takes an EncodedJpeg: its box drawn from the header's size by the same draws
    (get_params reads only the size), so the same box from the same sample key; then cut from a decode at the
    smallest DCT scale that keeps the box at least the output size on both sides, and resized as RandomResizedCrop
    resizes. Images and tensors go through RandomResizedCrop itself."""

    def forward(self, *inputs):
        if len(inputs) != 1 or not isinstance(inputs[0], EncodedJpeg):
            return super().forward(*inputs)
        jpeg = inputs[0]
        box = T.RandomResizedCrop.get_params(torch.empty(0, jpeg.height, jpeg.width), self.scale, self.ratio)
        factor = crop_factor(box, self.size)
        return v2.functional.resized_crop(decoded_at(jpeg, factor), *scaled_box(box, factor), list(self.size),
                                          interpolation=self.interpolation, antialias=self.antialias)


class ResizeAtScale(v2.Resize):
    """Resize (to a short side) that also takes an EncodedJpeg: decoded at the smallest DCT scale that keeps both
    sides at least those of Resize's output, then resized to exactly that output's size (from the header's size, as
    Resize computes it from a full-size decode). Images and tensors go through Resize itself."""

    def forward(self, *inputs):
        if len(inputs) != 1 or not isinstance(inputs[0], EncodedJpeg):
            return super().forward(*inputs)
        jpeg = inputs[0]
        height, width = short_side_resized(jpeg.height, jpeg.width, self.size[0])
        factor = resize_factor((jpeg.height, jpeg.width), (height, width))
        pixels = decoded_at(jpeg, factor)
        if factor == 1:
            return super().forward(pixels)
        return v2.functional.resize(pixels, [height, width], interpolation=self.interpolation,
                                    antialias=self.antialias)


def short_side_resized(height: int, width: int, short_side: int) -> tuple[int, int]:
    """The (height, width) Resize(short_side) gives an image of (height, width): the short side at `short_side`, the
    long one scaled and rounded down (torchvision's _compute_resized_output_size)."""
    short, long = sorted((height, width))
    long = int(short_side * long / short)
    return (long, short_side) if width <= height else (short_side, long)


def resize_factor(size: tuple[int, int], resized: tuple[int, int]) -> int:
    """The largest DCT factor (8, 4, 2, else 1) at which an image of `size` (height, width), decoded at that scale
    (ceil(side / factor) pixels), is at least `resized` on both sides: the resize after it then only shrinks."""
    return next((factor for factor in DCT_FACTORS if all(-(-side // factor) >= least
                                                         for side, least in zip(size, resized))), 1)


def crop_factor(box: tuple[int, int, int, int], size: tuple[int, int]) -> int:
    """The largest DCT factor (8, 4, 2, else 1) at which the crop box (top, left, height, width), cut at that scale
    (scaled_box), is at least `size` (height, width): the resize after it then only shrinks, as from full size."""
    for factor in DCT_FACTORS:
        _, _, height, width = scaled_box(box, factor)
        if height >= size[0] and width >= size[1]:
            return factor
    return 1


def scaled_box(box: tuple[int, int, int, int], factor: int) -> tuple[int, int, int, int]:
    """A crop box (top, left, height, width) in full-size pixels, in those of a decode at 1/factor: scaled pixel i
    holds full-size pixels [i * factor, (i + 1) * factor), so each edge divided by `factor`, to the nearest pixel."""
    top, left, height, width = box
    first_row, first_column = _nearest(top / factor), _nearest(left / factor)
    return (first_row, first_column, _nearest((top + height) / factor) - first_row,
            _nearest((left + width) / factor) - first_column)


def _nearest(value: float) -> int:
    return math.floor(value + 0.5)


def evaluation_resize(cfg: DataConfig) -> int:
    """The short side evaluation resizes to before its centre crop of image_size: image_size / data.crop_fraction
    (rounded down, as timm does), 256 for 224 by default."""
    return math.floor((cfg.image_size or 224) / (cfg.crop_fraction or DEFAULT_CROP_FRACTION))


def interpolation_of(cfg: DataConfig) -> v2.InterpolationMode:
    return v2.InterpolationMode(cfg.interpolation or "bilinear")


def crop_region_transform() -> v2.Compose:
    """Training's RandomResizedCrop and flip for raw pixels, without the resize: uint8 crops of any size, resized on
    the device by imagefolder_finish (Crops). The host only copies each crop's pixels."""
    return v2.Compose([v2.PILToTensor(), v2.RGB(), RandomCropRegion()])


class RandomCropRegion(torch.nn.Module):
    """RandomResizedCrop(antialias=True) then RandomHorizontalFlip (their default settings, as imagefolder_transform
    uses them), less the resize: the same draws from torch's generator in the same order, so the same crop and flip
    from the same sample key; the region is copied, the rest of the image left behind."""

    scale, ratio = [0.08, 1.0], [3 / 4, 4 / 3]

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        top, left, height, width = T.RandomResizedCrop.get_params(image, self.scale, self.ratio)
        region = image[..., top:top + height, left:left + width]
        return region.flip(-1) if torch.rand(1) < 0.5 else region.clone()  # RandomHorizontalFlip's own draw


def imagefolder_normalization(cfg: DataConfig, normalization: tuple | None = None) -> tuple[tuple, tuple]:
    """data.mean / data.std if given, else `normalization` (what shards of such a tree recorded), else ImageNet's,
    one value a channel the model is given (RGB images converted to as many: data.channels); none (0 and 1) with
    data.normalize=false."""
    channels = model_channels(cfg, 3, f"data.name={cfg.name}")
    if not cfg.normalize:
        return (0.0,) * channels, (1.0,) * channels
    return given_normalization(cfg, channels) or converted_normalization(*(normalization or (IMAGENET_MEAN,
                                                                                             IMAGENET_STD)), channels)


def imagefolder_shape(cfg: DataConfig) -> tuple[int, int, int]:
    """The shape of an ImageFolder-like sample as the model is given it."""
    size = cfg.image_size or 224
    return model_channels(cfg, 3, f"data.name={cfg.name}"), size, size


def imagefolder_finish(cfg: DataConfig, normalization: tuple | None = None) -> ImagesToModelInput:
    """How ImageFolder's uint8 batches (and crops of raw pixels) become the model's input on the device."""
    return ImagesToModelInput(*imagefolder_normalization(cfg, normalization), cfg.image_size or 224,
                              cfg.interpolation or "bilinear")


def load_image(path: str, reader: str = "imagefolder", max_pixels: int | None = MAX_IMAGE_PIXELS) -> Image.Image:
    """The image file at `path` as an RGB PIL image, as torchvision's loader gives it, once its header's size is held
    to `max_pixels` (data.max_image_pixels); a damaged or larger file named in one line (from a DataLoader worker
    too). The line starts with `reader`, what the user asked to read it (a dataset, or predict)."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise unreadable_image(path, reader, err.strerror or str(err)) from None
    with open_image(data, path, reader, max_pixels) as image:
        return decoded(image, path, reader)


def _imagefolder_split(root: Path, train: bool) -> Path:
    names = ("train",) if train else ("test", "val", "validation")
    for name in names:
        if (root / name).is_dir():
            return root / name
    raise DataNotFoundError(
        f"imagefolder: no {' / '.join(names)} folder in data.root={root}; expected "
        f"{root}/train/<class>/<images> and {root}/test/<class>/<images>"
    )


def own_validation_folder(cfg: DataConfig) -> Path | None:
    """ImageFolder's val/ (or validation/) is a validation split of its own when test/ is there too."""
    root = Path(cfg.root)
    if cfg.name != "imagefolder" or cfg.synthetic or not (root / "test").is_dir():
        return None
    return next((root / name for name in ("val", "validation") if (root / name).is_dir()), None)
