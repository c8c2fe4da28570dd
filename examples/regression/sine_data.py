"""Your own dataset, of in-memory tensors rather than images: noisy samples of y = sin(3x) + x^2 / 2 on [-2, 2].

The recipe beside this file names it by import path (`data.name: sine_data:dataset`); accel-train calls it
as dataset(train=True) and dataset(train=False), with `data.args` as keyword arguments. It returns the same
tensors on every process (a seeded generator), as every dataset must.
"""

import torch
from torch.utils.data import TensorDataset


def dataset(train: bool, size: int = 4096, noise: float = 0.1, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(2 * seed + (0 if train else 1))  # train and eval samples differ
    x = torch.rand(size, 1, generator=generator) * 4 - 2
    y = torch.sin(3 * x) + x.pow(2) / 2 + noise * torch.randn(size, 1, generator=generator)
    return TensorDataset(x, y)
