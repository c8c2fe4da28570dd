"""Contracts of shards written to be read fast (`accel-train shard ... images= shrink_to=`): the registry's small
images stored as raw uint8 pixels reach the model as the float path's inputs; an ImageFolder tree of photographs
stored as raw pixels shrunk to the evaluation transform's resize evaluates exactly as the tree decoded at full size
(data.decode=full; the default decodes at a scale, within docs/contracts.md's tolerance), and predicts through
the same shrink; a run resumed from raw shards equals an uninterrupted one; a wrong setting is one line.

Photographs: a folder made from Debian's mate-backgrounds (tools/photos.py), evaluated at 32 px (resize 36, crop 32).
"""

import copy
import dataclasses

import pytest
import torch

from accel_train import api, cli
from accel_train.config import DataConfig, load_config
from accel_train.data import build_dataset
from accel_train.data.in_memory import PixelsToModelInput, per_sample_transform, pil_image, pixels_transform
from accel_train.data.shards.dataset import read_index, transform_of
from accel_train.data.shards.format import pixels_of
from accel_train.data.shards.writer import write_shards
from accel_train.storage import Store
from support.commands import train_in_process
from support.locations import USER_RECIPE, needs_fashion_mnist, needs_photos
from support.runs import assert_same_run, crash_after_checkpoint_then_resume

SIZE, RESIZE = 32, 36  # the evaluation transform at data.image_size=32: Resize(int(32 * 256 / 224)), CenterCrop(32)
TRAIN, TEST = 12, 6  # the photographs' folder: 6 classes (each photograph decoded once), 2 train images of each


def test_the_registrys_uint8_pixels_finished_on_the_device_are_the_float_paths_inputs():
    """Raw pixels made into the model's input by the data's finish (resized to data.image_size and normalised where
    the batch is) give what the per-sample float path (ToTensor, Resize, Normalize on the host) gives, within 1e-6."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (6, 1, 28, 28), dtype=torch.uint8, generator=generator)
    mean, std = (0.286,), (0.353,)
    for size in (28, 40):
        floats = per_sample_transform(28, mean, std, False, size)
        expected = torch.stack([floats(pil_image(image)) for image in images])
        received = [pixels_transform()(pil_image(image)) for image in images]
        assert all(sample.dtype == torch.uint8 for sample in received)
        made = PixelsToModelInput(mean, std, size).images(torch.stack(received))
        assert made.shape == (6, 1, size, size)
        torch.testing.assert_close(made, expected, rtol=0, atol=1e-6)


@needs_fashion_mnist
def test_augmented_raw_pixel_shards_of_the_registry_are_cropped_on_the_device_as_the_in_memory_data_is(tmp_path):
    """With data.augment, a worker only copies pixels: each sample's key travels with the batch, and the finish crops
    and flips it where the batch is, as the in-memory data's on-device path does. The same inputs bit for bit, for
    the same (seed, epoch, sample), resized to data.image_size too."""
    from torch.utils.data import default_collate

    from accel_train.data.keyed import KeyedSamples

    cfg = load_config("fashion_mnist_cnn", [f"data.root={tmp_path / 'fashion_mnist'}", "data.augment=true",
                                            "data.train_subset=64", "data.eval_subset=16",
                                            "data.image_size=32"]).data
    write_shards(cfg, str(tmp_path / "shards"), shard_mb=0.02)
    in_memory = build_dataset(cfg, train=True).dataset
    sharded = dataclasses.replace(cfg, name="shards", root=str(tmp_path / "shards"), cache_dir=str(tmp_path / "cache"),
                                  train_subset=None, eval_subset=None)
    shards = build_dataset(sharded, train=True)
    assert shards.dataset.augments_on_device and not shards.dataset.draws_from  # nothing seeded on the host
    served = KeyedSamples(shards.dataset, shards.dataset.draws_from, keys_with_samples=True)
    indices = list(range(0, 64, 3))
    for epoch in (0, 1):
        served.key_epoch(epoch, seed=5)
        in_memory.set_epoch(epoch, seed=5)
        images, labels = shards.finish(default_collate(served.__getitems__(indices)))
        expected, expected_labels = in_memory.__getitems__(indices)
        assert images.shape == (len(indices), 1, 32, 32)
        assert torch.equal(images, expected) and torch.equal(labels, expected_labels)

    # samples held out for validation (data.val_fraction) are served as evaluation serves them: not augmented
    from accel_train.data import make_loader
    from accel_train.data.validation import hold_out_validation

    sharded = dataclasses.replace(sharded, val_fraction=0.25)
    _, validation = hold_out_validation(sharded, 0, shards, build_dataset(sharded, train=False))
    held = validation.dataset.indices
    batch = next(iter(make_loader(validation, sharded, 16, False, torch.device("cpu"))))
    images, labels = validation.finish(batch)
    plain = build_dataset(dataclasses.replace(cfg, augment=False), train=True).dataset
    assert torch.equal(images, plain.__getitems__(held[:16])[0]) and torch.equal(labels, plain.labels[held[:16]])


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """(the tree, its shards as raw pixels shrunk to RESIZE, the same as JPEG shrunk to RESIZE)."""
    from accel_train.tools.photos import make_photo_folder

    tmp = tmp_path_factory.mktemp("photos")
    tree = make_photo_folder(tmp / "tree", train=TRAIN, test=TEST)
    cfg = load_config("imagefolder", [f"data.root={tree}"]).data
    write_shards(cfg, str(tmp / "raw"), shard_mb=0.5, images="raw", shrink_to=RESIZE)
    write_shards(cfg, str(tmp / "jpeg"), shard_mb=0.5, images="jpeg", shrink_to=RESIZE)
    return tree, tmp / "raw", tmp / "jpeg"


def _shards(root, tmp_path, **changes) -> DataConfig:
    return DataConfig(name="shards", root=str(root), cache_dir=str(tmp_path / "cache"), image_size=SIZE, **changes)


@needs_photos
def test_photographs_shrunk_to_the_evaluation_resize_are_stored_at_that_short_side_as_pixels_or_jpeg(photos,
                                                                                                     tmp_path):
    tree, raw, jpeg = photos
    for root, images, member in ((raw, "raw", "pixels.npy"), (jpeg, "jpeg", "jpg")):
        index = read_index(Store(str(root)), "test")
        assert (index.images, index.shrink_to, index.samples) == (images, RESIZE, TEST)
        samples = build_dataset(_shards(root, tmp_path), train=False).dataset
        assert set(samples.members(0)) == {member, "cls"}
    stored = build_dataset(_shards(raw, tmp_path), train=False).dataset
    sides = {min(pixels_of(stored.members(index)["pixels.npy"]).shape[1:]) for index in range(TEST)}
    assert sides == {RESIZE}, "every photograph (400 px and wider) shrunk to a short side of RESIZE"


@needs_photos
def test_evaluation_from_raw_pixel_shards_shrunk_to_its_resize_equals_evaluation_on_the_tree(photos, tmp_path):
    """The same pixels go in: the stored image is the evaluation transform's own resize of the photograph decoded at
    full size, which that transform then leaves as it is. Bit for bit, sample by sample, and as metrics of a run
    trained from the shards, against the tree decoded at full size (the shard writer decodes so)."""
    tree, raw, _ = photos
    on_tree = build_dataset(DataConfig(name="imagefolder", root=str(tree), image_size=SIZE, decode="full"),
                            train=False)
    on_shards = build_dataset(_shards(raw, tmp_path), train=False)
    assert len(on_tree.dataset) == len(on_shards.dataset) == TEST
    for index in range(TEST):
        (ours, label), (theirs, their_label) = on_shards.dataset[index], on_tree.dataset[index]
        assert ours.dtype == torch.uint8 and label == their_label and torch.equal(ours, theirs), index

    run = tmp_path / "run"
    train_in_process("imagefolder", "data.name=shards", f"data.root={raw}", f"data.image_size={SIZE}",
                     f"data.cache_dir={tmp_path / 'cache'}", "data.num_workers=0", "model.name=mnist_cnn",
                     "train.batch_size=8", "train.epochs=1", "train.plot=false",
                     f"output_dir={run}")
    from_tree = api.evaluate(str(run), overrides=["data.name=imagefolder", f"data.root={tree}", "data.decode=full"])
    assert from_tree["num_samples"] == TEST and from_tree == api.evaluate(str(run))



@needs_photos
def test_random_crops_of_raw_photographs_are_cut_on_the_host_and_resized_on_the_device_as_the_host_would(photos,
                                                                                                    tmp_path):
    """With data.augment, a worker copies each random crop's pixels and nothing more: the batch goes to the device as
    crops of different sizes (one flat tensor), resized there. The same inputs, bit for bit on the CPU, as
    RandomResizedCrop and the flip made on the host from the same sample key; held-out validation samples are
    served as evaluation serves them."""
    from torch.utils.data import default_collate

    from accel_train.data import make_loader
    from accel_train.data.decode import Crops
    from accel_train.data.imagefolder import imagefolder_transform
    from accel_train.data.keyed import KeyedSamples
    from accel_train.data.validation import hold_out_validation

    _, raw, _ = photos
    cfg = _shards(raw, tmp_path, augment=True)
    shards = build_dataset(cfg, train=True)
    assert shards.dataset.collate_fn == Crops.collate and shards.dataset.draws_from == {"torch"}
    on_host = dataclasses.replace(shards, dataset=copy.copy(shards.dataset))
    on_host.dataset.transform = imagefolder_transform(cfg, train=True)  # RandomResizedCrop, flip: on the host
    served, served_on_host = KeyedSamples(shards.dataset, {"torch"}), KeyedSamples(on_host.dataset, {"torch"})
    indices = list(range(0, TRAIN, 2))
    for epoch in (0, 1):
        for keyed in (served, served_on_host):
            keyed.key_epoch(epoch, seed=7)
        crops, labels = Crops.collate(served.__getitems__(indices))
        sides = {tuple(shape[1:]) for shape in crops.shapes.tolist()}
        assert len(sides) > 1 and crops.pixels.numel() == sum(c * h * w for c, h, w in crops.shapes.tolist())
        images, labels = shards.finish([crops, labels])
        expected, expected_labels = on_host.finish(default_collate(served_on_host.__getitems__(indices)))
        assert images.shape == (len(indices), 3, SIZE, SIZE) and images.dtype == torch.float32
        assert torch.equal(images, expected) and torch.equal(labels, expected_labels), epoch

    sharded = dataclasses.replace(cfg, val_fraction=0.25)
    _, validation = hold_out_validation(sharded, 0, shards, build_dataset(sharded, train=False))
    # no worker: the batch as loaded, before the finish (which a CPU's workers would run)
    batch = next(iter(make_loader(validation, dataclasses.replace(sharded, num_workers=0), 6, False,
                                  torch.device("cpu"))))
    evaluated = copy.copy(shards.dataset)
    evaluated.transform = transform_of(cfg, evaluated.index, train=False)
    held = validation.dataset.indices[:6]
    assert torch.is_tensor(batch[0])
    assert torch.equal(batch[0], torch.stack([evaluated[index][0] for index in held]))


@needs_photos
def test_predict_of_a_file_shrinks_it_as_its_shard_was_shrunk(photos, tmp_path):
    """Shrunk to 48 px, then resized to 36 for evaluation: not the tree's pixels, but predict's input for each test
    file is its shard's evaluation input bit for bit (the same shrink, then the same transform)."""
    from PIL import Image

    from accel_train.data.shards.dataset import image_converter

    tree, _, _ = photos
    write_shards(load_config("imagefolder", [f"data.root={tree}"]).data, str(tmp_path / "raw48"), images="raw",
                 shrink_to=48)
    cfg = _shards(tmp_path / "raw48", tmp_path)
    on_shards = build_dataset(cfg, train=False)
    files = build_dataset(DataConfig(name="imagefolder", root=str(tree), image_size=SIZE), train=False).dataset
    convert, shape = image_converter(cfg)
    assert shape == (3, SIZE, SIZE)
    for index, (path, _) in enumerate(files.samples):
        with Image.open(path) as image:
            assert torch.equal(convert(image), on_shards.finish.images(on_shards.dataset[index][0])), path


@needs_fashion_mnist
def test_a_run_from_raw_pixel_shards_resumed_after_a_crash_equals_one_run_uninterrupted(tmp_path):
    cfg = load_config("fashion_mnist_cnn", [f"data.root={tmp_path / 'fashion_mnist'}"]).data
    # 2 epochs of 6 steps of 16 over 8 shards or so, 2 loader workers reading them; the crash after step 4's
    # checkpoint, mid-epoch
    write_shards(dataclasses.replace(cfg, train_subset=96, eval_subset=32), str(tmp_path / "shards"),
                 shard_mb=0.01, block_mb=0.0025)
    run = ["fashion_mnist_cnn", "data.name=shards", f"data.root={tmp_path / 'shards'}", "data.num_workers=2",
           "data.augment=true", "train.batch_size=16", "train.epochs=2", "checkpoint.every_steps=4",
           "train.plot=false"]

    train_in_process(*run, f"data.cache_dir={tmp_path / 'cache1'}", f"output_dir={tmp_path / 'whole'}")
    crash_after_checkpoint_then_resume(4, *run, f"data.cache_dir={tmp_path / 'cache2'}",
                                       f"output_dir={tmp_path / 'resumed'}")

    assert_same_run(tmp_path / "resumed", tmp_path / "whole")


@pytest.mark.parametrize("arguments, says", [
    (["images=png"], "shard: images=png: choose one of auto, as_given, raw, jpeg"),
    (["shrink_to=256"], "shard: shrink_to=256 is for ImageFolder trees and hf: datasets; the registry's datasets are "
                        "small and stored as raw pixels; data.name=fashion_mnist's samples are written as they come"),
    (["shrink_to=0"], "shard: shrink_to=0: the short side in pixels, a whole number above 0"),
    (["shrink_to=big"], "shard: shrink_to=big: the short side in pixels, a whole number above 0"),
])
def test_a_wrong_image_storage_is_refused_in_one_line_before_anything_is_written(arguments, says, tmp_path, capsys):
    assert _refusal(["fashion_mnist_cnn", f"data.root={tmp_path / 'data'}", *arguments], tmp_path, capsys) == says


def test_shrinking_asks_for_images_stored_anew_and_a_dataset_by_import_path_keeps_its_samples(tmp_path, capsys):
    tree = tmp_path / "tree"
    for split in ("train", "test"):
        (tree / split / "a").mkdir(parents=True)
    cases = (([USER_RECIPE, "data.name=user_models:drawing_points", "images=raw"],
              "shard: images=raw is for the registry's datasets, ImageFolder trees and hf: datasets; "
              "data.name=user_models:drawing_points's samples are written as they come"),
             (["imagefolder", f"data.root={tree}", "shrink_to=64"],
              "shard: shrink_to=64 stores images anew: give images=raw (pixels, read fastest) or images=jpeg "
              "(smaller), not images=auto"),
             (["imagefolder", f"data.root={tree}", "images=as_given", "shrink_to=64"],
              "shard: shrink_to=64 stores images anew: give images=raw (pixels, read fastest) or images=jpeg "
              "(smaller), not images=as_given"))
    for arguments, says in cases:
        assert _refusal(arguments, tmp_path, capsys) == says


def _refusal(arguments: list[str], tmp_path, capsys) -> str:
    """`accel-train shard ARGUMENTS output=OUT`'s one line, refused with exit 2 and OUT never made."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(["shard", *arguments, f"output={tmp_path / 'out'}"])
    lines = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2 and len(lines) == 1 and not (tmp_path / "out").exists()
    return lines[0].removeprefix("accel-train: error: ")
