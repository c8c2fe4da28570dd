"""MixUp and CutMix on the device batches (train.mixup_alpha, train.cutmix_alpha), as timm and torchvision do them.

Written here rather than taken from torchvision.transforms.v2.MixUp / CutMix because those draw from the global
RNG and mix each sample with its neighbour in the process's own batch (a roll by one): what a sample is mixed
with, and how, would depend on which process holds it and on when it is loaded. Here the draws of a micro-batch
come from a generator seeded by (seed, epoch, micro-batch number), which every process knows alike, and
sample 2k is mixed with sample 2k+1 of the global batch, a pair that stays on one process whenever each
process's share is even. So mixing is the same at any world size, and a resumed epoch mixes as the
uninterrupted one did. All draws are made on the host: mixing adds no device-to-host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BatchMix:
    """What was drawn for one micro-batch: whether it is mixed, by CutMix or MixUp, with what weight and box."""

    weight: float  # of each sample's own image and label (1: not mixed)
    box: tuple[int, int, int, int] | None = None  # CutMix: rows y1:y2 and columns x1:x2 come from the partner


class BatchMixer:
    def __init__(self, num_classes: int, seed: int, mixup_alpha: float, cutmix_alpha: float, mix_prob: float = 1.0,
                 switch_prob: float = 0.5) -> None:
        self.num_classes, self.seed = num_classes, seed
        self.mixup_alpha, self.cutmix_alpha = mixup_alpha, cutmix_alpha
        self.mix_prob, self.switch_prob = mix_prob, switch_prob

    def draw(self, epoch: int, number: int, height: int, width: int) -> BatchMix:
        rng = np.random.default_rng([self.seed, epoch, number])
        mixed, switch, (row, column) = rng.random(), rng.random(), rng.random(2)
        if mixed >= self.mix_prob:
            return BatchMix(1.0)
        use_cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha == 0 or switch < self.switch_prob)
        alpha = self.cutmix_alpha if use_cutmix else self.mixup_alpha
        weight = float(rng.beta(alpha, alpha))
        if not use_cutmix:
            return BatchMix(weight)
        # torchvision's CutMix box: centred at a uniform point, sides sqrt(1 - weight) of the image's, clipped.
        half = 0.5 * np.sqrt(1.0 - weight)
        centre_y, centre_x = int(row * height), int(column * width)
        y1, y2 = max(centre_y - int(half * height), 0), min(centre_y + int(half * height), height)
        x1, x2 = max(centre_x - int(half * width), 0), min(centre_x + int(half * width), width)
        return BatchMix(1.0 - (y2 - y1) * (x2 - x1) / (height * width), (y1, y2, x1, x2))

    def __call__(self, batch, epoch: int, number: int):
        """(images, labels) -> (mixed images, label probabilities), or the batch itself when it is not mixed."""
        images, labels = batch
        mix = self.draw(epoch, number, images.shape[-2], images.shape[-1])
        if mix.weight == 1.0:
            return batch
        count = images.shape[0]
        # an odd share's last sample stays itself (a clamp, not a masked write: that would read the mask on the host)
        partner = (torch.arange(count, device=images.device) ^ 1).clamp_(max=count - 1)
        targets = F.one_hot(labels, self.num_classes).to(torch.float32)
        targets = mix.weight * targets + (1.0 - mix.weight) * targets[partner]
        if mix.box is None:
            return images * mix.weight + images[partner] * (1.0 - mix.weight), targets
        y1, y2, x1, x2 = mix.box
        images = images.clone()
        images[..., y1:y2, x1:x2] = images[partner][..., y1:y2, x1:x2]
        return images, targets
