"""What a model expects of its inputs (a Hub model's image processor, timm's pretrained_cfg, torchvision's weights):
the defaults of the data keys that describe them. A key the user set wins; what is taken is recorded in config.yaml,
so eval, predict and a resume see the inputs training saw."""

from __future__ import annotations

from dataclasses import dataclass

from accel_train.config import DataConfig
from accel_train.errors import UserError


@dataclass(frozen=True)
class InputDefaults:
    image_size: int | None = None
    mean: list[float] | None = None
    std: list[float] | None = None
    crop_fraction: float | None = None  # evaluation: the short side resized to image_size / crop_fraction, then cropped
    interpolation: str | None = None  # bilinear or bicubic
    channels: int | None = None  # the image channels the model takes (None: those of the data, which it is built for)


def take_defaults(data: DataConfig, defaults: InputDefaults) -> None:
    """Each data key the user left unset, from `defaults` where they say it; mean and std only together, only where
    both are unset, and only with a value for each channel the model is given."""
    for key in ("image_size", "crop_fraction", "interpolation", "channels"):
        if getattr(data, key) is None and getattr(defaults, key) is not None:
            setattr(data, key, getattr(defaults, key))
    if data.mean is None and data.std is None and defaults.mean is not None and defaults.std is not None and \
            len(defaults.mean) == (data.channels or len(defaults.mean)):
        data.mean, data.std = list(defaults.mean), list(defaults.std)


def check_channels(data: DataConfig, defaults: InputDefaults, model: str) -> None:
    """data.channels set to a count the model does not take: one line, before anything loads."""
    if defaults.channels is not None and data.channels != defaults.channels:
        timm = " (timm builds its stem for N: model.args.in_chans=N)" if model.startswith("timm:") else ""
        raise UserError(f"data.channels={data.channels}: model.name={model} takes {defaults.channels}-channel "
                        f"images{timm}; leave data.channels unset, and images of another count are converted to "
                        f"{defaults.channels} where they are normalised")
