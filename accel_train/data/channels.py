"""data.channels: images of one channel count made into the input of a model that takes another, where they are
normalised (on the device, or by Normalize on the host), so every data path, evaluation and predict convert alike.

One grey channel is repeated into as many as the model takes (a grey image as RGB, as PIL's convert("RGB") makes it:
a pretrained stem sees what it saw of grey photographs, normalised by its own per-channel mean and std), and three
into one by their luma (torchvision's rgb_to_grayscale: ITU-R 601-2). Repeating costs the stem its two extra input
channels and nothing else: 2.5% of resnet18's FLOPs at 28 px (forward and backward). The model is left as it is
built, whatever its first layer; a timm model can build its stem for the data's channels instead
(model.args.in_chans, timm adapting pretrained weights).
"""

from __future__ import annotations

import torch

from accel_train.config import DataConfig
from accel_train.errors import UserError


def model_channels(cfg: DataConfig, own: int, where: str) -> int:
    """The channels the model is given: data.channels, or the images' `own` where it is unset; one line where the
    images cannot be converted to them."""
    channels = cfg.channels or own
    if not convertible(own, channels):
        raise UserError(f"data.channels={channels} (the channels the model takes): {where} gives {own}-channel "
                        f"images, and only 1 channel converts into any other count (repeated), 3 into 1 (their "
                        f"luma); choose a model that takes {own} (a timm model: model.args.in_chans={own}) and set "
                        f"data.channels={own}")
    return channels


def convertible(own: int, channels: int) -> bool:
    return own == channels or own == 1 or (own, channels) == (3, 1)


def to_channels(images: torch.Tensor, channels: int) -> torch.Tensor:
    """Float images (..., C, H, W) with `channels` channels: as they are, the one channel repeated (a view), or
    their luma."""
    own = images.shape[-3]
    if own == channels:
        return images
    if own == 1:
        return images.expand(*images.shape[:-3], channels, *images.shape[-2:])
    from torchvision.transforms.v2 import functional

    return functional.rgb_to_grayscale(images, num_output_channels=1)


def converted_normalization(mean, std, channels: int) -> tuple[tuple, tuple]:
    """A dataset's own mean and std for its images converted to `channels`: repeated, or their luma (exact for the
    mean; for the std, that of channels perfectly correlated, which an RGB image's nearly are)."""
    if len(mean) == channels:
        return tuple(mean), tuple(std)
    values = torch.tensor([list(mean), list(std)], dtype=torch.float64).view(2, -1, 1, 1)
    converted = to_channels(values, channels).flatten(1)
    return tuple(converted[0].tolist()), tuple(converted[1].tolist())
