"""Contracts of data.decode=scaled (the default): an ImageFolder's JPEGs decoded at the smallest of libjpeg-turbo's
1/2, 1/4 and 1/8 DCT scales that keeps the training crop (evaluation's resize) at least the output size. The crops
and flips are drawn from the header's size exactly as from a full-size decode; the model's inputs then differ from
data.decode=full within the tolerance docs/contracts.md states, and a sample that needs every pixel is decoded at full
size, bit for bit. Launched at 1 and 2 processes, 0 and 2 workers and resumed: test_data_paths_and_keyed_augmentation.
"""

import dataclasses
import io
import logging
import math
import random

import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from accel_train.config import load_config
from accel_train.data import imagefolder
from accel_train.data.decode import EncodedJpeg, decoded_at, read_encoded, read_image
from accel_train.data.imagefolder import (
    augments,
    crop_factor,
    imagefolder_data,
    imagefolder_transform,
    resize_factor,
    scaled_box,
    short_side_resized,
)
from accel_train.data.keyed import KeyedSamples
from accel_train.errors import UnreadableFileError, UserError
from support.locations import needs_photos

# The tolerance docs/contracts.md states, in levels of 255 of the uint8 inputs: each sample decoded at a scale within
# MEAN_ABS of its full-size decode on average over its pixels, and the samples so decoded within MEAN_ABS_OVER_SAMPLES
MEAN_ABS, MEAN_ABS_OVER_SAMPLES = 6.0, 1.5


@pytest.fixture(scope="module")
def large_photos(tmp_path_factory):
    """An ImageFolder of photographs of 900 to 1,200 px (seeded cuts of Debian's backgrounds, as accel-train photos
    cuts them, at their own resolution): most training crops of 224 px and every evaluation resize to 256 px can be
    decoded at a scale."""
    from accel_train.tools.photos import source_photos

    root, generator = tmp_path_factory.mktemp("large"), random.Random(0)
    sources = source_photos()[:8]
    for split, count in (("train", 16), ("test", 8)):
        for number in range(count):
            source = sources[number % len(sources)]
            with Image.open(source) as photo:  # every one at least 1,280 x 1,024
                width, height = generator.choice(((1200, 900), (1000, 1000), (1200, 1000)))
                left, top = generator.randint(0, photo.width - width), generator.randint(0, photo.height - height)
                folder = root / split / source.stem.lower()
                folder.mkdir(parents=True, exist_ok=True)
                photo.convert("RGB").crop((left, top, left + width, top + height)).save(folder / f"{number}.jpg",
                                                                                        quality=90)
    return root


def jpeg(width: int, height: int, **save) -> bytes:
    """A JPEG of smooth colours, `width` x `height`."""
    y, x = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    pixels = torch.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], -1)
    buffer = io.BytesIO()
    Image.fromarray(pixels.to(torch.uint8).numpy()).save(buffer, format="JPEG", quality=90, **save)
    return buffer.getvalue()


def test_a_jpeg_decoded_at_a_scale_has_libjpegs_sides_rounded_up_and_at_1_the_full_size_decoders_pixels(tmp_path):
    path = tmp_path / "odd.jpg"
    path.write_bytes(jpeg(1001, 667))
    encoded = read_encoded(str(path))
    assert isinstance(encoded, EncodedJpeg) and (encoded.height, encoded.width) == (667, 1001)
    for factor in (2, 4, 8):
        assert decoded_at(encoded, factor).shape == (3, math.ceil(667 / factor), math.ceil(1001 / factor)), factor
    assert torch.equal(decoded_at(encoded, 1), read_image(str(path)))


def test_pngs_cmyk_jpegs_and_jpegs_turned_by_exif_are_decoded_by_the_loader_as_data_decode_full_does(tmp_path):
    """Only the JPEGs that simplejpeg decodes into the full-size decoder's pixels wait for the transform: not a CMYK
    one, nor one whose EXIF orientation turns it (TorchCodec turns it, simplejpeg would not)."""
    plain, png, cmyk, turned = (tmp_path / name for name in ("plain.jpg", "image.png", "cmyk.jpg", "turned.jpg"))
    plain.write_bytes(jpeg(64, 32))
    Image.open(plain).save(png)
    Image.open(plain).convert("CMYK").save(cmyk, quality=90)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: turned 90 degrees
    turned.write_bytes(jpeg(64, 32, exif=exif.tobytes()))
    assert isinstance(read_encoded(str(plain)), EncodedJpeg)
    for path in (png, cmyk, turned):
        decoded = read_encoded(str(path))
        assert isinstance(decoded, torch.Tensor) and torch.equal(decoded, read_image(str(path))), path


def test_the_scale_chosen_is_the_smallest_that_keeps_the_crop_at_least_the_output_size():
    generator = random.Random(0)
    size, chosen = (224, 224), set()
    for _ in range(5000):
        height, width = generator.randint(230, 3000), generator.randint(230, 3000)
        box_height, box_width = generator.randint(224, height), generator.randint(224, width)
        box = (generator.randint(0, height - box_height), generator.randint(0, width - box_width), box_height,
               box_width)
        factor = crop_factor(box, size)
        chosen.add(factor)
        _, _, cut_height, cut_width = scaled_box(box, factor)
        assert cut_height >= 224 and cut_width >= 224, (box, factor)
        if factor < 8:  # the next scale would leave it under the output size
            _, _, cut_height, cut_width = scaled_box(box, 2 * factor)
            assert cut_height < 224 or cut_width < 224, (box, factor)
    assert chosen == {1, 2, 4, 8}


def test_evaluations_scale_is_the_smallest_that_keeps_both_sides_at_least_its_resizes():
    generator = random.Random(2)
    chosen = set()
    for _ in range(5000):
        height, width = generator.randint(100, 4000), generator.randint(100, 4000)
        resized = short_side_resized(height, width, 256)
        assert min(resized) == 256
        factor = resize_factor((height, width), resized)
        chosen.add(factor)
        if factor > 1:  # at 1, smaller images are enlarged, as from any decode
            assert math.ceil(height / factor) >= resized[0] and math.ceil(width / factor) >= resized[1], (height, width)
        if factor < 8:
            assert math.ceil(height / (2 * factor)) < resized[0] or math.ceil(width / (2 * factor)) < resized[1]
    assert chosen == {1, 2, 4, 8}
    assert short_side_resized(600, 803, 256) == tuple(v2.Resize(256)(torch.zeros(1, 600, 803)).shape[1:])
    assert short_side_resized(803, 600, 256) == tuple(v2.Resize(256)(torch.zeros(1, 803, 600)).shape[1:])


def test_a_crop_box_at_a_scale_is_the_full_size_box_to_the_nearest_scaled_pixel():
    """Scaled pixel i holds full-size pixels [i * factor, (i + 1) * factor): each edge of the box moves by at most
    half a scaled pixel, and stays inside the scaled image (ceil(side / factor) pixels)."""
    generator = random.Random(1)
    for _ in range(5000):
        side, factor = generator.randint(16, 3000), generator.choice((1, 2, 4, 8))
        height = generator.randint(1, side)
        top = generator.randint(0, side - height)
        cut_top, _, cut_height, _ = scaled_box((top, 0, height, side), factor)
        assert abs(cut_top * factor - top) <= factor / 2, (side, factor, top, height)
        assert abs((cut_top + cut_height) * factor - (top + height)) <= factor / 2, (side, factor, top, height)
        assert 0 <= cut_top and cut_top + cut_height <= math.ceil(side / factor)
        if factor == 1:
            assert (cut_top, cut_height) == (top, height)


def splits_both_ways(root, train: bool, *overrides: str):
    """The split of `root` as data.decode=scaled and as data.decode=full serve it, each keyed by sample (epoch 0,
    seed 0), as training serves it."""
    cfg = load_config("imagefolder", [f"data.root={root}", "data.augment=true", *overrides]).data
    served = []
    for decode in ("scaled", "full"):
        cfg = dataclasses.replace(cfg, decode=decode)
        data = imagefolder_data(cfg, root / ("train" if train else "test"), imagefolder_transform(cfg, train), None,
                                augmenting=augments(cfg, train))
        served.append(KeyedSamples(data.dataset, data.dataset.draws_from))
    return served


@needs_photos
@pytest.mark.parametrize("train", [True, False])
def test_photographs_decoded_at_a_scale_stay_within_the_stated_tolerance_of_a_full_size_decode(large_photos, train,
                                                                                                monkeypatch):
    """The same crops and flips (training) or resize and centre crop (evaluation) of each sample, from a decode at
    the scale they need: samples decoded at a scale within the tolerance, the others the full-size decode's bit for
    bit; the draws the same, in the same order: each box, and torch's generator where each sample's transforms
    leave it."""
    factors, boxes = [], []
    original_decode, original_box = imagefolder.decoded_at, imagefolder.T.RandomResizedCrop.get_params
    original_params = v2.RandomResizedCrop.make_params

    def decode(jpeg, factor):
        factors.append(factor)
        return original_decode(jpeg, factor)

    def box_of_header(image, scale, ratio):  # scaled: drawn from the header's size
        boxes.append(("scaled", original_box(image, scale, ratio)))
        return boxes[-1][1]

    def box_of_pixels(self, flat_inputs):  # full: drawn by RandomResizedCrop from the decoded pixels
        params = original_params(self, flat_inputs)
        boxes.append(("full", (params["top"], params["left"], params["height"], params["width"])))
        return params

    monkeypatch.setattr(imagefolder, "decoded_at", decode)
    monkeypatch.setattr(imagefolder.T.RandomResizedCrop, "get_params", box_of_header)
    monkeypatch.setattr(v2.RandomResizedCrop, "make_params", box_of_pixels)
    scaled, full = splits_both_ways(large_photos, train)
    scaled_diffs = []
    for index in range(len(full)):
        factors.clear()
        boxes.clear()
        scaled_image, label = scaled[index]
        full_image, full_label = full[index]
        assert label == full_label and scaled_image.shape == full_image.shape == (3, 224, 224)
        if train:
            assert [way for way, _ in boxes] == ["scaled", "full"] and boxes[0][1] == boxes[1][1], boxes
        difference = (scaled_image.int() - full_image.int()).abs().float().mean().item()
        if factors[0] == 1:
            assert difference == 0, index
        else:
            scaled_diffs.append(difference)
            assert difference <= MEAN_ABS, (index, factors, difference)
    assert len(scaled_diffs) >= len(full) // 2, f"only {len(scaled_diffs)} of {len(full)} decoded at a scale"
    assert sum(scaled_diffs) / len(scaled_diffs) <= MEAN_ABS_OVER_SAMPLES, scaled_diffs


class Watched(torch.nn.Module):
    """A transform, and torch's generator as it leaves it: `states` gets a digest of the state after each call."""

    def __init__(self, transform, states: list) -> None:
        super().__init__()
        self.transform, self.states = transform, states

    def forward(self, sample):
        sample = self.transform(sample)
        self.states.append(hash(torch.get_rng_state().numpy().tobytes()))
        return sample


@needs_photos
def test_each_transform_leaves_torchs_generator_as_after_a_full_size_decode(large_photos):
    """The draws of each sample in order: the crop's, then the flip's, then TrivialAugment's, from torch's generator
    in the same states as from a full-size decode; so the same flip and the same augmentation (the flip seen in the
    pixels too: a mirrored crop is far from the tolerance)."""
    served, states = splits_both_ways(large_photos, True, "data.trivial_augment=true"), ([], [])
    for keyed, watched in zip(served, states):
        compose = keyed.samples.transform
        compose.transforms = [Watched(transform, watched) for transform in compose.transforms]
    scaled, full = served
    for index in range(len(full)):
        scaled_image, full_image = scaled[index][0], full[index][0]
        assert (scaled_image.int() - full_image.int()).abs().float().mean() <= MEAN_ABS, index
    assert states[0] == states[1] and len(set(states[0])) > len(full)


@needs_photos
def test_a_jpeg_damaged_after_its_header_is_one_line_naming_it_from_a_scaled_decode(tmp_path, large_photos):
    root = tmp_path / "tree"
    for split in ("train", "test"):
        (root / split / "ant").mkdir(parents=True)
        whole = next((large_photos / "test").rglob("*.jpg")).read_bytes()
        (root / split / "ant" / "0.jpg").write_bytes(whole[:len(whole) * 3 // 5])
    scaled, _ = splits_both_ways(root, False)
    with pytest.raises(UnreadableFileError) as stopped:
        scaled[0]
    said = str(stopped.value)
    assert said.startswith(f"imagefolder: cannot read {root / 'test' / 'ant' / '0.jpg'} as an image (") and \
        said.endswith("); delete or replace that file") and "\n" not in said, said


def test_without_simplejpeg_jpegs_are_decoded_at_full_size_with_one_note(tmp_path, monkeypatch, caplog):
    for split in ("train", "test"):
        (tmp_path / split / "ant").mkdir(parents=True)
        (tmp_path / split / "ant" / "0.jpg").write_bytes(jpeg(600, 500))
    monkeypatch.setattr(imagefolder, "scaling_decoder", lambda: None)
    imagefolder._note_full_size_decoding.cache_clear()
    with caplog.at_level(logging.WARNING, logger="accel_train"):
        scaled, full = splits_both_ways(tmp_path, False)
        splits_both_ways(tmp_path, True)
    notes = [record.message for record in caplog.records if "simplejpeg" in record.message]
    assert notes == ["data.decode=scaled: simplejpeg is not installed (pip install simplejpeg), so JPEGs are decoded "
                     "at full size, as data.decode=full does"]
    assert torch.equal(scaled[0][0], full[0][0])
    assert isinstance(scaled.samples.loader(str(tmp_path / "test" / "ant" / "0.jpg")), torch.Tensor)


def test_a_decode_that_is_neither_scaled_nor_full_is_refused_naming_both():
    with pytest.raises(UserError, match="data.decode: 'fast' is not a valid choice; choose one of scaled, full"):
        load_config("imagefolder", ["data.decode=fast"])
