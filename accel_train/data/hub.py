"""data.name=hf:WHERE: a Hugging Face dataset of images through `datasets`: a Hub name (load_dataset, from the Hub or,
offline with HF_HUB_OFFLINE=1, the Hugging Face cache), a local folder of parquet, arrow or images (load_dataset), or a
folder save_to_disk wrote (load_from_disk).

The image and label columns are found by their feature types (Image, ClassLabel) or named (data.image_column,
data.label_column); the ClassLabel's names are the classes, and an evaluation split is labelled by the training split's
names. Each split's labels are read by the names they were written with: load_dataset gives every split of a folder
of parquet or arrow files the features of the first file it reads, while each file's integers count its own
ClassLabel's names (datasets writes them into each file's schema), so a file's labels are mapped by name; an image
folder's names are those of all its splits' folders, so the training split's are those its samples have. Images go
from the Arrow bytes straight to uint8 tensors (decode.py), through ImageFolder's transforms, each sample's draws
keyed by (seed, epoch, index), and are normalised on the device: the same path as an ImageFolder tree's. A dataset
without an evaluation split holds out data.val_fraction of its training split for it.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from accel_train.config import MAX_IMAGE_PIXELS, DataConfig
from accel_train.config.schema import expand_home
from accel_train.data.classes import labelled_by
from accel_train.data.decode import decode_image_bytes
from accel_train.data.imagefolder import augments, imagefolder_finish, imagefolder_shape, imagefolder_transform
from accel_train.data.in_memory import augment_draws
from accel_train.data.registry import Data
from accel_train.errors import DataNotFoundError, UnreadableFileError, UserError

EVALUATION_SPLITS = ("validation", "valid", "val", "test")  # the first there, where data.eval_split is unset
HOLD_OUT_SEED = 0  # a dataset without an evaluation split: the samples held out for one, the same in every run
# datasets' builders that name a ClassLabel's classes after the folders of every split together
FOLDER_BUILDERS = ("imagefolder",)


class Loaded(NamedTuple):
    splits: object  # a DatasetDict
    source: str | None  # what load_dataset read (the name, or its snapshot in the Hugging Face cache); None: from disk


def where(cfg: DataConfig) -> str:
    """What follows hf:, a Hub name or a local folder (`~` expanded, as in every path key)."""
    return expand_home(cfg.name.partition(":")[2])


@functools.lru_cache(maxsize=4)
def _load(name: str, revision: str | None, args_json: str) -> Loaded:
    """The dataset's splits (a DatasetDict), as `datasets` loads them: its cache prepared once a machine (set-up
    builds the data on each machine's main process first); and where load_dataset read them from."""
    import datasets

    logging.getLogger("datasets").setLevel(logging.ERROR)
    folder, args = Path(name), json.loads(args_json)
    refuse_loading_scripts(name, args)
    source = None
    try:
        if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
            loaded = datasets.load_from_disk(str(folder))
        else:
            try:
                source, loaded = name, datasets.load_dataset(name, revision=revision, **args)
            except ConnectionError:
                source = cached_snapshot(name, revision)
                loaded = datasets.load_dataset(source, **args)
    except RuntimeError as err:  # datasets 4 and later: "Dataset scripts are no longer supported, but found X.py"
        if "scripts are no longer supported" not in str(err):
            raise
        script = str(err).rpartition(" ")[2]
        raise DataNotFoundError(f"data.name=hf:{name} is a dataset loading script ({script}), which datasets "
                                f"{datasets.__version__} does not run and accel-train never does; give a revision "
                                "of it in parquet (the Hub converts many: data.revision=refs/convert/parquet), or a "
                                "folder of parquet, arrow or image files") from None
    except (ConnectionError, FileNotFoundError, OSError) as err:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataNotFoundError(f"data.name=hf:{name}: cannot load it ({text}); offline (HF_HUB_OFFLINE=1) it must be "
                                "in the Hugging Face cache (HF_HOME); a local folder must hold parquet, arrow or image "
                                "files, or what save_to_disk wrote") from None
    except ValueError as err:  # datasets' own words for a config or split it does not know
        raise UserError(f"data.name=hf:{name}: {str(err).splitlines()[0]}") from None
    return Loaded(loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict(train=loaded), source)


def refuse_loading_scripts(name: str, args: dict) -> None:
    """A dataset that is a loading script (a .py named as its folder, datasets' rule, or a .py given itself) is never
    run: datasets before 4 would, with trust_remote_code, which data.args may not pass either."""
    if "trust_remote_code" in args:
        raise UserError(f"data.args.trust_remote_code: a dataset's loading script never runs in accel-train; give "
                        f"data.name=hf:{name} as parquet, arrow or image files (or a save_to_disk folder), and remove "
                        "it")
    folder = Path(name)
    script = folder if folder.suffix == ".py" else folder / f"{folder.name}.py"
    if script.is_file():
        raise DataNotFoundError(f"data.name=hf:{name}: {script} is a dataset loading script, which accel-train never "
                                "runs (nor does datasets from version 4); give a folder of parquet, arrow or image "
                                "files, or one save_to_disk wrote (convert the dataset with its script where you "
                                "trust it)")


def cached_snapshot(name: str, revision: str | None) -> str:
    """The folder of a Hub dataset's files in the Hugging Face cache (`hf download --repo-type dataset NAME` puts them
    there), for datasets' offline mode, which reads only the caches it prepared itself; the original error where the
    cache has none."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, repo_type="dataset", revision=revision, local_files_only=True)
    except Exception:  # not cached: the Hub's own error (above) says it
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub, and the Hugging Face cache has no copy") from None


def splits_of(cfg: DataConfig):
    """The dataset's splits, loaded once a process for the same name, revision and data.args."""
    return _load(where(cfg), cfg.revision, json.dumps(cfg.args, sort_keys=True)).splits


class SplitLabels(NamedTuple):
    labels: np.ndarray  # each sample's label, an index into names
    names: list[str] | None  # the classes the labels index (None: the label column is not a ClassLabel)


def split_labels(cfg: DataConfig, split: str, label: str) -> SplitLabels:
    """The labels of a split and the class names they index, each file's by the names it was written with."""
    return _split_labels(where(cfg), cfg.revision, json.dumps(cfg.args, sort_keys=True), split, label)


@functools.lru_cache(maxsize=8)
def _split_labels(name: str, revision: str | None, args_json: str, split: str, label: str) -> SplitLabels:
    loaded = _load(name, revision, args_json)
    rows = loaded.splits[split]
    labels = np.asarray(rows.select_columns([label]).with_format("numpy")[label])
    names = class_names(rows, label)
    if names is None:
        return SplitLabels(labels, None)
    if rows.info.builder_name in FOLDER_BUILDERS:  # its names: every split's folders; the split's own: its samples'
        present = np.unique(labels)
        return SplitLabels(np.searchsorted(present, labels), [names[index] for index in present])
    files = None if loaded.source is None else file_class_names(loaded.source, revision, args_json, label).get(split)
    if not files or sum(count for count, _ in files) != len(labels):  # numbered by the split's feature alone
        return SplitLabels(labels, names)
    own: list[str] = []
    for _, written in files:
        own += [name for name in written or names if name not in own]
    mapped, start = labels.copy(), 0
    for count, written in files:  # each file's integers count the names it was written with
        position = np.array([own.index(name) for name in written or names])
        mapped[start:start + count] = position[labels[start:start + count]]
        start += count
    return SplitLabels(mapped, own)


@functools.lru_cache(maxsize=4)
def file_class_names(source: str, revision: str | None, args_json: str, label: str) -> dict[str, list]:
    """Each split's data files, in the order load_dataset reads them, as (rows, the names of the ClassLabel `label`
    written into the file's schema, or None where it holds none): {} for data files of another format."""
    import datasets

    args = json.loads(args_json)
    if "split" in args:  # one split, perhaps a slice of one: numbered by its feature
        return {}
    # the arguments load_dataset takes for itself (num_proc, keep_in_memory, ...), not for the builder
    load_only = set(inspect.signature(datasets.load_dataset).parameters) - \
        set(inspect.signature(datasets.load_dataset_builder).parameters)
    builder = datasets.load_dataset_builder(source, revision=revision,
                                            **{key: value for key, value in args.items() if key not in load_only})
    reading = {"parquet": _parquet_file, "arrow": _arrow_file}.get(builder.name)
    if reading is None or not builder.config.data_files:
        return {}
    paths = datasets.DownloadManager().download({split: list(files) for split, files in
                                                 builder.config.data_files.items()})  # already in the cache
    found = {}
    for split, files in paths.items():
        found[split] = []
        for path in files:
            count, schema = reading(path)
            feature = datasets.Features.from_arrow_schema(schema).get(label) if schema.metadata else None
            found[split].append((count, list(feature.names) if isinstance(feature, datasets.ClassLabel) else None))
    return found


def _parquet_file(path: str):
    """(rows, schema) of a parquet file: its footer alone."""
    import pyarrow.parquet as pq

    metadata = pq.read_metadata(path)
    return metadata.num_rows, metadata.schema.to_arrow_schema()


def _arrow_file(path: str):
    """(rows, schema) of an Arrow IPC file (a stream, as datasets writes them, or the file format), memory-mapped: its
    batches' headers read, not their data."""
    import pyarrow as pa

    with pa.memory_map(path) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except pa.lib.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches)), reader.schema
        return sum(batch.num_rows for batch in reader), reader.schema


def evaluation_split(cfg: DataConfig) -> str | None:
    """The split evaluation reads: data.eval_split, else the first of EVALUATION_SPLITS there; None: the training
    split's held-out part (data.val_fraction)."""
    splits = splits_of(cfg)
    if cfg.eval_split is not None:
        if cfg.eval_split not in splits:
            raise UserError(f"data.eval_split={cfg.eval_split}: data.name={cfg.name} has the splits "
                            f"{', '.join(splits)}")
        return cfg.eval_split
    found = next((name for name in EVALUATION_SPLITS if name in splits), None)
    if found is None and not cfg.val_fraction:
        raise UserError(f"data.name={cfg.name} has no evaluation split (its splits: {', '.join(splits)}); set "
                        "data.val_fraction (e.g. 0.1) to hold out that part of its training split for evaluation, or "
                        "data.eval_split=NAME")
    return found


def holds_out_evaluation(cfg: DataConfig) -> bool:
    """Whether data.val_fraction made the evaluation split (the dataset has none): then there is no other
    validation split to hold out."""
    return evaluation_split(cfg) is None


def columns(cfg: DataConfig, split) -> tuple[str, str | None]:
    """(image column, label column) of a split: named by data.image_column / data.label_column, else the one of the
    Image feature type and the one of the ClassLabel type (None: a dataset without labels by class)."""
    import datasets

    features = split.features

    def one(key: str, given: str | None, kind: type) -> str | None:
        if given is not None:
            if given not in features:
                raise UserError(f"data.{key}={given}: data.name={cfg.name} has the columns {', '.join(features)}")
            return given
        found = [name for name, feature in features.items() if isinstance(feature, kind)]
        if len(found) == 1:
            return found[0]
        if key == "label_column" and not found:
            return None
        described = f"the columns {', '.join(found)} are" if found else "no column is"
        raise UserError(f"data.name={cfg.name}: {described} of the {kind.__name__} type; name the one to use with "
                        f"data.{key}=NAME (its columns: {', '.join(features)})")

    image = one("image_column", cfg.image_column, datasets.Image)
    label = one("label_column", cfg.label_column, datasets.ClassLabel)
    if label is None and "label" in features:
        label = "label"
    if label is None:
        raise UserError(f"data.name={cfg.name}: no column of labels (ClassLabel, or one named label); name it with "
                        f"data.label_column=NAME (its columns: {', '.join(features)})")
    return image, label


class HubImages(Dataset):
    """A split's (image, label) samples: the image from the Arrow bytes into a uint8 tensor (no larger than
    `max_pixels`: datasets' own decoding, through PIL, is turned off), then `transform`."""

    def __init__(self, split, image_column: str, labels: np.ndarray, transform, name: str,
                 max_pixels: int | None = MAX_IMAGE_PIXELS) -> None:
        import datasets

        self.rows = split.select_columns([image_column]).cast_column(image_column, datasets.Image(decode=False))
        self.image_column, self.labels, self.transform, self.name = image_column, labels, transform, name
        self.max_pixels = max_pixels

    def __len__(self) -> int:
        return len(self.rows)

    def encoded(self, index: int) -> tuple[bytes, str]:
        """Sample `index`'s image bytes as stored, and its name for a line about it."""
        image = self.rows[index][self.image_column]
        name = f"{self.name} sample {index}" + (f" ({image['path']})" if image.get("path") else "")
        if image.get("bytes") is not None:
            return image["bytes"], name
        try:  # a dataset of image files keeps their paths
            return Path(image["path"]).read_bytes(), name
        except (OSError, TypeError) as err:
            raise UnreadableFileError(f"hf: cannot read {name} ({err})") from None

    def label(self, index: int) -> int:
        return int(self.labels[index])

    def __getitem__(self, index: int):
        data, name = self.encoded(index)
        image = decode_image_bytes(data, name, "hf", self.max_pixels)
        return (self.transform(image) if self.transform is not None else image), self.label(index)


def hub_dataset(cfg: DataConfig, train: bool, classes: list[str] | None = None) -> Data:
    """The training split (or the evaluation split, labelled by `classes`: the run's, else the training split's
    ClassLabel names) of data.name=hf:..."""
    splits = splits_of(cfg)
    if cfg.train_split not in splits:
        raise UserError(f"data.train_split={cfg.train_split}: data.name={cfg.name} has the splits {', '.join(splits)}")
    train_rows = splits[cfg.train_split]
    evaluated = evaluation_split(cfg)
    rows = train_rows if train or evaluated is None else splits[evaluated]
    image, label = columns(cfg, rows)
    split_name = cfg.train_split if train or evaluated is None else evaluated
    labels, names = split_labels(cfg, split_name, label)
    dataset = HubImages(rows, image, labels, imagefolder_transform(cfg, train), f"{cfg.name} {split_name}",
                        cfg.max_image_pixels)
    dataset.draws_from = augment_draws(augments(cfg, train))  # KeyedSamples seeds what they draw from
    if evaluated is None:  # no evaluation split: data.val_fraction of the training split is held out for it
        held, kept = held_out(len(train_rows), cfg.val_fraction)
        dataset = Subset(dataset, held if not train else kept)
    limit = cfg.train_subset if train else cfg.eval_subset
    if limit is not None:
        dataset = Subset(dataset, range(min(limit, len(dataset))))
    num_classes = cfg.num_classes or (len(names) if names else None)
    if num_classes is None:
        raise UserError(f"data.name={cfg.name}: its label column {label} names no classes (not a ClassLabel); set "
                        "data.num_classes")
    data = Data(dataset, num_classes, imagefolder_shape(cfg), names, finish=imagefolder_finish(cfg))
    if train:
        return data
    return labelled_by(data, classes or split_labels(cfg, cfg.train_split, columns(cfg, train_rows)[1]).names,
                       f"data.name={cfg.name}: the {evaluated or 'held-out'} split")


def class_names(rows, label: str) -> list[str] | None:
    import datasets

    feature = rows.features[label]
    return list(feature.names) if isinstance(feature, datasets.ClassLabel) else None


def held_out(count: int, fraction: float) -> tuple[list[int], list[int]]:
    """(held out, kept) indices of a training split of `count` samples: `fraction` of them drawn by HOLD_OUT_SEED,
    each list in order."""
    held = round(count * fraction)
    if not 0 < held < count:
        raise UserError(f"data.val_fraction={fraction} holds out {held} of the {count} training samples; choose a "
                        "fraction that leaves samples in both splits")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(HOLD_OUT_SEED))
    return order[:held].sort().values.tolist(), order[held:].sort().values.tolist()


def check_hub_data(cfg: DataConfig) -> None:
    """Before any data loads: datasets is there (a dependency), and the name names something."""
    if not where(cfg):
        raise UserError("data.name=hf: names no dataset; give a Hub name (hf:beans), a local folder (hf:./my_data) or "
                        "a save_to_disk folder")
