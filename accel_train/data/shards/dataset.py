"""data.name=shards: the samples of a shard set at data.root (a folder or any fsspec URL), read one by one through
this node's block cache and transformed as the data they were written from would be."""

from __future__ import annotations

import io
import json
import logging
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Subset
from torchvision import transforms as T
from torchvision.transforms import v2

from accel_train.config import MAX_IMAGE_PIXELS, DataConfig
from accel_train.data.channels import converted_normalization, model_channels
from accel_train.data.classes import labelled_by
from accel_train.data.decode import Crops, decode_image_bytes, decoded, open_image, shrunk
from accel_train.data.imagefolder import (
    augments,
    crop_region_transform,
    imagefolder_finish,
    imagefolder_shape,
    imagefolder_transform,
)
from accel_train.data.in_memory import (
    PixelsToModelInput,
    augment_draws,
    per_sample_transform,
    pil_image,
    pixels_transform,
)
from accel_train.data.registry import DATASETS, Data, given_normalization
from accel_train.data.shards.cache import BlockCache, default_cache_dir
from accel_train.data.shards.format import (
    IMAGE_EXTENSIONS,
    INDEX_FILE,
    RAW_PIXELS,
    SOURCES_FILE,
    SplitIndex,
    label_of,
    pixels_of,
    sample_members,
)
from accel_train.distributed.environment import launcher_environment
from accel_train.errors import DataNotFoundError, UnreadableFileError, UserError
from accel_train.storage import Store, check_location

logger = logging.getLogger(__name__)

WRITE_HINT = "write them with accel-train shard RECIPE output=URL (or index tars of your own with accel-train shard " \
             "index URL)"
REWRITE_HINT = "write the shards again with accel-train shard (or index tars of your own again with accel-train " \
               "shard index URL)"


def _array(payload: bytes) -> np.ndarray:
    """A .npy member's array, without pickles: an object array is refused (ValueError), never unpickled."""
    return np.load(io.BytesIO(payload), allow_pickle=False)


def read_index(store: Store, split: str, required: bool = True) -> SplitIndex | None:
    """The split's index, or (not `required`) None where the store has none."""
    name = f"{split}/{INDEX_FILE}"
    try:
        data = store.read(name)
    except FileNotFoundError:
        if not required:
            return None
        raise DataNotFoundError(f"data.root={store.location}: no {split} shards ({name} not found); "
                                f"{WRITE_HINT}") from None
    try:
        return SplitIndex.from_json(data)
    except (ValueError, KeyError, TypeError) as err:
        raise DataNotFoundError(f"{store.url(name)} is not an index of accel-train shards ({err}); {WRITE_HINT}"
                                ) from None


def _refuse_missing_shards(store: Store, split: str, index: SplitIndex) -> None:
    """Every shard the index lists is in the store (one listing): a shard deleted since would otherwise stop the run
    at its first read, maybe an epoch in (the block cache then says so in one line too)."""
    present = set(store.names(split))
    missing = [shard.name for shard in index.shards if shard.name not in present]
    if missing:
        more = f" and {len(missing) - 1} more of its {len(index.shards)}" if len(missing) > 1 else ""
        raise DataNotFoundError(f"data.root={store.location}: {split}/{INDEX_FILE} lists {missing[0]}{more}, which "
                                "the store does not have (deleted or moved after the index was written); put "
                                f"{'them' if more else 'it'} back, or write the shards again with accel-train shard")


def eval_split(store: Store) -> tuple[str, SplitIndex]:
    for split in ("test", "val"):
        index = read_index(store, split, required=False)
        if index is not None:
            return split, index
    raise DataNotFoundError(f"data.root={store.location}: no test (or val) shards to evaluate on; {WRITE_HINT}")


class ShardSamples(Dataset):
    """A split's samples by id (ids count through the shards in the index's order), each read from its block in this
    node's cache and decoded (an image no larger than `max_pixels`: data.max_image_pixels); `transform` turns the
    decoded image into the model's input, as `transform` of torchvision's datasets does (the validation split swaps
    it for the test split's)."""

    def __init__(self, index: SplitIndex, split: str, cache: BlockCache, transform, image_mode: str | None,
                 max_pixels: int | None = MAX_IMAGE_PIXELS) -> None:
        self.index, self.split, self.cache, self.transform, self.image_mode = index, split, cache, transform, image_mode
        self.max_pixels = max_pixels
        self.starts = index.shard_starts()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, sample: int) -> tuple[int, int]:
        """(shard number, position in it) of sample id `sample`."""
        shard = int(np.searchsorted(self.starts, sample, side="right")) - 1
        return shard, sample - int(self.starts[shard])

    def shard_of(self) -> np.ndarray:
        """The shard number of every sample id."""
        return np.repeat(np.arange(len(self.index.shards)), np.diff(self.starts))

    def members(self, sample: int) -> dict[str, bytes]:
        return self.members_at(*self.locate(sample))

    def members_at(self, shard: int, position: int) -> dict[str, bytes]:
        """The tar members of the sample at `position` in shard number `shard`; one line where the tar's headers there
        are not those of one sample, as the index's offsets say."""
        entry = self.index.shards[shard]
        try:
            return sample_members(self.cache.read_sample(entry, self.split, position))
        except ValueError as err:
            raise UnreadableFileError(
                f"shards: cannot read {self.cache.store.url(self.split)}/{entry.name} (sample {position}): {err}; its "
                f"index ({self.split}/{INDEX_FILE}) does not describe the tar: {REWRITE_HINT}") from None

    def __getitem__(self, sample: int):
        return self._made(sample, self.members(sample))

    def __getitems__(self, samples: list[int]) -> list:
        """A batch's samples: their shards and places found in one search over the batch, not one a sample (a
        quarter of the time a 28 px raw sample takes here); each sample then made as __getitem__ makes it. The
        DataLoader's fetcher calls this (through KeyedSamples, where no transform draws at random)."""
        ids = np.asarray(samples, dtype=np.int64)
        shards = np.searchsorted(self.starts, ids, side="right") - 1
        positions = ids - self.starts[shards]
        return [self._made(sample, self.members_at(shard, position))
                for sample, shard, position in zip(samples, shards.tolist(), positions.tolist())]

    def _made(self, sample: int, members: dict[str, bytes]):
        """Sample id `sample`, of those tar `members`, as the model's input (transformed) and its label or target."""
        found = next((extension for extension in IMAGE_EXTENSIONS if extension in members), None)
        if RAW_PIXELS in members:  # nothing to decode (the copy: a tensor of its own, writable)
            inputs = torch.from_numpy(self._parsed(sample, RAW_PIXELS, pixels_of, members).copy())
        elif found is not None and self.index.transforms == "imagefolder":  # straight into a tensor, as ImageFolder
            inputs = decode_image_bytes(members[found], SampleName(self, sample, found), "shards", self.max_pixels)
        elif found is not None:
            name = SampleName(self, sample, found)
            inputs = decoded(open_image(members[found], name, "shards", self.max_pixels), name, "shards",
                             self.image_mode)
        elif "npy" in members:
            inputs = torch.from_numpy(self._parsed(sample, "npy", _array, members))
        else:
            raise DataNotFoundError(f"{self.cache.store.url(self.split)}: sample {sample} has no image (.png, .jpg, "
                                    f"..., .{RAW_PIXELS}) nor .npy member, only {sorted(members)}; {WRITE_HINT}")
        if self.transform is not None:
            inputs = self.transform(inputs)
        if "target.npy" in members:  # a target other than a class, as the dataset gave it (writer.py)
            return inputs, torch.from_numpy(self._parsed(sample, "target.npy", _array, members))
        extension = next((extension for extension in ("cls", "json") if extension in members), None)
        if extension is None and self.index.transforms != "as_written":  # every sample of these was written labelled
            shard, position = self.locate(sample)
            raise UnreadableFileError(f"shards: cannot read {self.cache.store.url(self.split)}/"
                                      f"{self.index.shards[shard].name} (sample {position}): it has no label (.cls or "
                                      f".json), only {sorted(members)}; {REWRITE_HINT}")
        return inputs, None if extension is None else self._parsed(
            sample, extension, lambda payload: label_of(extension, payload), members)

    def _parsed(self, sample: int, extension: str, parse, members: dict[str, bytes]):
        """Member `extension` of sample id `sample` as `parse` reads it; one line naming the sample where it cannot:
        an object array (np.load reads no pickles), pixels not uint8, a label that is not one."""
        try:
            return parse(members[extension])
        except ValueError as err:
            raise UnreadableFileError(f"shards: cannot read {SampleName(self, sample, extension)}: {err}; "
                                      f"{REWRITE_HINT}") from None

    def source_file(self, sample: int) -> str | None:
        """The file sample id `sample` was written from (SOURCES_FILE, beside the index), or None where none is
        recorded (the registry's images, tars of one's own, shards written before it was)."""
        if not hasattr(self, "sources"):
            try:
                self.sources = json.loads(self.cache.store.read(f"{self.split}/{SOURCES_FILE}"))
            except (FileNotFoundError, ValueError):
                self.sources = None
        if self.sources is None or sample >= len(self.sources):
            return None
        root = (self.index.settings or {}).get("root")  # data.root as the write was given it
        return f"{root.rstrip('/')}/{self.sources[sample]}" if root else self.sources[sample]


class SampleName:
    """A sample as the line of one that does not decode names it: its shard and place there, and the source file it
    was written from. Made into text only for that line (str), so the source list is read only then."""

    def __init__(self, samples: ShardSamples, sample: int, extension: str) -> None:
        self.samples, self.sample, self.extension = samples, sample, extension

    def __str__(self) -> str:
        shard, position = self.samples.locate(self.sample)
        source = self.samples.source_file(self.sample)
        written_from = f"; written from {source}" if source is not None else ""
        return (f"{self.samples.cache.store.url(self.samples.split)}/{self.samples.index.shards[shard].name} "
                f"(sample {position}, .{self.extension}{written_from})")


def open_store(cfg: DataConfig) -> Store:
    check_location(cfg.root, "data.root")
    return Store(cfg.root, "data.root", cfg.store_patience_s)


def block_cache(cfg: DataConfig, store: Store) -> BlockCache:
    folder = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    # a file there would stop the first read of a block, in a DataLoader worker, with a traceback
    existing = next((path for path in (folder, *folder.parents) if path.exists()), None)
    if existing is not None and not existing.is_dir():
        what = "is a file" if existing == folder else f"is under {existing}, a file"
        default = "" if cfg.cache_dir else " (data.cache_dir's default)"
        raise UserError(f"data.cache_dir={cfg.cache_dir or folder}{default} {what}, not a folder: give a folder for "
                        "this machine's cache of shard blocks")
    return BlockCache(store, folder, int(cfg.cache_gb * 1e9))


def recorded_normalization(index: SplitIndex) -> tuple[tuple, tuple] | None:
    return (tuple(index.mean), tuple(index.std)) if index.mean is not None else None


def finish_of(cfg: DataConfig, index: SplitIndex):
    """How the split's uint8 batches become the model's input on the device: normalised there (and, for the
    registry's images, resized to data.image_size); samples as written are the model's input already (None)."""
    if index.transforms == "imagefolder":
        return imagefolder_finish(cfg, recorded_normalization(index))
    if index.transforms == "in_memory":
        return PixelsToModelInput(*_in_memory_normalization(cfg, index), cfg.image_size or index.image_size)
    return None


def _in_memory_normalization(cfg: DataConfig, index: SplitIndex) -> tuple[tuple, tuple]:
    channels = model_channels(cfg, index.channels, f"data.root={cfg.root} (shards of {index.source})")
    if not cfg.normalize:
        return (0.0,) * channels, (1.0,) * channels
    return given_normalization(cfg, channels) or converted_normalization(
        *(recorded_normalization(index) or ((0.5,) * index.channels,) * 2), channels)


def transform_of(cfg: DataConfig, index: SplitIndex, train: bool):
    """How a decoded sample becomes the model's input: as the data the shards were written from transforms it."""
    if index.transforms == "as_written":
        if train and (cfg.trivial_augment or cfg.random_erasing):
            raise UserError(f"data.trivial_augment / data.random_erasing: the shards at data.root={cfg.root} hold the "
                            f"samples of data.name={index.source}, a dataset by import path, as its own transforms "
                            "made them; augment them in that dataset, or leave both keys out")
        return lambda inputs: inputs if torch.is_tensor(inputs) else v2.functional.to_dtype(
            v2.functional.pil_to_tensor(inputs), torch.float32, scale=True)
    if crops_on_device(cfg, index, train):
        return crop_region_transform()
    if index.transforms == "imagefolder":
        return imagefolder_transform(cfg, train, recorded_normalization(index))
    side = index.image_size
    if side is None:
        raise DataNotFoundError(f"data.root={cfg.root}: the {index.split} shards' images differ in size, which their "
                                f"transforms ({index.transforms}) need alike; {WRITE_HINT}")
    if train and (cfg.trivial_augment or cfg.random_erasing):  # on PIL images and normalised floats, on the host
        return T.Compose([T.Lambda(as_pil_image), per_sample_transform(
            side, *_in_memory_normalization(cfg, index), cfg.augment, cfg.image_size or side, cfg.trivial_augment,
            cfg.random_erasing)])
    # uint8 to the device: finish_of crops and flips there (augments_on_device), and normalises
    return pixels_transform()


def augments_on_device(cfg: DataConfig, index: SplitIndex, train: bool) -> bool:
    """Whether the split's crops and flips run on the device (by random_crop_flip, from each sample's key): the
    registry's images, augmented without TrivialAugment or random erasing (those run on the host)."""
    return train and index.transforms == "in_memory" and cfg.augment and not (cfg.trivial_augment or
                                                                              cfg.random_erasing)


def crops_on_device(cfg: DataConfig, index: SplitIndex, train: bool) -> bool:
    """Whether the split's random crops of raw pixels are resized on the device (Crops): shards of an ImageFolder
    tree stored as raw pixels, augmented without TrivialAugment or random erasing (those run on the host)."""
    return train and index.transforms == "imagefolder" and index.images == "raw" and cfg.augment and not (
        cfg.trivial_augment or cfg.random_erasing)


def as_pil_image(image) -> Image.Image:
    """Raw pixels as the PIL image a PNG of them decodes to; a PIL image as it is."""
    return pil_image(image) if torch.is_tensor(image) else image


def input_shape(cfg: DataConfig, index: SplitIndex) -> tuple[int, ...]:
    if index.transforms == "imagefolder":
        return imagefolder_shape(cfg)
    if index.transforms == "as_written":
        return ()
    size = cfg.image_size or index.image_size
    return len(_in_memory_normalization(cfg, index)[0]), size, size


def image_mode(index: SplitIndex) -> str | None:
    """The PIL mode images are read in: RGB as ImageFolder's loader gives them, or the source's own channels."""
    if index.transforms == "imagefolder":
        return "RGB"
    return {1: "L", 3: "RGB"}.get(index.channels) if index.transforms == "in_memory" else None


@DATASETS.register("shards")
def shards(cfg: DataConfig, train: bool, classes: list[str] | None = None) -> Data:
    """The train (or the test, else val) split of the shards at data.root. The evaluation split's labels index
    `classes` (the run's) by name; None: the train split's (shards written before labels were matched by name index
    each split's own classes)."""
    store = open_store(cfg)
    split, index = ("train", read_index(store, "train")) if train else eval_split(store)
    _refuse_missing_shards(store, split, index)
    if train:
        _warn_of_a_cache_below_a_window(cfg, index)
    dataset = _split_samples(cfg, store, split, index, train)
    first = dataset[0] if index.transforms == "as_written" else None
    shape = tuple(first[0].shape) if first is not None else input_shape(cfg, index)
    data = Data(dataset, cfg.num_classes or index.num_classes, shape, index.classes, first, finish_of(cfg, index))
    return data if train else _labelled(data, store, split, classes)


def _labelled(data: Data, store: Store, split: str, classes: list[str] | None) -> Data:
    """An evaluation split labelled by the run's classes, else by the train split's."""
    if classes is None and data.classes is not None:
        train = read_index(store, "train", required=False)
        classes = train.classes if train is not None else None
    return labelled_by(data, classes, f"data.root={store.location}: the {split} shards")


def _split_samples(cfg: DataConfig, store: Store, split: str, index: SplitIndex, train: bool) -> Dataset:
    """A split's samples as the model reads them: transformed, limited by data.train_subset / data.eval_subset."""
    dataset = ShardSamples(index, split, block_cache(cfg, store), transform_of(cfg, index, train), image_mode(index),
                           cfg.max_image_pixels)
    dataset.augments_on_device = augments_on_device(cfg, index, train)  # the loader adds each sample's key
    dataset.collate_fn = Crops.collate if crops_on_device(cfg, index, train) else None  # crops differ in size
    dataset.draws_from = augment_draws(index.transforms != "as_written" and augments(cfg, train) and
                                       not dataset.augments_on_device)
    limit = cfg.train_subset if train else cfg.eval_subset
    return dataset if limit is None else Subset(dataset, range(min(limit, len(dataset))))


def _warn_of_a_cache_below_a_window(cfg: DataConfig, index: SplitIndex) -> None:
    """A cache that cannot hold the shards a global batch is drawn from evicts blocks before their other samples are
    read: the run stays correct, but downloads each block again for about every sample (measured: 10 samples/s)."""
    window = min(cfg.shuffle_window_shards, len(index.shards)) * index.bytes / len(index.shards)
    if cfg.cache_gb * 1e9 < window and launcher_environment().is_reporting_process:
        logger.warning(f"data.cache_gb={cfg.cache_gb:g} holds less than one window of shards "
                       f"(data.shuffle_window_shards={cfg.shuffle_window_shards}, {window / 1e9:.2g} GB): blocks are "
                       "downloaded again and again, and training is slow; raise data.cache_gb, or lower "
                       "data.shuffle_window_shards")


def under_subsets(dataset) -> tuple[Dataset, np.ndarray | None]:
    """The dataset under `dataset`'s Subsets (data.train_subset), and the id there of each of its indices (None: the
    identity)."""
    indices = None
    while isinstance(dataset, Subset):
        inner = np.asarray(dataset.indices)
        indices = inner if indices is None else inner[indices]
        dataset = dataset.dataset
    return dataset, indices


def shard_layout(dataset) -> tuple[np.ndarray, int] | None:
    """(the shard number of each of the dataset's indices, the shard count) when `dataset` is shards (in Subsets),
    else None."""
    base, indices = under_subsets(dataset)
    if not isinstance(base, ShardSamples):
        return None
    shard_of = base.shard_of()
    return (shard_of if indices is None else shard_of[indices]), len(base.index.shards)


def validation_split(cfg: DataConfig, classes: list[str] | None = None) -> Data | None:
    """The shards' own val split where a test split is there too (as ImageFolder's val/ beside test/), else None;
    labelled by `classes` (the run's) as the test split is."""
    store = open_store(cfg)
    if read_index(store, "test", required=False) is None:
        return None
    index = read_index(store, "val", required=False)
    if index is None:
        return None
    data = Data(_split_samples(cfg, store, "val", index, train=False), cfg.num_classes or index.num_classes,
                input_shape(cfg, index), index.classes, finish=finish_of(cfg, index))
    return _labelled(data, store, "val", classes)


def image_converter(cfg: DataConfig):
    """How predict turns one image file into the model's input: as the shards' evaluation split turns its images."""
    index = eval_split(open_store(cfg))[1]
    transform, mode = transform_of(cfg, index, False), image_mode(index)
    side = index.image_size if index.transforms == "in_memory" else None

    finish = finish_of(cfg, index)

    def convert(image: Image.Image) -> torch.Tensor:
        image = image.convert(mode) if mode else image
        if side and image.size != (side, side):  # the shards' own resolution first, as their images have it
            image = image.resize((side, side), Image.Resampling.BILINEAR)
        if index.shrink_to:  # and shrunk as they were written
            image = shrunk(v2.functional.pil_to_tensor(image), index.shrink_to)
        return finish.images(transform(image)) if finish else transform(image)
    shape = input_shape(cfg, index)
    return convert, shape or None


def same_images(recorded: dict, data: DataConfig) -> bool:
    """Shards and the data they were written from hold the same images: a run trained on one may be evaluated on
    the other (their index records the source's name, classes and normalisation)."""
    before, now = recorded.get("name"), data.name
    if before == "shards" and now != "shards":
        return written_from(str(recorded.get("root"))) == now
    if now == "shards" and before != "shards":
        return written_from(data.root) == before
    return False


@lru_cache(maxsize=8)
def written_from(root: str) -> str | None:
    """The data.name the shards at `root` were written from (their test split's record), or None if unreadable."""
    try:
        store = Store(root, "data.root", patience_s=5.0)
        return eval_split(store)[1].source
    except Exception:  # any failure to read means "not known to be the same data": the refusal stands
        return None


