"""Where a dataset's finish runs (uint8 batches made into the model's input: scaled, normalised, crops resized):
chosen from the device the run trains on. On a CPU with DataLoader workers, in the workers (batches arrive finished,
the main process never finishes one); on a GPU or any other device, and without workers, where the batch is
received. The same inputs bit for bit either way, so the same run."""

import os

import pytest
import torch
from safetensors.torch import load_file

from accel_train.config import DataConfig
from accel_train.data import Data, make_loader, received_finish
from accel_train.data.decode import ImagesToModelInput, float_batch_like, model_input
from accel_train.data.loaders import FinishingCollate
from accel_train.distributed.devices import finish_runs_in_workers
from support.commands import train_in_process
from support.images import noise_jpeg_tree
from support.locations import USER_RECIPE
from support.runs import read_metrics

CPU = torch.device("cpu")


class ProcessesThatFinish(ImagesToModelInput):
    """The finish, writing the id of each process it runs in to a file (a worker's memory is its own)."""

    def __init__(self, record) -> None:
        super().__init__((0.4, 0.5, 0.6), (0.2, 0.25, 0.3))
        self.record = str(record)

    def __call__(self, batch):
        with open(self.record, "a") as file:
            file.write(f"{os.getpid()}\n")
        return super().__call__(batch)


class Pixels(torch.utils.data.Dataset):
    draws_from = frozenset()  # nothing drawn: no seeding

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int):
        pixels = torch.randint(0, 256, (3, 6, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(index))
        return pixels, index


def finished_batches(record, workers: int, device=CPU) -> list:
    """The batches a consumer receives from make_loader, through the finish received_finish gives it."""
    data = Data(Pixels(), 24, (3, 6, 6), finish=ProcessesThatFinish(record))
    cfg = DataConfig(num_workers=workers)
    loader = make_loader(data, cfg, 8, False, device)
    return [model_input(received_finish(data, cfg, device), batch) for batch in loader]


def processes_in(record) -> set[int]:
    return {int(line) for line in record.read_text().split()} if record.exists() else set()


def test_a_cpu_run_with_workers_gets_finished_batches_from_its_loader_and_the_main_process_never_finishes(tmp_path):
    in_workers, in_main = tmp_path / "workers", tmp_path / "main"
    batches = finished_batches(in_workers, workers=2)
    assert processes_in(in_workers) and os.getpid() not in processes_in(in_workers)
    unfinished = finished_batches(in_main, workers=0)  # no worker: the consumer finishes them, here
    assert processes_in(in_main) == {os.getpid()}
    assert len(batches) == len(unfinished) == 3
    for finished, reference in zip(batches, unfinished):
        assert finished[0].dtype == torch.float32 and torch.equal(finished[0], reference[0])
        assert torch.equal(finished[1], reference[1])


class SharedOrNot(torch.utils.data.Dataset):
    """Whether a finished batch's tensor is made in shared memory where this sample is loaded."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int):
        return float_batch_like(torch.zeros(2, 3, 4, 4, dtype=torch.uint8)).is_shared()


def test_a_workers_finished_batch_is_made_in_shared_memory_and_the_main_processes_is_not():
    """So a worker's finished batch (4 bytes a pixel) reaches the main process without a copy into shared memory."""
    in_workers = torch.utils.data.DataLoader(SharedOrNot(), batch_size=None, num_workers=1)
    assert list(in_workers) == [True, True]
    assert SharedOrNot()[0] is False


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "mps", "xpu"])
def test_on_a_gpu_or_any_device_but_the_cpu_the_device_finishes_what_the_workers_load(device, tmp_path):
    """The loader is only built (a device this machine may not have is never reached): its collation leaves the
    batch as loaded, and the consumer is given the data's finish."""
    assert not finish_runs_in_workers(torch.device(device), 2)
    data = Data(Pixels(), 24, (3, 6, 6), finish=ProcessesThatFinish(tmp_path / "record"))
    cfg = DataConfig(num_workers=2)
    assert received_finish(data, cfg, torch.device(device)) is data.finish
    assert not isinstance(make_loader(data, cfg, 8, False, torch.device(device)).collate_fn, FinishingCollate)


def test_on_a_cpu_the_workers_finish_where_there_are_some_and_the_main_process_where_there_are_none():
    assert finish_runs_in_workers(CPU, 1) and finish_runs_in_workers(torch.device("cpu"), 8)
    assert not finish_runs_in_workers(CPU, 0)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> str:
    """An ImageFolder of 24 noise JPEGs of 20 px, one a class, train and test."""
    return noise_jpeg_tree(tmp_path_factory.mktemp("tree"))


def test_a_cpu_run_with_workers_trains_alike_with_the_finish_in_its_workers_or_in_its_main_process(
        tree, tmp_path, monkeypatch):
    """An ImageFolder run augmented (random crops resized, flips) with 2 workers: the same losses, metrics and
    weights bit for bit, whichever process finishes its batches."""
    import accel_train.data.loaders as loaders

    finishing, real = tmp_path / "finishing", ImagesToModelInput.__call__

    def recorded(self, batch):
        with open(finishing, "a") as file:
            file.write(f"{os.getpid()}\n")
        return real(self, batch)

    monkeypatch.setattr(ImagesToModelInput, "__call__", recorded)
    args = ["data.name=imagefolder", "data.synthetic=false", "data.augment=true", "data.image_size=16",
            f"data.root={tree}", "data.num_workers=2", "train.batch_size=8", "train.epochs=2", "train.max_steps=null",
            "train.eval_batch_size=8", "seed=1", "train.plot=false"]
    train_in_process(USER_RECIPE, *args, f"output_dir={tmp_path / 'in_workers'}")
    assert processes_in(finishing) and os.getpid() not in processes_in(finishing)
    finishing.unlink()
    monkeypatch.setattr(loaders, "finish_runs_in_workers", lambda device, workers: False)
    train_in_process(USER_RECIPE, *args, f"output_dir={tmp_path / 'in_main'}")
    assert processes_in(finishing) == {os.getpid()}
    runs = [tmp_path / "in_workers", tmp_path / "in_main"]
    for split in ("train", "test"):
        lines = [[{key: value for key, value in line.items() if not key.endswith(("_s", "per_s", "wait", "time"))}
                  for line in read_metrics(run, split)] for run in runs]
        assert lines[0] and lines[0] == lines[1]
    weights = [load_file(str(run / "model.safetensors")) for run in runs]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
