"""Contracts of `accel-train shard` (data/shards/writer.py): a recipe's data written as shards at a folder or an s3://
URL holds every sample of the source, pixel for pixel and label for label; a rerun into a complete destination says
so and writes nothing; a write cut short is finished by running it again, into the bytes an uninterrupted write
makes; another setting is refused in one line naming it; and `accel-train shard index` gives tars written by
webdataset the index that trains them.

Fashion-MNIST's first 256 training and 128 test images, in shards of about 50 kB (about 20 samples) and blocks of
about 10 kB; the store is the `object_store` fixture (threads of this process), the commands run in this process."""

import io

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from accel_train import cli
from accel_train.config import DataConfig, load_config
from accel_train.data import build_dataset
from accel_train.data.shards.cache import BlockCache
from accel_train.data.shards.dataset import ShardSamples, read_index
from accel_train.data.shards.writer import write_shards
from accel_train.data.torchvision_sets import SOURCES
from accel_train.errors import UserError
from accel_train.storage import Store, StoreUnavailable
from support.locations import needs_fashion_mnist

TRAIN, TEST = 256, 128
SIZES = {"shard_mb": 0.05, "block_mb": 0.01}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The recipe's data config (Fashion-MNIST unpacked in a folder of the module's, the first TRAIN and TEST images,
    a store patience of 1 s) and its train and test splits as the recipe loads them (uint8 images, labels)."""
    root = tmp_path_factory.mktemp("fashion_mnist")
    cfg = load_config("fashion_mnist_cnn", [f"data.root={root}", f"data.train_subset={TRAIN}",
                                            f"data.eval_subset={TEST}", "data.store_patience_s=1"]).data
    return cfg, {split: build_dataset(cfg, train=split == "train") for split in ("train", "test")}


def shard_command(cfg: DataConfig, output: str, **changes) -> list[str]:
    """`accel-train shard fashion_mnist_cnn ... output=OUTPUT shard_mb= block_mb=` for `cfg`, with `changes`."""
    sizes = {**SIZES, **{key: value for key, value in changes.items() if key in SIZES}}
    data = {"root": cfg.root, "train_subset": cfg.train_subset, "eval_subset": cfg.eval_subset,
            "store_patience_s": cfg.store_patience_s, **{key: value for key, value in changes.items()
                                                         if key not in SIZES}}
    return ["shard", "fashion_mnist_cnn", *(f"data.{key}={value}" for key, value in data.items()), f"output={output}",
            *(f"{key}={value}" for key, value in sizes.items())]


def written(output: str, split: str, cache) -> tuple[np.ndarray, np.ndarray]:
    """The pixels (N, H, W) and labels of every sample of a split of the shards at `output`, read from its tar
    members by numpy and PIL: raw pixels (KEY.pixels.npy, (1, H, W)) or a PNG."""
    store = Store(output)
    samples = ShardSamples(read_index(store, split), split, BlockCache(store, cache, 10**9), None, None)
    members = [samples.members(sample) for sample in range(len(samples))]
    return (np.stack([np.load(io.BytesIO(sample["pixels.npy"]))[0] if "pixels.npy" in sample
                      else np.asarray(Image.open(io.BytesIO(sample["png"]))) for sample in members]),
            np.array([int(sample["cls"]) for sample in members]))


def objects_under(object_store, prefix: str) -> dict[str, bytes]:
    """Every object under s3://BUCKET/PREFIX/ by its name below the prefix, with its bytes."""
    fs, root = object_store.fs(), f"{object_store.bucket}/{prefix}/"
    return {path[len(root):]: fs.cat_file(path) for path in fs.find(root)}


def puts(object_store, named: str = "") -> list[str]:
    return [request.path for request in object_store.proxy.requests
            if request.method == "PUT" and named in request.path]


@needs_fashion_mnist
@pytest.mark.parametrize("where, images, member", [  # the s3 case takes its store by name
    ("folder", "auto", "pixels.npy"), pytest.param("s3", "auto", "pixels.npy", marks=pytest.mark.store),
    ("folder", "as_given", "png")])
def test_shards_written_to_a_folder_or_to_s3_hold_every_train_and_test_sample_of_the_source_pixel_for_pixel(
        where, images, member, source, tmp_path, request):
    """The registry's images are stored as raw pixels unless images=as_given asks for PNG files."""
    cfg, splits = source
    output = request.getfixturevalue("object_store").url("fashion_mnist") if where == "s3" else str(tmp_path / "out")

    write_shards(cfg, output, recipe="fashion_mnist_cnn", images=images, **SIZES)

    for split, count in (("train", TRAIN), ("test", TEST)):
        index = read_index(Store(output), split)
        assert index.samples == count and len(index.shards) > 3
        assert (index.num_classes, index.classes, index.channels, index.image_size, index.transforms, index.source,
                index.mean, index.std) == (10, splits[split].classes, 1, 28, "in_memory", "fashion_mnist",
                                           list(SOURCES["fashion_mnist"].mean), list(SOURCES["fashion_mnist"].std))
        assert (index.images, index.shrink_to) == ("raw" if member == "pixels.npy" else "as_given", None)
        samples = ShardSamples(index, split, BlockCache(Store(output), tmp_path / "cache", 10**9), None, None)
        assert set(samples.members(0)) == {member, "cls"}
        pixels, labels = written(output, split, tmp_path / "cache")
        assert np.array_equal(pixels, splits[split].dataset.images[:, 0].numpy())
        assert np.array_equal(labels, splits[split].dataset.labels.numpy())
    # and data.name=shards serves them as the recipe's data
    data = build_dataset(DataConfig(name="shards", root=output, cache_dir=str(tmp_path / "cache")), train=True)
    assert (len(data.dataset), data.num_classes, data.image_shape) == (TRAIN, 10, (1, 28, 28))


@needs_fashion_mnist
def test_a_rerun_into_a_complete_destination_says_so_and_writes_nothing(source, object_store, capsys):
    cfg, _ = source
    url = object_store.url("fashion_mnist")
    cli.main(shard_command(cfg, url))
    capsys.readouterr()
    object_store.proxy.reset_counts()

    cli.main(shard_command(cfg, url))

    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"shard: {url} already holds these shards complete (256 train, "
                                                   "128 test samples in ") and lines[0].endswith("; nothing to do")
    assert [request.method for request in object_store.proxy.requests if request.method not in ("GET", "HEAD")] == []


@needs_fashion_mnist
def test_a_write_cut_short_by_a_store_outage_is_finished_by_running_it_again_into_the_bytes_of_an_uninterrupted_one(
        source, object_store, capsys):
    cfg, _ = source
    url = object_store.url("cut")
    # The store stops answering the upload of the fourth training shard (and everything after it): the write stops
    # after data.store_patience_s with three shards and their records in place.
    object_store.proxy.inject("reset", times=10**6, match=lambda method, path: method == "PUT" and
                              path.endswith("/cut/train/shard-000003.tar"))
    with pytest.raises(StoreUnavailable, match=f"^cannot write {url}/train/shard-000003.tar: "):
        write_shards(cfg, url, **SIZES)
    object_store.proxy.clear_faults()
    left = objects_under(object_store, "cut")
    assert sorted(left) == ["shard-writing.json", *(f"train/.written/shard-00000{n}.tar.json" for n in range(3)),
                            *(f"train/shard-00000{n}.tar" for n in range(3))]

    # Run with other settings, it is refused in one line naming them; run again as it was, it is finished.
    with pytest.raises(UserError, match=rf"^shard: {url} holds a write cut short of other settings \(train_subset "
                                        r"256 then, 200 now\); run it again with those, or give another output="):
        write_shards(load_config("fashion_mnist_cnn", [f"data.root={cfg.root}", "data.train_subset=200",
                                                       f"data.eval_subset={TEST}"]).data, url, **SIZES)
    capsys.readouterr()
    object_store.proxy.reset_counts()
    write_shards(cfg, url, **SIZES)

    assert capsys.readouterr().out.splitlines()[0] == f"shard: finishing the write to {url} that was cut short"
    uploaded = {path.rsplit("/", 1)[1] for path in puts(object_store, "/cut/train/shard-")}
    assert "shard-000003.tar" in uploaded and not uploaded & {f"shard-00000{n}.tar" for n in range(3)}, \
        "the shards written before the cut are not written again"
    write_shards(cfg, object_store.url("whole"), **SIZES)
    finished, whole = objects_under(object_store, "cut"), objects_under(object_store, "whole")
    assert sorted(finished) == sorted(whole) and "train/index.json" in finished
    assert not [name for name in finished if name.startswith("shard-writing") or "/.written/" in name]
    assert finished == whole, [name for name in whole if finished.get(name) != whole[name]]


@needs_fashion_mnist
def test_another_setting_is_refused_in_one_line_naming_it_and_a_folder_of_other_tars_is_pointed_to_shard_index(
        source, tmp_path, capsys):
    cfg, _ = source
    output = tmp_path / "out"
    cli.main(shard_command(cfg, str(output)))
    before = {path: path.read_bytes() for path in output.rglob("*") if path.is_file()}
    capsys.readouterr()

    for changes, named in (({"shard_mb": 0.1}, "shard_mb 0.05 then, 0.1 now"),
                           ({"eval_subset": 64}, "eval_subset 128 then, 64 now")):
        with pytest.raises(SystemExit) as exited:
            cli.main(shard_command(cfg, str(output), **changes))
        assert exited.value.code == 2
        assert capsys.readouterr().err.splitlines() == [
            f"accel-train: error: shard: {output} already holds shards of other settings ({named}); give another "
            "output= (or remove that one)"]
    assert {path: path.read_bytes() for path in output.rglob("*") if path.is_file()} == before

    (tmp_path / "tars" / "train").mkdir(parents=True)
    (tmp_path / "tars" / "train" / "mine-000.tar").write_bytes(b"\0" * 1024)
    with pytest.raises(SystemExit):
        cli.main(shard_command(cfg, str(tmp_path / "tars")))
    assert capsys.readouterr().err.splitlines() == [
        f"accel-train: error: shard: {tmp_path / 'tars'}/train holds files but no index.json; for tars of your own, "
        f"give them an index: accel-train shard index {tmp_path / 'tars'}; else choose another output="]


def test_tars_written_by_webdataset_are_given_indexes_with_their_counts_and_classes_and_train_as_shards(
        object_store, tmp_path, capsys):
    rng = np.random.default_rng(0)

    def tar(samples: list[tuple[str, int]]) -> bytes:  # 8x8 RGB PNGs of noise, each with its class
        buffer = io.BytesIO()
        with wds.TarWriter(buffer) as writer:
            for key, label in samples:
                image = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(image, format="PNG")
                writer.write({"__key__": key, "png": image.getvalue(), "cls": label})
        return buffer.getvalue()

    # Classes 0, 2 and 4 (so 5 classes by index); class 4 only in the first training tar.
    labels = {"train/part-000.tar": [0, 2, 4] * 10, "train/part-001.tar": [0, 2] * 12, "test/part-000.tar": [2] * 20}
    fs = object_store.fs()
    for name, classes in labels.items():
        fs.pipe_file(f"{object_store.bucket}/mine/{name}",
                     tar([(f"{name[:-4].replace('/', '-')}-{n:03d}", label) for n, label in enumerate(classes)]))
    url = object_store.url("mine")

    cli.main(["shard", "index", url])

    said = capsys.readouterr().out.splitlines()
    assert len(said) == 2 and said[0].startswith(f"shard index: {url}/train: 54 samples in 2 tars (")
    assert said[1].startswith(f"shard index: {url}/test: 20 samples in 1 tars (")
    for split, count in (("train", 54), ("test", 20)):
        index = read_index(Store(url), split)
        assert (index.samples, index.num_classes, index.channels, index.image_size, index.transforms) == \
            (count, 5, 3, 8, "imagefolder")
        assert [shard.name for shard in index.shards] == sorted(name.split("/")[1] for name in labels
                                                                if name.startswith(split))
    data = build_dataset(DataConfig(name="shards", root=url, cache_dir=str(tmp_path / "cache"), image_size=8),
                         train=True)
    assert (len(data.dataset), data.num_classes, data.image_shape) == (54, 5, (3, 8, 8))
    inputs = [data.dataset[sample] for sample in range(54)]
    assert all(tuple(image.shape) == (3, 8, 8) for image, _ in inputs)
    assert [label for _, label in inputs] == labels["train/part-000.tar"] + labels["train/part-001.tar"]


@needs_fashion_mnist
def test_a_resume_that_changes_the_order_over_the_shards_is_refused_naming_the_key_and_data_num_workers_may_change(
        source, tmp_path):
    """data.shuffle_window_shards and data.streams shape each epoch's order, so a resumed epoch under others would
    repeat some samples and skip others: refused in one line naming the key. The DataLoader workers only read what
    the order asks for: another data.num_workers resumes."""
    from support.commands import train_in_process
    from support.runs import read_metrics

    cfg, _ = source
    output = tmp_path / "shards"
    write_shards(cfg, str(output), **SIZES)
    run = ["fashion_mnist_cnn", "data.name=shards", f"data.root={output}", f"data.cache_dir={tmp_path / 'cache'}",
           "data.num_workers=0", "train.batch_size=32", "train.max_steps=3", "checkpoint.every_steps=3",
           "train.plot=false", f"output_dir={tmp_path / 'run'}"]
    train_in_process(*run)
    for change, saved, now in (("data.shuffle_window_shards=4", 8, 4), ("data.streams=2", 1, 2)):
        with pytest.raises(UserError) as refused:
            train_in_process(*run, change, "train.max_steps=6", "resume=auto")
        assert str(refused.value).startswith(
            f"resume: {tmp_path / 'run'}/checkpoints/step-00000003 was trained with {change.split('=')[0]}={saved}, "
            f"this run has {change.split('=')[0]}={now}: the order of the samples over the shards depends on it"), \
            str(refused.value)
    train_in_process(*run, "data.num_workers=1", "train.max_steps=6", "resume=auto")
    assert [line["step"] for line in read_metrics(tmp_path / "run", "train")][-1] == 6


def image_tree(root, counts: dict[str, int], shades: dict[str, int]):
    """An ImageFolder tree of 8x8 one-shade RGB PNGs: `counts[split]` per class (cat, dog), shade shades[split] + i."""
    for split, count in counts.items():
        for name in ("cat", "dog"):
            (root / split / name).mkdir(parents=True)
            for number in range(count):
                image = Image.fromarray(np.full((8, 8, 3), shades[split] + number, np.uint8))
                image.save(root / split / name / f"{number}.png")
    return root


def test_a_run_trained_with_its_own_order_over_shards_evaluates_on_their_source_tree(tmp_path):
    """eval RUN data.name=imagefolder data.root=TREE of a run trained from shards of TREE with another
    data.shuffle_window_shards: the order keys its config.yaml records do not refuse the source (they were refused
    as "set beside another dataset"); the metrics are those of the shards' evaluation."""
    from accel_train import api
    from support.commands import train_in_process

    tree = image_tree(tmp_path / "tree", {"train": 8, "test": 4}, {"train": 0, "test": 100})
    write_shards(load_config("imagefolder", [f"data.root={tree}"]).data, str(tmp_path / "shards"), shard_mb=0.001)
    run = tmp_path / "run"
    train_in_process("imagefolder", "data.name=shards", f"data.root={tmp_path / 'shards'}", "data.image_size=8",
                     "data.shuffle_window_shards=2", "data.num_workers=0", f"data.cache_dir={tmp_path / 'cache'}",
                     "model.name=mnist_cnn", "train.batch_size=4", "train.epochs=1", "train.plot=false",
                     f"output_dir={run}")

    from_tree = api.evaluate(str(run), overrides=["data.name=imagefolder", f"data.root={tree}"])

    assert from_tree["num_samples"] == 8 and from_tree == api.evaluate(str(run))


def test_shards_of_an_imagefolder_tree_with_val_beside_test_give_the_run_its_val_split(tmp_path):
    """As an ImageFolder tree's own val/ folder beside test/ is its validation split, so is the val split of the
    shards written from it: its samples (data.eval_subset of them), not the test split's."""
    from accel_train.data.imagefolder import IMAGENET_MEAN, IMAGENET_STD
    from accel_train.data.validation import hold_out_validation

    tree = image_tree(tmp_path / "tree", {"train": 6, "test": 3, "val": 2}, {"train": 0, "test": 100, "val": 200})
    write_shards(load_config("imagefolder", [f"data.root={tree}"]).data, str(tmp_path / "shards"), shard_mb=0.001)
    cfg = DataConfig(name="shards", root=str(tmp_path / "shards"), cache_dir=str(tmp_path / "cache"), image_size=8,
                     eval_subset=3)

    _, validation = hold_out_validation(cfg, 0, build_dataset(cfg, train=True), None)

    assert (len(validation.dataset), validation.classes, validation.image_shape) == (3, ["cat", "dog"], (3, 8, 8))
    images = [validation.dataset[index][0] for index in range(3)]  # uint8: normalised on the device, by its finish
    assert [int(image[0, 4, 4]) for image in images] == [200, 201, 200], "not the val split's images"
    normalised = validation.finish.images(images[0])
    assert float(normalised[0, 4, 4]) == pytest.approx((200 / 255 - IMAGENET_MEAN[0]) / IMAGENET_STD[0])


@needs_fashion_mnist
def test_shards_go_to_a_new_folder_of_a_bucket_whose_name_says_bucket_and_an_unknown_bucket_is_named(
        source, object_store):
    """README's own example writes to s3://bucket/...: a folder not there yet is a missing object, whose error is its
    path, "bucket/fashion_mnist/train", not a missing bucket. A bucket that is not there is named in one line."""
    cfg, _ = source
    object_store.fs().mkdir("bucket")
    write_shards(cfg, "s3://bucket/fashion_mnist", **SIZES)
    assert read_index(Store("s3://bucket/fashion_mnist"), "train").samples == TRAIN
    with pytest.raises(UserError, match=r"^s3://no-such-bucket/fashion_mnist/\S+: The specified bucket does not "
                                        r"exist; check the bucket's name"):
        write_shards(cfg, "s3://no-such-bucket/fashion_mnist", **SIZES)


SYNTHETIC = ["shard", "mnist_cnn", "data.synthetic=true", "data.train_subset=40", "data.eval_subset=20"]


def _one_line(arguments: list[str], exit_code: int, capsys) -> str:
    with pytest.raises(SystemExit) as stopped:
        cli.main(arguments)
    lines = capsys.readouterr().err.splitlines()
    assert stopped.value.code == exit_code and len(lines) == 1, lines
    return lines[0].removeprefix("accel-train: error: ")


def test_shards_onto_a_file_or_over_a_damaged_record_are_one_line_and_touch_nothing(tmp_path, capsys):
    file = tmp_path / "results.txt"
    file.write_text("mine")
    for output in (file, file / "shards"):
        said = _one_line([*SYNTHETIC, f"output={output}"], 2, capsys)
        assert said == f"shard: output={output}: {file} is a file, not a folder; give a folder (or a URL) for the " \
                       "shards"
    assert file.read_text() == "mine"

    out = tmp_path / "shards"
    cli.main([*SYNTHETIC, f"output={out}"])
    (out / "train" / "index.json").write_text('{"split": "train", "shards": [')  # cut short
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    capsys.readouterr()
    said = _one_line([*SYNTHETIC, f"output={out}"], 3, capsys)
    assert said.startswith(f"shard: {out}/train/index.json is damaged (JSONDecodeError") and "write again" in said
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before


def test_shard_index_never_replaces_the_index_accel_train_shard_wrote_and_refuses_a_tar_cut_short(tmp_path, capsys):
    out = tmp_path / "shards"
    cli.main([*SYNTHETIC, f"output={out}"])
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    capsys.readouterr()
    said = _one_line(["shard", "index", str(out)], 2, capsys)
    assert said.startswith(f"shard index: {out}/train/index.json was written by accel-train shard (from mnist)")
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before

    tars = tmp_path / "tars"
    for split in ("train", "test"):
        (tars / split).mkdir(parents=True)
        (tars / split / "mine-000.tar").write_bytes((out / split / "shard-000000.tar").read_bytes())
    whole = (tars / "train" / "mine-000.tar").read_bytes()
    (tars / "train" / "mine-000.tar").write_bytes(whole[:len(whole) // 2])  # a copy cut short
    said = _one_line(["shard", "index", str(tars)], 3, capsys)
    assert said.startswith(f"shard index: {tars}/train/mine-000.tar is not a whole tar (cut short: ")
    assert not list(tars.rglob("index.json"))


def test_a_source_that_cannot_be_read_is_refused_before_anything_is_recorded_so_the_corrected_command_writes(
        tmp_path):
    """A mistyped data.root, then a class folder with no image: neither leaves a write behind for the corrected
    command to be refused as "cut short of other settings"."""
    from accel_train.errors import DataNotFoundError

    tree = image_tree(tmp_path / "tree", {"train": 2, "test": 1}, {"train": 0, "test": 100})
    (tree / "test" / "owl").mkdir()
    output = str(tmp_path / "shards")
    for mistake in (tmp_path / "mistyped", tree):
        with pytest.raises(DataNotFoundError):
            write_shards(load_config("imagefolder", [f"data.root={mistake}"]).data, output)
        assert not Store(output, "output").exists("shard-writing.json")
    (tree / "test" / "owl").rmdir()

    write_shards(load_config("imagefolder", [f"data.root={tree}"]).data, output)

    assert read_index(Store(output, "output"), "test").samples == 2


def test_a_broken_link_in_the_source_is_one_line_naming_it(tmp_path, capsys):
    tree = image_tree(tmp_path / "tree", {"train": 2, "test": 1}, {"train": 0, "test": 100})
    broken = tree / "train" / "dog" / "9.png"
    broken.symlink_to(tmp_path / "gone.png")

    with pytest.raises(SystemExit) as exited:
        cli.main(["shard", "imagefolder", f"data.root={tree}", f"output={tmp_path / 'shards'}"])

    assert exited.value.code == 3
    assert capsys.readouterr().err == (f"accel-train: error: shard: cannot read {broken} (train split) as an image "
                                       "(No such file or directory); delete or replace that file\n")
