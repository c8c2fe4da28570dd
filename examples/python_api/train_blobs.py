"""Your own script with the Python API: the model and the data are Python objects, the recipe gives the settings.

It runs unchanged under any launcher:

    python examples/python_api/train_blobs.py runs/blobs
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml examples/python_api/train_blobs.py runs/blobs
    torchrun --nproc_per_node 2 examples/python_api/train_blobs.py runs/blobs

and evaluates a run's weights on the same evaluation data, at any world size:

    python examples/python_api/train_blobs.py --evaluate runs/blobs

Every process runs the whole script, so it builds the same data and model on each (seeded).
"""

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

import accel_train

SETTINGS = str(Path(__file__).with_name("blobs.yaml"))


class Blobs(Dataset):
    """Points scattered around three centres in the plane, labelled by their centre."""

    classes = ["north", "south-west", "south-east"]  # accel-train takes the class names from here

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        centres = torch.tensor([[0.0, 2.0], [-1.7, -1.0], [1.7, -1.0]])
        self.labels = torch.randint(0, 3, (size,), generator=generator)
        self.points = centres[self.labels] + 0.9 * torch.randn(size, 2, generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.points[index], int(self.labels[index])


def new_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 3))


def main(argv: list[str]) -> dict:
    eval_data = Blobs(301, seed=1)  # 301 samples: split evenly across neither 2 nor 3 processes
    if argv[:1] == ["--evaluate"]:
        return accel_train.evaluate(SETTINGS, argv[1], argv[2:], model=new_model(), eval_dataset=eval_data)
    return accel_train.train(SETTINGS, [f"output_dir={argv[0]}", *argv[1:]], model=new_model(),
                             train_dataset=Blobs(2000, seed=0), eval_dataset=eval_data)


if __name__ == "__main__":
    metrics = main(sys.argv[1:])
    from accelerate import PartialState

    if PartialState().is_main_process:  # every process has the metrics; one prints them
        print(json.dumps(metrics))
