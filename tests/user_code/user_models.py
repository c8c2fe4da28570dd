"""User code for the import-path tests, good and deliberately broken (test fixtures, not examples)."""

import os
import random
import threading
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import accel_train


class TinyNet(nn.Module):
    def __init__(self, num_classes: int, image_shape: tuple, hidden: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(image_shape).prod()), hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x)


class DropoutNet(nn.Module):
    """A user's net with dropout of every kind torch has (Dropout2d, AlphaDropout, Dropout) and, with `functional`,
    dropout drawn inside its forward (F.dropout), which cannot be keyed by sample."""

    def __init__(self, num_classes: int, image_shape: tuple, functional: float = 0.0) -> None:
        super().__init__()
        channels, height, width = image_shape
        self.features = nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1), nn.ReLU(), nn.Dropout2d(0.2),
                                      nn.AvgPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * (height // 2) * (width // 2), 32), nn.SELU(),
                                  nn.AlphaDropout(0.1), nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.3),
                                  nn.Linear(32, num_classes))
        self.functional = functional

    def forward(self, x):
        x = self.features(x)
        if self.functional:
            x = torch.nn.functional.dropout(x, self.functional, self.training)
        return self.head(x)


def zoo_model(model_name: str, **kwargs) -> nn.Module:
    """A zoo's factory (timm's create_model): a model by name, the rest of its keywords passed on to the model's
    constructor, which takes num_classes and no image_shape."""
    def constructor(num_classes: int = 1000, width: int = 8) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.LazyLinear(width), nn.ReLU(), nn.Linear(width, num_classes))
    return {"tiny": constructor}[model_name](**kwargs)


def weights_from_the_network(num_classes: int) -> nn.Module:
    """A model whose pretrained weights are fetched as it is made, on a machine without the network."""
    raise ConnectionError("Couldn't reach 'tiny/weights' on the Hub")


def needs_depth(num_classes: int, depth: int) -> nn.Module:
    return nn.Linear(depth, num_classes)


def hub_dataset(train: bool, path: str = "mnist"):
    """A dataset loader that reaches for the network (datasets' load_dataset offline)."""
    raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")


class FirstSampleFails(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        raise ValueError(f"no sample {index}: the file list is empty")


def first_sample_fails(train: bool) -> Dataset:
    return FirstSampleFails()


def not_a_module(num_classes: int, image_shape: tuple) -> list:
    return [num_classes, image_shape]


def points(train: bool, size: int = 30) -> TensorDataset:
    generator = torch.Generator().manual_seed(0 if train else 1)
    inputs = torch.randn(size, 1, 4, 4, generator=generator)
    return TensorDataset(inputs, torch.randint(0, 3, (size,), generator=generator))


class DrawingPoints(Dataset):
    """A transform that draws from torch's, Python's and numpy's global random generators, as augmentation does:
    sample i is (i / size, a torch draw, a `random` draw, a numpy draw) and its label is i."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        draws = [torch.rand(()).item(), random.random(), np.random.random_sample()]
        return torch.tensor([index / self.size, *draws]), index


def drawing_points(train: bool, size: int = 24) -> DrawingPoints:
    return DrawingPoints(size if train else 8)


class BlockingPoints(Dataset):
    """points(), except that the training set blocks forever in __getitem__ on purpose: at the call `block` names
    for this process, "PROCESS@CALL" (its CALL-th sample; evaluation does not count), one per start of the run,
    comma-separated (start N: the launcher's restart N; no block past the last). As it blocks, it appends
    "RESTART TIME PID" to the file `note` (PID: the process that blocks, a DataLoader worker's own with
    data.num_workers > 0). A stuck process, for tests/distributed/test_a_stuck_process_is_named.py."""

    def __init__(self, train: bool, size: int, block: str, note: str) -> None:
        self.samples, self.train, self.note, self.calls = points(train, size), train, note, 0
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        plans = [plan.split("@") for plan in block.split(",") if plan]
        process, call = plans[self.restart] if self.restart < len(plans) else (None, None)
        self.block_at = int(call) if process is not None and int(process) == int(os.environ.get("RANK", 0)) else None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        self.calls += self.train
        if self.calls == self.block_at:
            with open(self.note, "a") as note:
                note.write(f"{self.restart} {time.time()} {os.getpid()}\n")
            threading.Event().wait()  # forever: a deadlock, a read that never returns
        return self.samples[index]


def blocking_points(train: bool, size: int = 30, block: str = "", note: str = "") -> BlockingPoints:
    return BlockingPoints(train, size, block, note)


def no_train_argument(size: int = 30) -> TensorDataset:
    return points(True, size)


def returns_a_generator(train: bool):
    return (index for index in range(3))


def float_labels(train: bool) -> TensorDataset:
    return TensorDataset(torch.randn(10, 4), torch.randn(10))


class NotATask:
    pass


class HalfTask(accel_train.Task):
    def training_step(self, model, batch):
        return {"loss": model(batch[0]).sum()}


NUMBER = 3


def _to_input(image):
    """A PIL image -> a 3x16x16 float tensor: how these images become a model's input."""
    from torchvision.transforms import v2

    return v2.Compose([v2.PILToTensor(), v2.RGB(), v2.Resize((16, 16)), v2.ToDtype(torch.float32, scale=True)])(image)


def photos(train: bool, size: int = 48, transform: bool = True):
    """FakeData of 3 classes as PIL images, each turned into an input by its `transform`, as torchvision's datasets
    do (no `classes`: predict labels them by index); without `transform` a dataset predict cannot read files for."""
    import torchvision

    dataset = torchvision.datasets.FakeData(size if train else 24, image_size=(3, 20, 20), num_classes=3,
                                            transform=_to_input, random_offset=0 if train else 1000)
    if not transform:
        return TensorDataset(torch.stack([dataset[i][0] for i in range(len(dataset))]),
                             torch.tensor([dataset[i][1] for i in range(len(dataset))]))
    return dataset


def to_input(image):
    return _to_input(image)
