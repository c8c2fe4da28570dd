"""Contracts of the data paths: the on-device path gives the same samples, shards and metrics as a per-sample
DataLoader, and every path augments a sample as a function of (seed, epoch, its index) alone."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate.data_loader import prepare_data_loader

from accel_train.config import DataConfig, load_config
from accel_train.data import (
    Data,
    InMemoryImages,
    KeyedSamples,
    build_dataset,
    make_loader,
    sample_keys,
    start_epoch,
)
from accel_train.data.in_memory import pad_for, random_crop_flip, to_model_input
from support.commands import launch, train_in_process
from support.images import noise_jpeg_tree
from support.locations import PROBE, USER_RECIPE
from support.recorders import inputs_of_training_batches
from support.runs import crash_after_checkpoint_then_resume, read_metrics

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
def test_every_epoch_crops_and_flips_each_sample_anew_at_any_world_size(processes):
    """What the loop calls at each epoch (start_epoch on Accelerate's prepared loader) reaches the on-device
    augmentation: every process gives each sample the crop and flip of its key (seed, epoch, index), and so another
    one each epoch. Accelerate hands the epoch to the dataset itself at 1 process only; at 2, start_epoch alone does."""
    source = _images(augment=True)
    (loader, _) = _loaders(source, batch=12, train=True)
    images = source.dataset

    def expected(index: int, epoch: int) -> torch.Tensor:
        key = sample_keys(torch.tensor([index]), epoch, 7)
        crop = random_crop_flip(images.images[index:index + 1], pad_for(8), key)
        return to_model_input(crop, None, images.mean, images.std)[0]

    seen = {}  # (epoch, sample index) -> the model's input, from whichever process read it
    for rank in range(processes):
        prepared = prepare_data_loader(loader, CPU, num_processes=processes, process_index=rank, split_batches=True,
                                       put_on_device=True, use_seedable_sampler=True, data_seed=7)
        for epoch in (0, 1):
            start_epoch(prepared, epoch, seed=7)
            for inputs, labels in prepared:  # labels are the samples' indices
                seen.update({(epoch, index): image for index, image in zip(labels.tolist(), inputs)})
    assert len(seen) >= 2 * 30  # each epoch's full batches: 36 of the 37 samples
    assert all(torch.equal(image, expected(index, epoch)) for (epoch, index), image in seen.items())
    moved = [index for epoch, index in seen if epoch == 1 and (0, index) in seen
             and not torch.equal(seen[0, index], seen[1, index])]
    assert len(moved) >= 30, "the second epoch repeated the first one's crops"


# --- per-sample transforms: every random draw keyed by (seed, epoch, index) -------------------------------------------

class Draws(torch.utils.data.Dataset):
    """A transform's draws from torch's, Python's and numpy's global generators, one of each per sample."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple:
        return torch.rand(()).item(), random.random(), float(np.random.random_sample())


def test_each_generator_a_transform_draws_from_is_keyed_by_seed_epoch_and_index_only():
    # Not by the batch, its order or what was fetched before: workers, world sizes and resumes cannot change a draw.
    dataset = KeyedSamples(Draws())
    dataset.key_epoch(3, seed=5)
    first = dataset.__getitems__([4, 9, 11])
    again = dataset.__getitems__([11, 4])
    assert again == [first[2], first[0]] and dataset[9] == first[1]
    for epoch, seed in ((4, 5), (3, 6)):
        dataset.key_epoch(epoch, seed)
        for index, ours, theirs in zip((4, 9, 11), first, dataset.__getitems__([4, 9, 11])):
            assert all(a != b for a, b in zip(ours, theirs)), f"sample {index}: (epoch, seed) {(epoch, seed)} " \
                                                               f"drew {theirs} where (3, 5) drew {ours}"


def test_keyed_transforms_leave_the_callers_torch_random_and_numpy_streams_where_they_were():
    """With num_workers=0 the transforms run in the training process, whose streams dropout draws from: a batch
    of keyed samples must leave them as it found them."""
    def seeded_then_drawn(between=lambda: None) -> list:
        torch.manual_seed(1), random.seed(1), np.random.seed(1)
        between()
        return [torch.rand(2).tolist(), random.random(), np.random.random_sample()]

    loader = make_loader(Data(Draws(), None, ()), DataConfig(num_workers=0), 8, True, CPU)
    assert seeded_then_drawn(between=lambda: next(iter(loader))) == seeded_then_drawn()


def test_a_dataset_that_fetches_whole_batches_is_still_keyed_sample_by_sample():
    """A Hugging Face datasets.Dataset has __getitems__, which the DataLoader would call with the whole batch, and
    its transform draws for the batch in one go: each sample's draws would depend on its batch-mates."""
    import datasets

    def draw(columns: dict) -> dict:
        return {"index": columns["index"], "draw": torch.rand(len(columns["index"])).tolist()}

    samples = datasets.Dataset.from_dict({"index": list(range(16))}).with_transform(draw)
    loader = prepare_data_loader(make_loader(Data(samples, None, ()), DataConfig(num_workers=0), 8, True, CPU), CPU,
                                 num_processes=1, process_index=0, split_batches=True, use_seedable_sampler=True,
                                 data_seed=3)
    start_epoch(loader, 1, seed=3)
    drawn = {index: draw for batch in loader for index, draw in zip(batch["index"].tolist(), batch["draw"].tolist())}
    alone = KeyedSamples(samples)
    alone.key_epoch(1, seed=3)
    assert len(drawn) == 16 and drawn == {index: alone[index]["draw"] for index in range(16)}


# 24 samples, global batch 8: 3 steps an epoch, 2 epochs. The crashed run stops after step 4, in the second epoch:
# its workers have served both epochs, and its resume skips into the middle of one.
KEYED = ["train.batch_size=8", "train.epochs=2", "train.max_steps=null", "seed=1", "train.plot=false"]
KEYED_DATA = {
    "user_dataset_by_import_path": ["data.name=user_models:drawing_points", "data.num_classes=24"],
    # 8 px from 20 px JPEGs: about a third of the crops decoded at 1/2 (data.decode=scaled), the rest at full size
    "imagefolder_tree_augmented": ["data.name=imagefolder", "data.synthetic=false", "data.augment=true",
                                   "data.image_size=8"],
    "raw_pixel_shards_of_that_tree": ["data.name=shards", "data.synthetic=false", "data.augment=true",
                                      "data.image_size=16"],
    "raw_pixel_shards_of_the_registry": ["data.name=shards", "data.synthetic=false", "data.augment=true"],
    # TrivialAugment and random erasing on shards: per sample, on the host, keyed as every other draw
    "raw_pixel_shards_of_that_tree_trivially_augmented_and_erased": [
        "data.name=shards", "data.synthetic=false", "data.augment=true", "data.image_size=16",
        "data.trivial_augment=true", "data.random_erasing=0.5"],
    "raw_pixel_shards_of_the_registry_trivially_augmented_and_erased": [
        "data.name=shards", "data.synthetic=false", "data.augment=true", "data.trivial_augment=true",
        "data.random_erasing=0.5"],
    "hf_dataset_augmented": ["data.synthetic=false", "data.augment=true", "data.image_size=16"],
}
# What each run's data is made from: an ImageFolder tree of JPEGs, shards of it as raw pixels, the registry's shards
SOURCE = {"imagefolder_tree_augmented": "tree", "raw_pixel_shards_of_that_tree": "tree shards",
          "raw_pixel_shards_of_the_registry": "registry shards",
          "raw_pixel_shards_of_that_tree_trivially_augmented_and_erased": "tree shards",
          "raw_pixel_shards_of_the_registry_trivially_augmented_and_erased": "registry shards",
          "hf_dataset_augmented": "hf dataset"}
# (processes, DataLoader workers) of the launched runs: at 2 processes with and without workers, for a user dataset,
# for an ImageFolder of JPEGs (decoded into tensors, cropped and flipped as uint8, normalised on the device) and for
# shards of it as raw pixels shrunk to 18 px (nothing decoded)
LAUNCHED = {"user_dataset_by_import_path": [(2, 0), (2, 2)], "imagefolder_tree_augmented": [(2, 0), (2, 2)],
            "raw_pixel_shards_of_that_tree": [(2, 0), (2, 2)], "raw_pixel_shards_of_the_registry": [(2, 0), (2, 2)],
            "raw_pixel_shards_of_that_tree_trivially_augmented_and_erased": [(2, 2)],
            "raw_pixel_shards_of_the_registry_trivially_augmented_and_erased": [(2, 2)],
            "hf_dataset_augmented": [(2, 0), (2, 2)]}


def _hf_dataset(folder) -> str:
    """The tree's 24 noise JPEGs as a Hugging Face dataset (save_to_disk), a ClassLabel of 24 names: a sample's label
    is its index, as in the tree."""
    import datasets

    tree = Path(noise_jpeg_tree(folder.parent / "hf_tree"))
    names = [f"c{index:02d}" for index in range(24)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    splits = {split: datasets.Dataset.from_dict(
        {"image": [{"bytes": (tree / split / name / "image.jpg").read_bytes(), "path": None} for name in names],
         "label": list(range(24))}, features=features) for split in ("train", "test")}
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    return str(folder)


def _registry_shards(root) -> None:
    """Shards as `accel-train shard` writes the registry's images (raw 28 px grey pixels, their transforms), of 24
    noise images whose labels are their indices."""
    from accel_train.data.shards.writer import ImageStorage, SourceSplit, _write_split
    from accel_train.storage import Store

    pixels = torch.randint(0, 256, (24, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    record = dict(classes=[f"c{index:02d}" for index in range(24)], num_classes=24, channels=1, image_size=28,
                  mean=[0.5], std=[0.5], transforms="in_memory", source="fashion_mnist", images="raw", shrink_to=None)
    for split in ("train", "test"):
        samples = SourceSplit(split, 24, lambda index: {**ImageStorage("raw").of_pixels(pixels[index]),
                                                        "cls": str(index).encode()}, record)
        _write_split(Store(str(root)), samples, {}, 8_000, 2_000)


@pytest.mark.parametrize("augment", [False, True])
def test_shards_fetch_a_batch_at_a_time_the_samples_and_keys_they_fetch_one_by_one(augment, tmp_path, monkeypatch):
    """Raw pixels of the registry's kind, plain and augmented on the device (each sample's key beside it): a worker's
    batch comes through ShardSamples.__getitems__ (one search for the batch's places), the same samples, labels and
    keys as one at a time, whatever the batch holds."""
    from accel_train.data.loaders import keyed
    from accel_train.data.shards.dataset import ShardSamples

    _registry_shards(tmp_path / "shards")
    cfg = load_config(USER_RECIPE, ["data.name=shards", "data.synthetic=false", f"data.augment={str(augment).lower()}",
                                    f"data.root={tmp_path / 'shards'}", f"data.cache_dir={tmp_path / 'cache'}"]).data
    served = keyed(build_dataset(cfg, train=True).dataset)
    served.key_epoch(1, seed=3)
    order = [17, 3, 3, 22, 0, 9]
    one_by_one = [served.__getitems__([index])[0] for index in order]
    monkeypatch.setattr(ShardSamples, "__getitem__", lambda self, sample: pytest.fail("read one sample at a time"))
    batch = served.__getitems__(order)
    assert len(batch) == len(order) and len(batch[0]) == (3 if augment else 2)
    for sample, alone, index in zip(batch, one_by_one, order):
        assert torch.equal(sample[0], alone[0]) and sample[1] == alone[1] == index
        assert not augment or sample[2] == alone[2] == sample_keys(torch.tensor([index]), 1, 3)[0]


def drawn(batches: list) -> dict:
    """{(epoch, sample index): digest of what the model received}, from inputs_of_training_batches' records."""
    seen = {}
    for epoch, samples in batches:
        for index, digest in samples:
            assert (epoch, index) not in seen, f"sample {index} seen twice in epoch {epoch}"
            seen[epoch, index] = digest
    return seen


@pytest.fixture(scope="module", params=list(KEYED_DATA))
def keyed_runs(request, tmp_path_factory):
    """The same run of a dataset whose transforms draw at random: {name: its drawn()}. One process without workers
    (the reference), launched at 2 processes, crashed after step 4 with 2 workers and resumed, and with seed 2."""
    tmp = tmp_path_factory.mktemp(request.param)
    data, source = KEYED_DATA[request.param], SOURCE.get(request.param)
    if source == "tree":
        data = [*data, f"data.root={noise_jpeg_tree(tmp / 'images')}"]
    elif source == "hf dataset":
        data = [*data, f"data.name=hf:{_hf_dataset(tmp / 'hf')}"]
    elif source is not None:
        from accel_train.data.shards.writer import write_shards

        if source == "tree shards":
            tree = load_config("imagefolder", [f"data.root={noise_jpeg_tree(tmp / 'images')}"]).data
            write_shards(tree, str(tmp / "shards"), shard_mb=0.005, images="raw", shrink_to=18)
        else:  # cropped and flipped on the device, from the keys the batches carry
            _registry_shards(tmp / "shards")
        data = [*data, f"data.root={tmp / 'shards'}", f"data.cache_dir={tmp / 'cache'}"]
    args = [*KEYED, *data]
    runs = {}
    with inputs_of_training_batches([]) as batches:
        train_in_process(USER_RECIPE, *args, "data.num_workers=0", f"output_dir={tmp / 'reference'}")
    runs["1 process, no worker"] = drawn(batches)
    for processes, workers in LAUNCHED[request.param]:
        name = f"{processes} processes, {workers} workers"
        probes = tmp / f"probe-{processes}-{workers}"
        launch(processes, "train", USER_RECIPE, *args, f"data.num_workers={workers}",
               f"output_dir={tmp / f'launched-{processes}-{workers}'}", script=PROBE,
               env={"PROBE_DIR": str(probes), "PROBE_INPUTS": "1"}, timeout=240)
        runs[name] = drawn([batch for rank in range(processes)
                            for batch in json.loads((probes / f"rank{rank}.json").read_text())["inputs"]])
    with inputs_of_training_batches([]) as batches:
        # The crashed run trained on after its checkpoint of step 4 (saved in the background) until it learnt of the
        # commit: those batches (one a step) belong to no run that continues, and are dropped.
        crash_after_checkpoint_then_resume(4, USER_RECIPE, *args, "data.num_workers=2",
                                           "checkpoint.every_steps=4", f"output_dir={tmp / 'resumed'}",
                                           between=lambda: batches.__delitem__(slice(4, None)))
    runs["1 process, 2 workers, resumed after step 4"] = drawn(batches)
    with inputs_of_training_batches([]) as batches:
        train_in_process(USER_RECIPE, *args, "data.num_workers=0", "seed=2", f"output_dir={tmp / 'seed2'}")
    runs["seed 2"] = drawn(batches)
    return runs


def test_per_sample_transforms_draw_alike_at_1_and_2_processes_0_and_2_workers_and_after_a_resume(keyed_runs):
    """Every random draw of a sample's transforms (torch, random, numpy) is a function of (seed, epoch, index): the
    inputs the model receives are the same bit for bit however the run is split, served or interrupted."""
    reference = keyed_runs["1 process, no worker"]
    assert len(reference) == 2 * 24
    for name, run in keyed_runs.items():
        if name != "seed 2":
            differ = sorted(key for key in reference if run.get(key) != reference[key])
            assert run.keys() == reference.keys() and not differ, f"{name}: (epoch, sample) {differ} drew otherwise"


def test_per_sample_transforms_draw_anew_for_another_seed_and_another_epoch(keyed_runs):
    reference, other_seed = keyed_runs["1 process, no worker"], keyed_runs["seed 2"]
    same_seed = sum(other_seed[key] == reference[key] for key in reference)
    same_epoch = sum(reference[0, index] == reference[1, index] for index in range(24))
    assert same_seed < 48 / 4, f"seeds 1 and 2 drew {same_seed} of 48 samples alike"
    assert same_epoch < 24 / 4, f"epochs 0 and 1 drew {same_epoch} of 24 samples alike"


def test_keys_that_share_their_low_32_bits_draw_differently_in_torch_and_numpy():
    """torch's manual_seed and numpy's legacy seed keep 32 bits: a sample's generators are filled from all of its
    62-bit key instead, so two samples whose keys share the low 32 bits draw apart; the same key draws alike."""
    from accel_train.data.keyed import seed_generators

    def draws(key: int) -> tuple:
        seed_generators(key)
        return torch.rand(4).tolist(), np.random.random_sample(4).tolist(), random.random()

    low = 0x2545F491
    first, again, other = draws(low + (7 << 40)), draws(low + (7 << 40)), draws(low + (9 << 40))
    assert first == again
    assert first[0] != other[0] and first[1] != other[1] and first[2] != other[2]
    assert first[0] != first[1][:4]  # torch's stream is not numpy's


def test_a_users_validation_split_is_served_with_its_test_splits_transform():
    """data.val_fraction of a dataset by import path: the held-out training samples go through the `transform` of
    the dataset's evaluation split (torchvision's convention), not the training one's (which may augment)."""
    import torchvision
    from torchvision.transforms import v2

    from accel_train.data import Data, hold_out_validation

    def fake(transform):
        return Data(torchvision.datasets.FakeData(20, image_size=(3, 8, 8), num_classes=2, transform=transform), 2,
                    (3, 8, 8))

    augment, evaluated = v2.Compose([v2.PILToTensor(), v2.RandomHorizontalFlip(1.0)]), v2.PILToTensor()
    cfg = DataConfig(name="user_models:points", val_fraction=0.25)
    training, validation = hold_out_validation(cfg, 0, fake(augment), fake(evaluated))
    assert validation.dataset.dataset.transform is evaluated and training.dataset.dataset.transform is augment
    index = validation.dataset.indices[0]
    assert torch.equal(validation.dataset[0][0], evaluated(fake(None).dataset[index][0]))


def test_the_slow_input_advice_names_knobs_that_exist_for_the_data_path(monkeypatch):
    """data.image_size resizes the registry's images only; a user's dataset is told to make its __getitem__ faster;
    one core is one core."""
    import os

    from accel_train.data import slow_input_advice

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    user = slow_input_advice(DataConfig(name="user_models:points", num_workers=1), Data(None, 3, (1, 4, 4)))
    assert user == ("make the dataset's __getitem__ faster or read from faster storage: all 1 DataLoader workers are "
                    "busy (1 CPU core per process here)")
    registry = slow_input_advice(DataConfig(name="imagefolder", num_workers=1), Data(None, 3, (3, 8, 8)))
    assert registry.startswith("lower data.image_size, lighten augmentation") and "1 CPU core per" in registry


@pytest.mark.parametrize("name, shape", [("fashion_mnist", (1, 28, 28)), ("cifar10", (3, 32, 32)),
                                         ("stl10", (3, 96, 96))])
def test_synthetic_data_is_torchvisions_fakedata_of_the_datasets_shape_sample_for_sample(name, shape):
    import torchvision
    from torchvision.transforms import v2

    from accel_train.data import build_dataset

    cfg = load_config("mnist_cnn", [f"data.name={name}", "data.synthetic=true", "data.train_subset=5",
                                    "data.eval_subset=3"]).data
    for train, offset in ((True, 0), (False, 10**6)):
        held = build_dataset(cfg, train).dataset
        fake = torchvision.datasets.FakeData(len(held), image_size=shape, num_classes=10, transform=v2.PILToTensor(),
                                             random_offset=offset)
        images, labels = zip(*(fake[index] for index in range(len(fake))))
        assert torch.equal(held.images, torch.stack(images)) and held.labels.tolist() == list(labels), (name, train)


def test_synthetic_imagefolder_data_is_torchvisions_fakedata_through_the_same_transform():
    import torchvision

    from accel_train.data import build_dataset

    cfg = load_config("imagefolder", ["data.synthetic=true", "data.image_size=40", "data.eval_subset=4"]).data
    held = build_dataset(cfg, train=False).dataset  # the evaluation transform draws nothing at random
    fake = torchvision.datasets.FakeData(4, image_size=(3, 40, 40), num_classes=10, transform=held.transform)
    for index in range(4):
        (image, label), (expected, expected_label) = held[index], fake[index]
        assert torch.equal(image, expected) and label == expected_label, index
