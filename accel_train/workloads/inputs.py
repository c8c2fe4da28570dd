"""What a model expects of its inputs (a Hub model's image processor, timm's pretrained_cfg, torchvision's weights):
the defaults of the data keys that describe them. A key the user set wins; what is taken is recorded in config.yaml,
so eval, predict and a resume see the inputs training saw."""

from __future__ import annotations

from dataclasses import dataclass

from accel_train.config import DataConfig


@dataclass(frozen=True)
class InputDefaults:
    image_size: int | None = None
    mean: list[float] | None = None
    std: list[float] | None = None
    crop_fraction: float | None = None  # evaluation: the short side resized to image_size / crop_fraction, then cropped
    interpolation: str | None = None  # bilinear or bicubic


def take_defaults(data: DataConfig, defaults: InputDefaults) -> None:
    """Each data key the user left unset, from `defaults` where they say it; mean and std only together, and only
    where both are unset."""
    for key in ("image_size", "crop_fraction", "interpolation"):
        if getattr(data, key) is None and getattr(defaults, key) is not None:
            setattr(data, key, getattr(defaults, key))
    if data.mean is None and data.std is None and defaults.mean is not None and defaults.std is not None:
        data.mean, data.std = list(defaults.mean), list(defaults.std)
