"""Contracts of the image-file path (ImageFolder and its shards): files decoded straight into uint8 tensors,
transformed as uint8, collated and copied as uint8, and scaled and normalised a batch at a time on the device give
the model exactly what torchvision's float pipeline (PIL, transforms v2, ToDtype + Normalize per sample on the
host) gives it; a damaged image, in a folder or inside a shard, is one line naming it."""

import io
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from accel_train.config import DataConfig, load_config
from accel_train.data import build_dataset, make_loader
from accel_train.data.decode import ImagesToModelInput, decode_image_bytes, read_image
from accel_train.data.imagefolder import IMAGENET_MEAN, IMAGENET_STD
from accel_train.data.keyed import sample_keys, seed_generators
from accel_train.data.shards.writer import write_shards
from accel_train.errors import UnreadableFileError

CPU = torch.device("cpu")


def photo_like(seed: int, width: int, height: int) -> Image.Image:
    """Smooth colour gradients with noise: what JPEG is made for, unlike pure noise."""
    generator = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    channels = [np.sin(x / generator.uniform(5, 40) + generator.uniform(0, 6)) * 90 +
                np.cos(y / generator.uniform(5, 40)) * 60 + 128 + generator.normal(0, 8, (height, width))
                for _ in range(3)]
    return Image.fromarray(np.clip(np.stack(channels, -1), 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """An ImageFolder of JPEGs of several sizes (and one PNG and one grey JPEG), 2 classes, train and test."""
    root = tmp_path_factory.mktemp("tree")
    for split, count in (("train", 6), ("test", 3)):
        for label, name in enumerate(("ant", "bee")):
            folder = root / split / name
            folder.mkdir(parents=True)
            for number in range(count):
                image = photo_like(100 * label + 10 * number + (split == "test"), 60 + 7 * number, 48 + 5 * number)
                if number == 1:
                    image.save(folder / f"{number}.png")
                else:
                    (image.convert("L") if number == 2 else image).save(folder / f"{number}.jpg", quality=90)
    return root


def torchvisions_float_pipeline(cfg: DataConfig, train: bool):
    """What the ImageFolder path computed before it stayed uint8: PIL's image, the same transforms, then float32 and
    Normalize per sample on the host (and random erasing after it)."""
    size = cfg.image_size
    crop = [v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()] if train \
        else [v2.Resize(int(size * 256 / 224), antialias=True), v2.CenterCrop(size)]
    erase = [v2.RandomErasing(cfg.random_erasing)] if train and cfg.random_erasing else []
    return v2.Compose([v2.PILToTensor(), v2.RGB(), *crop, v2.ToDtype(torch.float32, scale=True),
                       v2.Normalize(IMAGENET_MEAN, IMAGENET_STD), *erase])


@pytest.mark.parametrize("train, erasing", [(False, 0.0), (True, 0.0), (True, 0.5)],
                         ids=["evaluation", "training", "training with random erasing (on the host)"])
def test_batches_made_into_the_models_input_on_the_device_equal_torchvisions_float_pipeline_bit_for_bit(
        tree, train, erasing):
    cfg = load_config("imagefolder", [f"data.root={tree}", "data.image_size=32", f"data.random_erasing={erasing}",
                                      "data.num_workers=0"]).data
    data = build_dataset(cfg, train)
    loader = make_loader(data, cfg, 4, train=False, device=CPU)  # in order: the samples are known by position
    loader.dataset.key_epoch(1, seed=7)  # as start_epoch keys a prepared loader's epoch
    batches = [data.finish(batch) for batch in loader]
    images = torch.cat([images for images, _ in batches])
    reference = torchvisions_float_pipeline(cfg, train)
    keys = sample_keys(torch.arange(len(data.dataset)), 1, 7).tolist()
    expected = []
    for (path, _), key in zip(data.dataset.samples, keys):
        seed_generators(key)  # as the loader's KeyedSamples draws each sample's crop, flip and erasing
        with Image.open(path) as image:
            expected.append(reference(image.convert("RGB")))
    assert images.dtype == torch.float32 and len(images) == len(expected) == (12 if train else 6)
    assert torch.equal(images, torch.stack(expected))


def test_samples_stay_uint8_to_the_device_and_float_batches_pass_the_finish_as_they_are(tree):
    cfg = load_config("imagefolder", [f"data.root={tree}", "data.image_size=32", "data.num_workers=0"]).data
    data = build_dataset(cfg, train=True)
    images, labels = next(iter(make_loader(data, cfg, 4, train=True, device=CPU)))
    assert images.dtype == torch.uint8 and images.shape == (4, 3, 32, 32)  # a quarter of float32's bytes to copy
    made, same_labels = data.finish([images, labels])
    assert made.dtype == torch.float32 and same_labels is labels
    kept = made.clone()
    assert torch.equal(data.finish([made, labels])[0], kept) and torch.equal(made, kept)  # normalised once only
    bare = ImagesToModelInput((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # data.normalize=false: scaled only
    assert torch.equal(bare.images(images), v2.functional.to_dtype(images, torch.float32, scale=True))


def test_every_decoder_gives_the_same_pixels_as_pil(tree):
    """TorchCodec's decoders, torchvision.io's (deprecated from torchvision 0.29), simplejpeg's (data.decode=scaled's,
    at full size) and PIL's: one libjpeg-turbo and one libpng, the same pixels; so a run's numbers do not depend on
    which is installed."""
    import simplejpeg
    from torchvision.io import ImageReadMode, decode_image

    files = sorted(path for path in tree.rglob("*") if path.is_file())
    assert {path.suffix for path in files} == {".jpg", ".png"}
    for path in files:
        with Image.open(path) as image:
            expected = v2.functional.pil_to_tensor(image.convert("RGB"))
        assert torch.equal(read_image(str(path)), expected), path
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            assert torch.equal(decode_image(str(path), mode=ImageReadMode.RGB), expected), path
        if path.suffix == ".jpg":
            assert torch.equal(torch.from_numpy(simplejpeg.decode_jpeg(path.read_bytes())).permute(2, 0, 1), expected)
        try:
            from torchcodec.decoders import decode_image as torchcodec_decode
        except Exception:  # not installed, or built for another torch
            continue
        assert torch.equal(torchcodec_decode(str(path), mode="RGB"), expected), path
    bmp = io.BytesIO()
    photo_like(1, 20, 10).save(bmp, format="BMP")  # a format only PIL reads
    assert torch.equal(decode_image_bytes(bmp.getvalue(), "image.bmp"),
                       v2.functional.pil_to_tensor(photo_like(1, 20, 10)))


def test_a_damaged_jpeg_in_a_folder_and_inside_a_shard_is_one_line_naming_it(tmp_path):
    """Cut short after its header, a JPEG is written into a shard as it is, and read from there names the shard."""
    root = tmp_path / "tree"
    for split in ("train", "test"):
        for name in ("ant", "bee"):
            (root / split / name).mkdir(parents=True)
            for number in range(2):
                photo_like(number, 40, 30).save(root / split / name / f"{number}.jpg", quality=90)
    broken = root / "train" / "bee" / "1.jpg"
    whole = broken.read_bytes()
    broken.write_bytes(whole[:len(whole) * 3 // 5])  # its header whole: the pixels are cut short
    with pytest.raises(UnreadableFileError) as in_folder:
        read_image(str(broken))
    assert str(in_folder.value).startswith(f"imagefolder: cannot read {broken} as an image (") and \
        str(in_folder.value).endswith("); delete or replace that file") and "\n" not in str(in_folder.value)
    assert ".cpp:" not in str(in_folder.value)  # the decoder's message, not its source line

    cfg = load_config("imagefolder", [f"data.root={root}"]).data
    write_shards(cfg, str(tmp_path / "shards"))  # the file as it is: shards keep images as given
    shards = DataConfig(name="shards", root=str(tmp_path / "shards"), cache_dir=str(tmp_path / "cache"))
    dataset = build_dataset(shards, train=True).dataset
    with pytest.raises(UnreadableFileError) as in_shard:
        for index in range(len(dataset)):
            dataset[index]
    said = str(in_shard.value)  # its shard, its place there, and the file to replace
    assert said.startswith(f"shards: cannot read {tmp_path / 'shards'}/train/shard-000000.tar (sample 3, .jpg; "
                           f"written from {broken}) as an image (") and "\n" not in said, said
    assert said.endswith("); replace that image in the source and write the shards again"), said


def test_a_file_whose_header_is_damaged_stops_the_shard_writer_in_one_line_naming_it(tmp_path):
    for split in ("train", "test"):
        (tmp_path / "tree" / split / "ant").mkdir(parents=True)
        photo_like(0, 40, 30).save(tmp_path / "tree" / split / "ant" / "0.jpg", quality=90)
    broken = tmp_path / "tree" / "train" / "ant" / "0.jpg"
    broken.write_bytes(broken.read_bytes()[:100])
    with pytest.raises(UnreadableFileError) as stopped:
        write_shards(load_config("imagefolder", [f"data.root={tmp_path / 'tree'}"]).data, str(tmp_path / "shards"))
    assert str(stopped.value).startswith(f"shard: cannot read {broken} (train split) as an image (") and \
        str(stopped.value).endswith("); delete or replace that file")
