"""How one image file becomes a model input, as the recipe's evaluation data would give it: what accel-train
predict applies to each file."""

from __future__ import annotations

from collections.abc import Callable

import torch
from PIL import Image
from torchvision.transforms import v2

from accel_train.config import DataConfig
from accel_train.data.imagefolder import imagefolder_finish, imagefolder_shape, imagefolder_transform
from accel_train.data.in_memory import to_model_input
from accel_train.data.torchvision_sets import SOURCES, normalization
from accel_train.errors import UserError
from accel_train.import_paths import import_object, is_import_path, source_of


def image_converter(cfg: DataConfig) -> tuple[Callable[[Image.Image], torch.Tensor], tuple[int, ...] | None]:
    """How evaluation turns one image into the model's input (channels, size, normalisation), and that input's
    shape where it is known without an image: what accel-train predict applies to each file."""
    if cfg.name == "imagefolder" or source_of(cfg.name) == "hf":  # the evaluation transform, then the device's
        # scaling, channels and normalisation, per image
        transform, finish = imagefolder_transform(cfg, train=False), imagefolder_finish(cfg)
        return (lambda image: finish.images(transform(image))), imagefolder_shape(cfg)
    if is_import_path(cfg.name):
        return user_image_transform(cfg), None
    if cfg.name == "shards":
        from accel_train.data.shards.dataset import image_converter as shards_converter

        return shards_converter(cfg)
    if cfg.name not in SOURCES:
        raise UserError(f"predict reads image files as the dataset would give them to the model; data.name="
                        f"{cfg.name} is not a dataset of the registry (mnist, fashion_mnist, cifar10, stl10, "
                        "imagefolder) nor one by import path")
    source = SOURCES[cfg.name]
    channels, height, width = source.shape
    size = cfg.image_size or width
    mean, std = (torch.tensor(values).view(1, -1, 1, 1) for values in normalization(cfg, source))

    def convert(image: Image.Image) -> torch.Tensor:
        # As the dataset's own images: its channels at its own resolution, then the eval data's resize, scaling and
        # the channels the model is given (as many as mean has values).
        image = image.convert("L" if channels == 1 else "RGB")
        if image.size != (width, height):
            image = image.resize((width, height), Image.Resampling.BILINEAR)
        return to_model_input(v2.functional.pil_to_tensor(image)[None], size, mean, std)[0]

    return convert, (mean.shape[1], size, size)


def user_image_transform(cfg: DataConfig) -> Callable[[Image.Image], torch.Tensor]:
    """data.image_transform, or the `transform` of the evaluation split of a dataset by import path: a callable that
    takes a PIL image, as torchvision's datasets have it."""
    if cfg.image_transform:
        transform = import_object(cfg.image_transform, "data.image_transform")
        if not callable(transform):
            raise UserError(f"data.image_transform={cfg.image_transform}: found {type(transform).__name__}, expected a "
                            "function or a callable object that takes a PIL image")
        return transform
    from accel_train.data.user import user_dataset, user_function

    evaluated = user_dataset(cfg, False, user_function(cfg)).dataset
    transform = getattr(evaluated, "transform", None)
    if not callable(transform):
        raise UserError(f"predict: data.name={cfg.name} is a dataset by import path whose evaluation split has no "
                        "`transform` to turn an image file into the model's input; set data.image_transform="
                        "module:function (a PIL image -> the input tensor), or give the dataset a `transform` "
                        "attribute as torchvision's datasets have")
    return transform
