"""`accel-train shard`: any data accel-train reads (a recipe's dataset, an ImageFolder tree, a dataset by import path)
written as shards at a folder or URL, one split at a time; and `accel-train shard index`: tars of one's own
(webdataset's) given the index that trains them.

Writing is deterministic (the same source and settings make the same bytes), so a write cut short is finished by
running the same command again: each shard's entry is recorded beside it once it is complete, and the split's
index.json, written last, is what marks the split complete.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Subset

from accel_train.config import MAX_IMAGE_PIXELS, DataConfig
from accel_train.console import bar_disabled
from accel_train.data.decode import decode_image_bytes, open_image, shrunk, unreadable_image
from accel_train.data.imagefolder import IMAGENET_MEAN, IMAGENET_STD, own_validation_folder
from accel_train.data.in_memory import InMemoryImages, pil_image
from accel_train.data.registry import given_normalization
from accel_train.data.shards.format import (
    BLOCK_BYTES,
    IMAGE_EXTENSIONS,
    IMAGE_STORAGE,
    INDEX_FILE,
    RAW_PIXELS,
    SOURCES_FILE,
    SPLITS,
    Shard,
    SplitIndex,
    index_tar,
    padded,
    pixels_of,
    raw_pixels,
    sample_members,
    square_side,
    tar_of,
)
from accel_train.data.torchvision_sets import SOURCES
from accel_train.errors import UnreadableFileError, UserError
from accel_train.import_paths import source_of
from accel_train.storage import Store, check_location, is_remote

logger = logging.getLogger(__name__)

JPEG_QUALITY = 90  # images=jpeg: the usual quality of a photograph (and of the bench's folder of them)
SHARD_MB = 256  # webdataset's advice: shards of 100 MB to 1 GB
WRITING_FILE = "shard-writing.json"  # present while a write is under way (or was cut short)
WRITTEN = ".written"  # per split: one entry per complete shard, until the index is written
WRITTEN_SPLITS = ("train", "test")  # and ImageFolder's own val/ beside test/; bench --input writes train alone


@dataclass
class SourceSplit:
    """One split of the source: its samples as tar members, and what the index records of it."""

    split: str
    count: int
    members: Callable[[int], dict[str, bytes]]  # sample i -> {extension: bytes}, its label as "cls" or "target.npy"
    record: dict  # SplitIndex fields: classes, num_classes, channels, image_size, mean, std, transforms, source,
    #               images, shrink_to
    name: Callable[[int], str] = lambda index: f"sample {index}"  # sample i as a damaged one's line names it
    files: list[str] | None = None  # the source file of each sample (relative to data.root), where it is one


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@dataclass(frozen=True)
class ImageStorage:
    """How images are stored (`accel-train shard ... images= shrink_to=`): the source's bytes, raw uint8 pixels, or
    JPEG; shrunk first (raw and JPEG) to a short side of `shrink_to` px where theirs is longer."""

    images: str = "as_given"
    shrink_to: int | None = None

    def of_pixels(self, pixels: torch.Tensor) -> dict[str, bytes]:
        """uint8 (C, H, W) pixels as the image member of a sample."""
        pixels = shrunk(pixels, self.shrink_to)
        if self.images == "raw":
            return {RAW_PIXELS: raw_pixels(pixels)}
        if self.images == "jpeg":
            buffer = io.BytesIO()
            pil_image(pixels).save(buffer, format="JPEG", quality=JPEG_QUALITY)
            return {"jpg": buffer.getvalue()}
        return {"png": _png(pil_image(pixels))}

    def of_file(self, data: bytes, extension: str, name: str, max_pixels: int = MAX_IMAGE_PIXELS) -> dict[str, bytes]:
        """An image file's bytes as the image member of a sample: as they are, or decoded (RGB, where no larger than
        `max_pixels`) and stored anew."""
        if self.images == "as_given":  # the file's own bytes: no second compression
            return {extension if extension in IMAGE_EXTENSIONS else "png": data}
        return self.of_pixels(decode_image_bytes(data, name, "shard", max_pixels))


def _label_members(label) -> dict[str, bytes]:
    """A class index as KEY.cls (webdataset's convention); any other target (a regression's floats) as
    KEY.target.npy, which comes back with its dtype and shape."""
    whole = torch.is_tensor(label) and label.numel() == 1 and not label.is_floating_point() and \
        not label.is_complex()
    if whole or isinstance(label, (int, np.integer)) and not isinstance(label, bool):
        return {"cls": str(int(label)).encode()}
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(label), allow_pickle=False)
    return {"target.npy": buffer.getvalue()}


def _in_memory(cfg: DataConfig, data, split: str, storage: ImageStorage) -> SourceSplit:
    images, labels = data.dataset.images.cpu(), data.dataset.labels.cpu()
    channels, side = images.shape[1], images.shape[-1]
    source = SOURCES[cfg.name]
    mean, std = given_normalization(cfg, channels) or (source.mean, source.std)

    def members(index: int) -> dict[str, bytes]:
        return {**storage.of_pixels(images[index]), "cls": str(int(labels[index])).encode()}
    return SourceSplit(split, len(labels), members, dict(classes=data.classes, num_classes=data.num_classes,
                                                         channels=channels, image_size=side, mean=list(mean),
                                                         std=list(std), transforms="in_memory", source=cfg.name,
                                                         **asdict(storage)))


def _imagefolder(cfg: DataConfig, dataset, split: str, storage: ImageStorage) -> SourceSplit:
    indices = None
    if isinstance(dataset, Subset):
        dataset, indices = dataset.dataset, list(dataset.indices)
    files = dataset.samples if indices is None else [dataset.samples[index] for index in indices]
    mean, std = given_normalization(cfg, 3) or (IMAGENET_MEAN, IMAGENET_STD)

    def members(index: int) -> dict[str, bytes]:
        path, label = files[index]
        try:
            with open(path, "rb") as file:
                data = file.read()
        except OSError as err:  # a broken link, a file removed since the listing, one we may not read
            raise unreadable_image(f"{path} ({split} split)", "shard", err.strerror or str(err)) from None
        image = storage.of_file(data, path.rsplit(".", 1)[-1].lower(), f"{path} ({split} split)", cfg.max_image_pixels)
        return {**image, "cls": str(label).encode()}
    return SourceSplit(split, len(files), members, dict(classes=list(dataset.classes),
                                                        num_classes=len(dataset.classes), channels=3, image_size=None,
                                                        mean=list(mean), std=list(std), transforms="imagefolder",
                                                        source="imagefolder", **asdict(storage)),
                       lambda index: files[index][0],
                       [os.path.relpath(path, cfg.root) for path, _ in files])


def _hub(cfg: DataConfig, data, split: str, storage: ImageStorage) -> SourceSplit:
    """A Hugging Face dataset's split (data.name=hf:...): each image's stored bytes (or stored anew), its label by the
    training split's class names, ImageFolder's transforms."""
    from accel_train.data.classes import Relabelled
    from accel_train.data.shards.dataset import under_subsets

    dataset, mapping = data.dataset, None
    if isinstance(dataset, Relabelled):
        dataset, mapping = dataset.dataset, dataset.mapping
    base, indices = under_subsets(dataset)
    mean, std = given_normalization(cfg, 3) or (IMAGENET_MEAN, IMAGENET_STD)

    def row(index: int) -> int:
        return int(indices[index]) if indices is not None else index

    def members(index: int) -> dict[str, bytes]:
        encoded, name = base.encoded(row(index))
        label = base.label(row(index))
        return {**storage.of_file(encoded, _extension_of(encoded), name, cfg.max_image_pixels),
                "cls": str(mapping[label] if mapping is not None else label).encode()}
    return SourceSplit(split, len(dataset), members, dict(classes=data.classes, num_classes=data.num_classes,
                                                          channels=3, image_size=None, mean=list(mean), std=list(std),
                                                          transforms="imagefolder", source=cfg.name,
                                                          **asdict(storage)),
                       lambda index: base.encoded(row(index))[1])


def _extension_of(encoded: bytes) -> str:
    """An image's format by its first bytes (a dataset's images carry no file name to go by)."""
    if encoded.startswith(b"\x89PNG"):
        return "png"
    if encoded.startswith(b"\xff\xd8"):
        return "jpg"
    if encoded[:4] == b"RIFF" and encoded[8:12] == b"WEBP":
        return "webp"
    return "png"  # stored under .png; read back by its own first bytes (decode.py)


def _is_image_tensor(inputs) -> bool:
    return torch.is_tensor(inputs) and inputs.dtype == torch.uint8 and inputs.dim() == 3 and inputs.shape[0] in (1, 3)


def _as_written(cfg: DataConfig, data, split: str) -> SourceSplit:
    """A dataset by import path, as its samples come: images (PIL, or uint8 tensors) as PNG, other tensors as .npy."""
    dataset = data.dataset

    def members(index: int) -> dict[str, bytes]:
        sample = dataset[index]
        inputs, label = (sample[0], sample[1]) if isinstance(sample, (tuple, list)) else (sample, None)
        if isinstance(inputs, Image.Image):
            found = {"png": _png(Image.fromarray(np.asarray(inputs)))}  # its pixels as they are (a palette's indices)
        elif _is_image_tensor(inputs):
            found = {"png": _png(pil_image(inputs))}
        else:
            buffer = io.BytesIO()
            np.save(buffer, np.asarray(inputs), allow_pickle=False)
            found = {"npy": buffer.getvalue()}
        return {**found, **(_label_members(label) if label is not None else {})}
    return SourceSplit(split, len(dataset), members, dict(classes=data.classes, num_classes=data.num_classes,
                                                          channels=0, image_size=None, mean=None, std=None,
                                                          transforms="as_written", source=cfg.name))


def storage_for(cfg: DataConfig, images: str, shrink_to: int | None) -> ImageStorage:
    """`images=` and `shrink_to=` for data.name's images: auto stores the registry's datasets (small images: MNIST,
    CIFAR, STL-10) as raw pixels and every other source's images as given; shrinking is for ImageFolder trees."""
    if images not in ("auto", *IMAGE_STORAGE):
        raise UserError(f"shard: images={images}: choose one of auto, {', '.join(IMAGE_STORAGE)}")
    registry, files = cfg.name in SOURCES, cfg.name == "imagefolder" or source_of(cfg.name) == "hf"
    if not (files or registry) and images not in ("auto", "as_given") or shrink_to is not None and not files:
        given = f"images={images}" if shrink_to is None else f"shrink_to={shrink_to}"
        raise UserError(f"shard: {given} is for " + ("ImageFolder trees and hf: datasets; the registry's "
                        "datasets are small and stored as raw pixels" if shrink_to is not None else
                        "the registry's datasets, ImageFolder trees and hf: datasets") + f"; data.name={cfg.name}'s "
                        "samples are written as they come")
    if shrink_to is not None and images not in ("raw", "jpeg"):
        raise UserError(f"shard: shrink_to={shrink_to} stores images anew: give images=raw (pixels, read fastest) or "
                        f"images=jpeg (smaller), not images={images}")
    if images == "auto":
        images = "raw" if registry else "as_given"
    return ImageStorage(images, shrink_to)


def source_splits(cfg: DataConfig, storage: ImageStorage = ImageStorage(),
                  splits: tuple[str, ...] = WRITTEN_SPLITS) -> list[SourceSplit]:
    """The train and test splits of data.name (and ImageFolder's own val/ beside test/), or the train split alone."""
    from accel_train.data import build_dataset
    from accel_train.data.imagefolder import imagefolder_data, imagefolder_transform, training_split

    if cfg.name == "shards":
        raise UserError("shard: data.name=shards is written already; give the recipe of the data to write")
    if cfg.name == "imagefolder" and cfg.synthetic:
        raise UserError("shard: data.synthetic=true has no image files to write for imagefolder; use a torchvision "
                        "dataset's recipe (fashion_mnist, cifar10, ...) with data.synthetic=true")
    found, classes = [], None
    for split, train in (("train", True), ("test", False)):
        if split not in splits:
            continue
        # the test split labelled by the train split's names; a tree's train/ read whether or not test/ is there
        data = training_split(cfg) if train and cfg.name == "imagefolder" else build_dataset(cfg, train,
                                                                                               classes=classes)
        classes = data.classes if train else classes
        if isinstance(data.dataset, InMemoryImages):
            found.append(_in_memory(cfg, data, split, storage))
        elif source_of(cfg.name) == "hf":
            found.append(_hub(cfg, data, split, storage))
        elif cfg.name == "imagefolder":
            found.append(_imagefolder(cfg, data.dataset, split, storage))
        else:
            found.append(_as_written(cfg, data, split))
    own = own_validation_folder(cfg) if "test" in splits else None
    if own is not None:
        validation = imagefolder_data(cfg, own, imagefolder_transform(cfg, False), cfg.eval_subset, classes=classes)
        found.append(_imagefolder(cfg, validation.dataset, "val", storage))
    return found


def _tar_size(members: dict[str, bytes]) -> int:
    return sum(tarfile.BLOCKSIZE + padded(len(data)) for data in members.values())  # a header and the contents


def write_shards(cfg: DataConfig, output: str, shard_mb: float = SHARD_MB, block_mb: float = BLOCK_BYTES / 2**20,
                 recipe: str = "", images: str = "auto", shrink_to: int | None = None,
                 splits: tuple[str, ...] = WRITTEN_SPLITS) -> None:
    """Every split of data.name (or the train split alone: `splits`) as shards at `output`, its images stored as
    `images` says (storage_for); see the module's docstring for a rerun."""
    from accel_train.data import check_data_name

    check_location(output, "output")
    _check_folder(output)
    check_data_name(cfg)
    storage = storage_for(cfg, images, shrink_to)
    store = Store(output, "output", cfg.store_patience_s)
    settings = {"source": cfg.name, "root": cfg.root, "synthetic": cfg.synthetic, "args": cfg.args,
                "train_subset": cfg.train_subset, "eval_subset": cfg.eval_subset, "shard_mb": shard_mb,
                "block_mb": block_mb}
    if storage != ImageStorage():  # only where not as given: shards written before these settings stay complete
        settings.update(asdict(storage))
    if splits != WRITTEN_SPLITS:
        settings["splits"] = list(splits)
    if _already_written(store, settings):
        return
    started = time.monotonic()
    sources = source_splits(cfg, storage, splits)  # a source that cannot be read is refused before anything is recorded
    store.write(WRITING_FILE, json.dumps(settings).encode())
    written = [_write_split(store, source, settings, int(shard_mb * 2**20), int(block_mb * 2**20),
                            cfg.max_image_pixels) for source in sources]
    store.remove(WRITING_FILE)
    samples = " and ".join(f"{index.samples:,} {index.split}" for index in written)
    shards, size = sum(len(index.shards) for index in written), sum(index.bytes for index in written)
    logger.info(f"shard: wrote {samples} samples in {shards} shards ({size / 1e6:,.1f} MB) to {store.location} in "
                f"{time.monotonic() - started:.1f} s; train from them with: accel-train train {recipe or 'RECIPE'} "
                f"data.name=shards data.root={store.location}{' data.args={}' if cfg.args else ''}")


def _check_folder(output: str) -> None:
    """A local output= is a folder, or goes where one can be made: not a file, nor under one."""
    if is_remote(output):
        return
    for path in (Path(output), *Path(output).parents):
        if path.exists():
            if not path.is_dir():
                raise UserError(f"shard: output={output}: {path} is a file, not a folder; give a folder (or a URL) for "
                                "the shards")
            return


def _recorded(store: Store, name: str, read: Callable[[bytes], object]):
    """A record of an earlier write (its settings, a split's index) as `read` makes it, or one line naming the file
    that cannot be read, exit 3."""
    try:
        return read(store.read(name))
    except (ValueError, KeyError, TypeError) as err:  # JSONDecodeError is a ValueError
        raise UnreadableFileError(f"shard: {store.url(name)} is damaged ({type(err).__name__}: {err}); remove "
                                  f"{store.location} (or that file) and write again, or give another output=") from None


def _already_written(store: Store, settings: dict) -> bool:
    """True when `output` holds these shards complete; a refusal when it holds others or a write of other settings;
    False (write, or finish) otherwise."""
    pending = store.exists(WRITING_FILE)
    if pending:
        before = _recorded(store, WRITING_FILE, json.loads)
        if before != settings:
            raise UserError(f"shard: {store.location} holds a write cut short of other settings "
                            f"({_differences(before, settings)}); run it again with those, or give another output= "
                            "(or remove that one)")
        logger.info(f"shard: finishing the write to {store.location} that was cut short")
        return False
    indexes = [_recorded(store, f"{split}/{INDEX_FILE}", SplitIndex.from_json) for split in SPLITS
               if store.exists(f"{split}/{INDEX_FILE}")]
    if indexes:
        before = indexes[0].settings or {}
        if before != settings:
            raise UserError(f"shard: {store.location} already holds shards of other settings "
                            f"({_differences(before, settings)}); give another output= (or remove that one)")
        held = ", ".join(f"{index.samples:,} {index.split}" for index in indexes)
        logger.info(f"shard: {store.location} already holds these shards complete ({held} samples in "
                    f"{sum(len(index.shards) for index in indexes)} shards); nothing to do")
        return True
    for split in SPLITS:
        if store.names(split):
            raise UserError(f"shard: {store.url(split)} holds files but no {INDEX_FILE}; for tars of your own, "
                            f"give them an index: accel-train shard index {store.location}; else choose another "
                            "output=")
    return False


def _differences(before: dict, now: dict) -> str:
    keys = list(now) + [key for key in before if key not in now]
    return ", ".join(f"{key} {before.get(key)!r} then, {now.get(key)!r} now" for key in keys
                     if before.get(key) != now.get(key)) or "unreadable settings"


def _write_split(store: Store, source: SourceSplit, settings: dict, shard_bytes: int, block_bytes: int,
                 max_pixels: int = MAX_IMAGE_PIXELS) -> SplitIndex:
    """The split's shards and index; an image whose header declares more than `max_pixels` refused (images as given
    are not decoded here, but training would refuse them)."""
    from tqdm.auto import tqdm

    done = sorted(name for name in store.names(f"{source.split}/{WRITTEN}") if name.endswith(".json"))
    shards = [_recorded(store, f"{source.split}/{WRITTEN}/{name}", lambda data: Shard.from_dict(json.loads(data)))
              for name in done]
    first = sum(shard.samples for shard in shards)
    sizes, pending, pending_bytes = set(), [], 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        name = f"shard-{len(shards):06d}.tar"
        data = tar_of(pending)
        shard, _ = index_tar(name, data, block_bytes)
        store.write(f"{source.split}/{name}", data)
        store.write(f"{source.split}/{WRITTEN}/{name}.json", json.dumps(asdict(shard)).encode())
        shards.append(shard)
        pending, pending_bytes = [], 0

    # no bar in a log file (it would get every redraw); the summary stays
    with tqdm(total=source.count, initial=first, desc=f"shard {source.split}", unit="samples",
              disable=bar_disabled(logger)) as bar:
        for index in range(first, source.count):
            members = source.members(index)
            if RAW_PIXELS in members:
                sizes.add(pixels_of(members[RAW_PIXELS]).shape[:0:-1])  # (width, height), as PIL's size
            elif source.record["transforms"] != "as_written":
                image = next(data for extension, data in members.items() if extension in IMAGE_EXTENSIONS)
                with open_image(image, f"{source.name(index)} ({source.split} split)", "shard", max_pixels) as opened:
                    sizes.add(opened.size)
            pending.append((f"{index:09d}", members))
            pending_bytes += _tar_size(members)
            if pending_bytes >= shard_bytes:
                flush()
            bar.update()
        if pending:
            flush()
    record = dict(source.record)
    if record["image_size"] is None:
        record["image_size"] = square_side(sizes)
    index = SplitIndex(source.split, shards, block_bytes=block_bytes, settings=settings, **record)
    if source.files is not None:  # read only to name the source of a sample that does not decode
        store.write(f"{source.split}/{SOURCES_FILE}", json.dumps(source.files).encode())
    store.write(f"{source.split}/{INDEX_FILE}", index.to_json())
    for name in done + [f"{shard.name}.json" for shard in shards[len(done):]]:
        store.remove(f"{source.split}/{WRITTEN}/{name}")
    return index


def index_tars(location: str, block_mb: float = BLOCK_BYTES / 2**20) -> None:
    """`accel-train shard index URL`: an index for each split folder (train/, test/, val/) of tars written by
    webdataset or any tool that keeps a sample's members together (KEY.png + KEY.cls, ...)."""
    from tqdm.auto import tqdm

    check_location(location, "shard index")
    store = Store(location, "shard index")
    found = {split: [name for name in store.names(split) if name.endswith(".tar")] for split in SPLITS}
    if not found["train"] or not (found["test"] or found["val"]):
        raise UserError(f"shard index: {store.location} needs train/*.tar and test/*.tar (or val/*.tar); found "
                        f"{', '.join(f'{split}/: {len(names)} tar(s)' for split, names in found.items())}")
    for split in SPLITS:  # an index accel-train shard wrote records how its images were made: never replaced
        held = _recorded(store, f"{split}/{INDEX_FILE}", SplitIndex.from_json) \
            if store.exists(f"{split}/{INDEX_FILE}") else None
        if held is not None and held.source != "tars":
            raise UserError(f"shard index: {store.url(f'{split}/{INDEX_FILE}')} was written by accel-train shard (from "
                            f"{held.source}), and its classes, normalisation and transforms are theirs: train from "
                            f"the shards as they are (data.name=shards data.root={store.location})")
    indexes, known = [], []
    for split, names in found.items():
        if not names:
            continue
        shards, labels, sizes, kinds = [], [], set(), set()
        for name in tqdm(names, desc=f"index {split}", unit="shards", disable=bar_disabled(logger)):
            data = store.read(f"{split}/{name}")
            try:
                shard, shard_labels = index_tar(name, data, int(block_mb * 2**20))
            except (tarfile.TarError, ValueError) as err:
                raise UnreadableFileError(f"shard index: {store.url(f'{split}/{name}')} is not a whole tar ({err}); "
                                          "write it again, or remove it") from None
            shards.append(shard)
            labels += shard_labels
            for position in range(shard.samples):
                start, end = shard.sample_span(position)
                for extension, payload in sample_members(data[start:end]).items():
                    if extension in IMAGE_EXTENSIONS:  # its header read, no limit: nothing decodes here
                        where = f"{store.url(f'{split}/{name}')} (sample {position}, .{extension})"
                        with open_image(payload, where, "shard index", None) as image:
                            sizes.add(image.size)
                            kinds.add(image.mode)
        known += [label for label in labels if isinstance(label, int)]
        indexes.append(SplitIndex(split, shards, classes=None, num_classes=None, channels=1 if kinds == {"L"} else 3,
                                  image_size=square_side(sizes), mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD),
                                  transforms="imagefolder" if sizes else "as_written", source="tars",
                                  block_bytes=int(block_mb * 2**20), settings={"indexed": names}))
    for index in indexes:  # one count of classes for every split (a test split may lack the last classes)
        index.num_classes = max(known) + 1 if known else None
        store.write(f"{index.split}/{INDEX_FILE}", index.to_json())
        logger.info(f"shard index: {store.url(index.split)}: {index.samples:,} samples in {len(index.shards)} tars "
                    f"({index.bytes / 1e6:,.1f} MB)")
