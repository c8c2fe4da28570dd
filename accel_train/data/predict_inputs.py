"""How one image file becomes a model input, as the recipe's evaluation data would give it: what accel-train
predict applies to each file."""

from __future__ import annotations

from collections.abc import Callable

import torch
from PIL import Image
from torchvision.transforms import v2

from accel_train.config import DataConfig
from accel_train.data.imagefolder import imagefolder_transform
from accel_train.data.in_memory import to_model_input
from accel_train.data.torchvision_sets import SOURCES, normalization
from accel_train.errors import UserError


def image_converter(cfg: DataConfig) -> tuple[Callable[[Image.Image], torch.Tensor], tuple[int, ...]]:
    """How evaluation turns one image into the model's input (channels, size, normalisation), and that input's
    shape, without loading the dataset: what accel-train predict applies to each file."""
    if cfg.name == "imagefolder":
        size = cfg.image_size or 224
        return imagefolder_transform(cfg, train=False), (3, size, size)
    if cfg.name not in SOURCES:
        raise UserError(f"predict reads image files as a dataset of the registry does (mnist, fashion_mnist, "
                        f"cifar10, stl10, imagefolder); data.name={cfg.name} is not one: call accel_train.predict "
                        "from Python with your own inputs")
    source = SOURCES[cfg.name]
    channels, height, width = source.shape
    size = cfg.image_size or width
    mean, std = (torch.tensor(values).view(1, -1, 1, 1) for values in normalization(cfg, source))

    def convert(image: Image.Image) -> torch.Tensor:
        # As the dataset's own images: its channels at its own resolution, then the eval data's resize and scaling.
        image = image.convert("L" if channels == 1 else "RGB")
        if image.size != (width, height):
            image = image.resize((width, height), Image.Resampling.BILINEAR)
        return to_model_input(v2.functional.pil_to_tensor(image)[None], size, mean, std)[0]

    return convert, (channels, size, size)
