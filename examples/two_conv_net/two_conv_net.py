"""The classic two-convolution network of the PyTorch MNIST example, as your own model file.

The recipe beside this file names it by import path (`model.name: two_conv_net:TwoConvNet`). accel-train calls
it with `num_classes` and `image_shape` (the shape of one input sample), which it takes, plus `model.args`.
"""

import torch
import torch.nn.functional as F
from torch import nn


class TwoConvNet(nn.Module):
    def __init__(self, num_classes: int, image_shape: tuple[int, int, int], width: int = 32,
                 dropout: float = 0.25) -> None:
        super().__init__()
        channels, height, side = image_shape
        self.conv1 = nn.Conv2d(channels, width, 3)
        self.conv2 = nn.Conv2d(width, 2 * width, 3)
        self.dropout1, self.dropout2 = nn.Dropout(dropout), nn.Dropout(2 * dropout)
        self.fc1 = nn.Linear(2 * width * ((height - 4) // 2) * ((side - 4) // 2), 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(images)))), 2)
        x = F.relu(self.fc1(torch.flatten(self.dropout1(x), 1)))
        return self.fc2(self.dropout2(x))
