"""data.max_image_pixels (default: PIL's Image.MAX_IMAGE_PIXELS, 89,478,485): every path that decodes image files
(ImageFolder, hf: datasets, the shard writer, shards, predict, bench --input) reads an image's width and height from
its header first, and refuses one of more pixels than the key allows in one line naming the file, its declared size
and the key, exit 3, before any decoder runs: a PNG of 20,000 x 20,000 pixels (48 kB on disk, 1.2 GB decoded) takes
no memory. Refused above the limit itself, where PIL only warns (up to twice its limit), and read at the limit."""

import resource
import shutil

import pytest
from PIL import Image

from accel_train import api, cli
from accel_train.config import MAX_IMAGE_PIXELS, DataConfig, describe_keys, load_config
from accel_train.data import build_dataset
from accel_train.data.decode import read_image
from accel_train.data.shards.writer import write_shards
from accel_train.errors import UnreadableFileError
from support.commands import train_in_process
from support.hub import colour_dataset
from support.images import png_bomb

WIDTH, HEIGHT = 10, 12  # the small images: 120 pixels


@pytest.fixture(scope="module")
def bomb(tmp_path_factory):
    return png_bomb(tmp_path_factory.mktemp("bomb") / "bomb.png")


def small_tree(root, extension: str = "png"):
    """An ImageFolder of 10 x 12 images: 2 classes of 2 in train/ and in test/."""
    for split in ("train", "test"):
        for label, name in enumerate(("ant", "bee")):
            (root / split / name).mkdir(parents=True)
            for number in range(2):
                Image.new("RGB", (WIDTH, HEIGHT), (90 * label, 60 * number, 100)).save(
                    root / split / name / f"{number}.{extension}")
    return root


def one_line(capsys, stopped) -> str:
    """The command stopped with exit 3 and said why in one line, without a traceback."""
    said = capsys.readouterr().err
    assert stopped.value.code == 3 and "Traceback" not in said, said
    (line,) = [line for line in said.splitlines() if line.startswith("accel-train: error: ")]
    return line


def peak_memory_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


BOMB_SAYS = "declares 20,000 x 20,000 pixels (1.2 GB decoded as RGB), more than data.max_image_pixels=89478485: not " \
            "decoded (a decompression bomb?); "


def test_a_png_bomb_in_an_image_folder_stops_training_in_one_line_and_is_never_decoded(bomb, tmp_path, capsys):
    root = small_tree(tmp_path / "tree")
    shutil.copy(bomb, root / "train" / "bee" / "bomb.png")
    before = peak_memory_mb()
    with pytest.raises(SystemExit) as stopped:
        cli.main(["train", "imagefolder", f"data.root={root}", "model.name=resnet18", "data.image_size=16",
                  "data.num_workers=0", "train.batch_size=5", "train.epochs=1", "train.warmup_steps=0",
                  "train.plot=false",
                  f"output_dir={tmp_path / 'run'}"])
    line = one_line(capsys, stopped)
    assert f"imagefolder: {root / 'train' / 'bee' / 'bomb.png'} {BOMB_SAYS}delete or replace that file, or raise " \
        "data.max_image_pixels if it is meant to be that large" in line, line
    assert peak_memory_mb() - before < 300, "the bomb was decoded"


def test_a_png_bomb_stops_bench_input_in_one_line_before_any_way_is_measured(bomb, tmp_path, capsys):
    """Its first shard write reads every file the rows read: torchvision's and webdataset's through PIL, which would
    refuse at twice its limit, with a traceback from a DataLoader worker."""
    root = small_tree(tmp_path / "tree")
    shutil.copy(bomb, root / "train" / "bee" / "bomb.png")
    with pytest.raises(SystemExit) as stopped:
        cli.main(["bench", "--input", "--steps", "1", "train.batch_size=1", f"data.root={root}",
                  f"output_dir={tmp_path / 'bench'}"])
    line = one_line(capsys, stopped)
    assert f"shard: {root / 'train' / 'bee' / 'bomb.png'} (train split) {BOMB_SAYS}" in line, line
    assert not (tmp_path / "bench" / "bench_input.json").exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    train_in_process("mnist_cnn", f"output_dir={out}", "data.synthetic=true", "data.train_subset=24",
                     "data.eval_subset=10", "train.batch_size=12", "train.max_steps=1", "train.plot=false")
    return out


def read_by(path: str, tmp_path, limit: int, trained) -> str:
    """One image of 10 x 12 pixels read by `path` under data.max_image_pixels=`limit`; returns how the line of a
    refusal starts (what read it, and the file)."""
    limited = f"data.max_image_pixels={limit}"
    jpeg = path == "imagefolder, JPEGs decoded at their scale"
    tree = small_tree(tmp_path / f"tree_{limit}", "jpg" if jpeg else "png")
    first = tree / "train" / "ant" / ("0.jpg" if jpeg else "0.png")
    if path.startswith("imagefolder"):
        decode = "full" if path == "imagefolder, decoded at full size" else "scaled"
        cfg = load_config("imagefolder", [f"data.root={tree}", f"data.decode={decode}", limited]).data
        build_dataset(cfg, train=True).dataset[0]
        return f"imagefolder: {first}"
    if path == "hf:":
        colour_dataset({"train": (("red",), 1), "test": (("red",), 1)}).save_to_disk(str(tmp_path / f"hf_{limit}"))
        cfg = load_config("imagefolder", [f"data.name=hf:{tmp_path / f'hf_{limit}'}", "data.image_size=8",
                                          limited]).data
        build_dataset(cfg, train=True).dataset[0]
        return f"hf: hf:{tmp_path / f'hf_{limit}'} train sample 0"
    shards = tmp_path / f"shards_{limit}"
    if path.startswith("the shard writer"):
        cfg = load_config("imagefolder", [f"data.root={tree}", limited]).data
        write_shards(cfg, str(shards), images="raw" if path.endswith("raw") else "as_given")
        return f"shard: {first} (train split)"
    if path == "shards":  # written under the default limit, read under this one
        write_shards(load_config("imagefolder", [f"data.root={tree}"]).data, str(shards))
        build_dataset(DataConfig(name="shards", root=str(shards), cache_dir=str(tmp_path / "cache"),
                                 max_image_pixels=limit), train=True).dataset[0]
        return f"shards: {shards}/train/shard-000000.tar (sample 0, .png; written from {first})"
    api.predict(str(trained), inputs=str(tree / "test"), overrides=[limited])
    return f"predict: {tree / 'test' / 'ant' / '0.png'}"


PATHS = ["imagefolder, decoded at full size", "imagefolder, JPEGs decoded at their scale", "hf:",
         "the shard writer, images as given", "the shard writer, images=raw", "shards", "predict"]


@pytest.mark.parametrize("path", PATHS)
def test_every_decode_path_reads_an_image_at_the_limit_and_refuses_one_a_pixel_over_naming_it_and_the_key(
        path, tmp_path, request):
    trained = request.getfixturevalue("trained") if path == "predict" else None
    starts = read_by(path, tmp_path, WIDTH * HEIGHT, trained)
    with pytest.raises(UnreadableFileError) as refused:
        read_by(path, tmp_path, WIDTH * HEIGHT - 1, trained)
    line = str(refused.value)
    assert line.startswith(starts.replace(f"_{WIDTH * HEIGHT}", f"_{WIDTH * HEIGHT - 1}")), line
    assert f" declares {WIDTH} x {HEIGHT} pixels, more than data.max_image_pixels=119: not decoded" in line, line
    assert refused.value.exit_code == 3 and "\n" not in line


def test_shards_of_the_registrys_images_stored_as_png_are_held_to_the_key_as_pil_opens_them(tmp_path):
    """Their samples are PIL images, as the registry's datasets give them: their PNGs opened by PIL, not decoded into
    tensors."""
    cfg = load_config("mnist_cnn", ["data.synthetic=true", "data.train_subset=4", "data.eval_subset=2"]).data
    write_shards(cfg, str(tmp_path / "shards"), images="as_given")

    def first(limit: int):
        data = DataConfig(name="shards", root=str(tmp_path / "shards"), cache_dir=str(tmp_path / "cache"),
                          max_image_pixels=limit)
        return build_dataset(data, train=True).dataset[0]

    assert first(28 * 28)[0].shape == (1, 28, 28)
    with pytest.raises(UnreadableFileError) as refused:
        first(28 * 28 - 1)
    assert str(refused.value).startswith(f"shards: {tmp_path / 'shards'}/train/shard-000000.tar (sample 0, .png) "
                                         "declares 28 x 28 pixels, more than data.max_image_pixels=783: not decoded")


def test_the_limit_is_pils_own_by_default_a_key_with_its_meaning_and_pils_setting_stays_as_it_was(tmp_path):
    assert MAX_IMAGE_PIXELS == DataConfig().max_image_pixels == Image.MAX_IMAGE_PIXELS
    (described,) = [help for key, _, help, _ in describe_keys() if key == "data.max_image_pixels"]
    assert "decompression bomb" in described and "Image.MAX_IMAGE_PIXELS" in described, described
    bitmap = tmp_path / "small.bmp"  # a format whose header PIL reads, its own limit lifted for that read alone
    Image.new("RGB", (WIDTH, HEIGHT)).save(bitmap)
    with pytest.raises(UnreadableFileError, match=f"small.bmp declares {WIDTH} x {HEIGHT} pixels, more than "):
        read_image(str(bitmap), max_pixels=WIDTH * HEIGHT - 1)
    assert read_image(str(bitmap), max_pixels=WIDTH * HEIGHT).shape == (3, HEIGHT, WIDTH)
    assert Image.MAX_IMAGE_PIXELS == 89_478_485
