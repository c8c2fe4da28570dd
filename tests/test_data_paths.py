"""Contracts of the on-device data path: same samples, same shards, same metrics as a per-sample DataLoader."""

import pytest
import torch
from accelerate.data_loader import prepare_data_loader

from accel_train.config import DataConfig
from accel_train.workloads.data import Data, InMemoryImages, make_loader, random_crop_flip, sample_keys
from conftest import launch, read_metrics

CPU = torch.device("cpu")


def _images(count=37, channels=3, side=8, augment=False):
    pixels = torch.randint(0, 256, (count, channels, side, side), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    # label = sample index, so a batch's labels say exactly which samples it holds
    return Data(InMemoryImages(pixels, torch.arange(count), (0.5,) * channels, (0.25,) * channels, augment), 10,
                     (channels, side, side))


def _loaders(data, batch, train):
    return [make_loader(data, DataConfig(on_device=on_device, num_workers=0), batch, train, CPU)
            for on_device in (True, False)]


def test_random_crop_flip_gives_each_image_a_padded_crop_possibly_mirrored():
    images = torch.randint(1, 256, (64, 3, 6, 6), dtype=torch.uint8)
    out = random_crop_flip(images, 2, sample_keys(torch.arange(64), epoch=0, seed=0))
    padded = torch.nn.functional.pad(images, (2,) * 4)
    flipped = 0
    for source, result in zip(padded, out):
        crops = [source[:, t:t + 6, left:left + 6] for t in range(5) for left in range(5)]
        plain = any(torch.equal(result, crop) for crop in crops)
        mirrored = any(torch.equal(result, crop.flip(-1)) for crop in crops)
        assert plain or mirrored
        flipped += mirrored and not plain
    assert 10 < flipped < 54  # about half


def test_a_samples_crop_and_flip_depend_on_seed_epoch_and_index_only():
    # Not on which batch, process or moment loads it: resumed runs and other world sizes crop identically.
    dataset = _images(augment=True).dataset
    dataset.set_epoch(3, seed=5)
    first, _ = dataset.__getitems__([4, 9, 20])
    again, _ = dataset.__getitems__([20, 4])
    assert torch.equal(first[0], again[1]) and torch.equal(first[2], again[0])
    dataset.set_epoch(4, seed=5)
    assert not torch.equal(dataset.__getitems__([4, 9, 20])[0], first)
    dataset.set_epoch(3, seed=6)
    assert not torch.equal(dataset.__getitems__([4, 9, 20])[0], first)


def test_device_batches_are_bit_identical_to_per_sample_totensor_normalize():
    for channels in (1, 3):
        device_path, per_sample = _loaders(_images(channels=channels), batch=10, train=False)
        pairs = list(zip(device_path, per_sample))
        assert len(pairs) == 4
        for (x1, y1), (x2, y2) in pairs:
            assert torch.equal(x1, x2) and torch.equal(y1, y2)


@pytest.mark.parametrize("processes", [1, 2, 3])
@pytest.mark.parametrize("train", [True, False])
def test_accelerate_gives_every_process_the_same_samples_on_both_paths(processes, train):
    # 37 samples, global batch 12: a ragged last eval batch that even_batches pads differently per world size
    data = _images(augment=train)
    for rank in range(processes):
        shards = []
        for loader in _loaders(data, batch=12, train=train):
            prepared = prepare_data_loader(loader, CPU, num_processes=processes, process_index=rank, split_batches=True,
                                           put_on_device=True, use_seedable_sampler=True, data_seed=7)
            prepared.set_epoch(1)
            shards.append([labels.tolist() for _, labels in prepared])
        assert shards[0] == shards[1]
        assert len(shards[0]) == (3 if train else 4)


SYNTHETIC = ["cifar10_resnet50", "model.name=resnet18", "data.synthetic=true", "data.augment=false",
             "data.train_subset=48",
             "data.eval_subset=101", "train.batch_size=12", "train.eval_batch_size=20", "train.max_steps=3",
             "train.log_every_steps=1", "train.warmup_steps=0", "data.num_workers=0", "train.plot=false"]


def test_device_path_trains_and_evaluates_like_the_dataloader_path_at_2_processes(tmp_path):
    # BatchNorm normalises over each process's own shard (no SyncBatchNorm on CPU), so the losses and the
    # final metrics only agree if every process got the same samples on both paths. 2 processes do not split
    # the 101 eval samples evenly; the shards at 1, 2 and 3 processes are checked above, in this process.
    processes = 2
    for on_device in ("true", "false"):
        args = ["train", *SYNTHETIC, f"data.on_device={on_device}", f"output_dir={tmp_path / on_device}"]
        launch(processes, *args)
    device_path, per_sample = (read_metrics(tmp_path / name, "train") for name in ("true", "false"))
    assert [line["step"] for line in device_path] == [line["step"] for line in per_sample] == [1, 2, 3]
    for a, b in zip(device_path, per_sample):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    (eval_device,), (eval_per_sample,) = (read_metrics(tmp_path / name, "test") for name in ("true", "false"))
    assert eval_device["num_samples"] == eval_per_sample["num_samples"] == 101
    assert eval_device["correct"] == eval_per_sample["correct"]
    assert eval_device["loss"] == pytest.approx(eval_per_sample["loss"], rel=1e-5)


# (cores this process may use, processes on the machine) -> the workers data.num_workers=auto gives each process
@pytest.mark.parametrize("cores, processes, workers", [(2, 1, 2), (2, 2, 1), (6, 4, 1), (16, 2, 8), (32, 1, 8)])
def test_default_dataloader_workers_fit_the_cores_of_each_process_so_torch_does_not_warn(monkeypatch, cores,
                                                                                       processes, workers):
    """data.num_workers=auto: torch warns when a loader has more workers than the cores it sees (the demo on a
    2-core machine printed that warning three times with the old default of 4). The cores are faked through
    os.sched_getaffinity, which both accel-train and torch's warning read."""
    import os
    import warnings

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    assert DataConfig().num_workers == "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "This DataLoader will create N worker processes" fails the test
        loader = make_loader(_images(16), DataConfig(on_device=False), 8, True, CPU)
    assert loader.num_workers == workers
    with pytest.warns(UserWarning, match="This DataLoader will create"):  # the check above can see the warning
        make_loader(_images(16), DataConfig(on_device=False, num_workers=cores + 1), 8, True, CPU)


@pytest.mark.parametrize("processes", [1, 2])
def test_every_epoch_crops_and_flips_each_sample_anew_at_any_world_size(monkeypatch, processes):
    """What the loop calls at each epoch (start_epoch on Accelerate's prepared loader) reaches the on-device
    augmentation: a sample's key is a function of (seed, epoch, index), on every process. Accelerate hands the
    epoch to the dataset itself at 1 process only; at 2, start_epoch alone does."""
    from accel_train.workloads import data

    drawn, sample_keys = [], data.sample_keys

    def recorded(indices, epoch, seed):
        keys = sample_keys(indices, epoch, seed)
        drawn.append(dict(zip(indices.tolist(), keys.tolist())))
        return keys

    monkeypatch.setattr(data, "sample_keys", recorded)
    (loader, _) = _loaders(_images(augment=True), batch=12, train=True)
    keys = {}  # (process, epoch) -> {sample index: key}
    for rank in range(processes):
        prepared = prepare_data_loader(loader, CPU, num_processes=processes, process_index=rank, split_batches=True,
                                       put_on_device=True, use_seedable_sampler=True, data_seed=7)
        for epoch in (0, 1):
            drawn.clear()
            data.start_epoch(prepared, epoch, seed=7)
            for _ in prepared:
                pass
            keys[rank, epoch] = {index: key for batch in drawn for index, key in batch.items()}
    for rank in range(processes):
        both = keys[rank, 0].keys() & keys[rank, 1].keys()
        assert len(both) >= 6 and all(keys[rank, 0][i] != keys[rank, 1][i] for i in both), "crops repeated"
    merged = [{i: key for rank in range(processes) for i, key in keys[rank, epoch].items()} for epoch in (0, 1)]
    assert merged == [{i: sample_keys(torch.tensor([i]), epoch, 7).item() for i in merged[epoch]} for epoch in (0, 1)]
