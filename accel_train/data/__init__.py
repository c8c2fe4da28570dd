"""Data: datasets by name (the torchvision sets in memory, ImageFolder trees, a user's dataset by import path),
the validation split, and the loaders that feed the loop (a training run's, all three: run_data); every augmentation
keyed by (seed, epoch, sample).

Datasets that fit in memory (the MNIST family, CIFAR-10, STL-10) are kept as one uint8 tensor and, with
data.on_device, moved once to the training device and served a whole batch at a time from there (in_memory.py).
With data.on_device=false, and always for ImageFolder and a user's dataset, a DataLoader runs per-sample transforms
(in worker processes where cores allow), each sample's random draws keyed by (seed, epoch, its index) as the
on-device augmentation is (keyed.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.utils.data import DataLoader, Dataset

from accel_train import hooks
from accel_train.config import DataConfig
from accel_train.data import imagefolder, torchvision_sets  # noqa: F401  (registration)
from accel_train.data.classes import labelled_by
from accel_train.data.imagefolder import load_image
from accel_train.data.in_memory import InMemoryImages
from accel_train.data.keyed import KeyedSamples, sample_keys
from accel_train.data.loaders import make_loader, received_finish, slow_input_advice, start_epoch
from accel_train.data.predict_inputs import image_converter
from accel_train.data.registry import DATASETS, Data
from accel_train.data.shards import dataset as _shards  # noqa: F401  (registration)
from accel_train.data.torchvision_sets import SOURCES
from accel_train.data.user import from_dataset, user_dataset, user_function
from accel_train.data.validation import hold_out_validation, validation_split
from accel_train.distributed.accelerator import round_up_to_world
from accel_train.errors import UserError
from accel_train.import_paths import is_given_object, is_import_path, source_of

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["DATASETS", "Data", "DataSource", "InMemoryImages", "KeyedSamples", "Loaders", "RunData", "build_dataset",
           "check_data_name", "data_source", "from_dataset", "hold_out_validation", "image_converter", "load_image",
           "make_loader", "received_finish", "run_data", "sample_keys", "slow_input_advice", "start_epoch"]


@dataclass
class Loaders:
    """A training run's loaders; `val` None where the test set selects."""

    train: DataLoader
    test: DataLoader
    val: DataLoader | None


@dataclass
class RunData:
    """A training run's data: its training split, the test set, and the validation split held out (None: the test
    set selects the model). Every split is labelled by the training split's class names."""

    train: Data
    test: Data
    val: Data | None

    @property
    def selecting_split(self) -> str:
        """The split that evaluations during training measure and select on."""
        return "val" if self.val is not None else "test"

    def loaders(self, cfg: DataConfig, batch_size: int, eval_batch_size: int, accelerator: Accelerator,
                accumulation: int, sample_indices: bool) -> Loaders:
        """The training split's loader of `accumulation` micro-batches a step (each sample's index beside it with
        `sample_indices`), and the evaluation splits' of eval_batch_size rounded up to split across processes."""
        every, device = hooks.every(), accelerator.device
        train = make_loader(every.data_built(self.train, "train"), cfg, batch_size, True, device, accumulation,
                            sample_indices=sample_indices)
        eval_batch = round_up_to_world(eval_batch_size, accelerator)
        test = make_loader(every.data_built(self.test, "test"), cfg, eval_batch, False, device)
        val = make_loader(every.data_built(self.val, "val"), cfg, eval_batch, False, device) if self.val else None
        return Loaders(train, test, val)


@dataclass(frozen=True)
class DataSource:
    """Where data.name's samples come from, decided once for all of a run's splits: "import path" (a user's
    `function`, imported and checked), "given" (an object passed to accel_train.train), "hf" (a Hub dataset) or
    "registry"."""

    kind: str
    function: Callable | None = None


def data_source(cfg: DataConfig) -> DataSource:
    function = user_function(cfg)
    if function is not None:
        return DataSource("import path", function)
    if is_given_object(cfg.name):
        return DataSource("given")
    return DataSource("hf" if source_of(cfg.name) == "hf" else "registry")


def run_data(cfg: DataConfig, seed: int, accelerator: Accelerator, source: DataSource,
             train_dataset: Dataset | None = None, eval_dataset: Dataset | None = None) -> RunData:
    """The data data.name names (its `source`, as data_source found it), or the datasets given, fetched by each node's
    main process first, and the validation split data.val_fraction (or the data's own) holds out."""
    with accelerator.local_main_process_first():  # the main process of each node fetches, the others then read
        train = source_dataset(source, cfg, train=True, given=train_dataset)
        # labelled by the training split's class names: an evaluation split lacking a class is not shifted
        test = source_dataset(source, cfg, train=False, given=eval_dataset, classes=train.classes)
    train, val = validation_split(cfg, seed, train, test, from_hub=source.kind == "hf")
    if cfg.channels is None and len(train.image_shape) == 3:  # recorded in config.yaml: eval and predict convert alike
        cfg.channels = train.image_shape[0]
    return RunData(train, test, val)


def build_dataset(cfg: DataConfig, train: bool, given: Dataset | None = None,
                  classes: list[str] | None = None) -> Data:
    """The dataset data.name names (one of the registry, or the user's by import path), or the one `given`. An
    evaluation split's labels index `classes` (the run's: its training split's names) by name; None: the data's own
    training split's, where it has one of its own (an ImageFolder tree, shards)."""
    return source_dataset(data_source(cfg), cfg, train, given, classes)


def source_dataset(source: DataSource, cfg: DataConfig, train: bool, given: Dataset | None = None,
                   classes: list[str] | None = None) -> Data:
    """build_dataset's, with data.name's source decided."""
    if given is not None:
        data = from_dataset(given, cfg, train, "train_dataset" if train else "eval_dataset")
    elif source.kind == "import path":
        data = user_dataset(cfg, train, source.function)
    elif source.kind == "given":
        raise UserError(f"data.name={cfg.name}: this run's data was given as a Python object; pass it again "
                        "(accel_train.evaluate(..., eval_dataset=...))")
    elif source.kind == "hf":
        from accel_train.data.hub import hub_dataset

        data = hub_dataset(cfg, train, classes=None if train else classes)
    else:
        data = DATASETS.get(cfg.name)(cfg, train, classes=None if train else classes)
    if train or data.in_memory:  # the registry's in-memory sets: one fixed list of classes, the same in both splits
        return data
    return labelled_by(data, classes, f"data.name={cfg.name}: the evaluation split")


def check_data_name(cfg: DataConfig) -> None:
    """Before any data loads: a registered name, or an import path to a function that takes train= and data.args;
    per-sample augmentation only where samples are transformed one by one."""
    if (cfg.trivial_augment or cfg.random_erasing) and not (cfg.name in ("imagefolder", "shards") or
                                                            source_of(cfg.name) == "hf" or
                                                            (cfg.name in SOURCES and not cfg.on_device)):
        where = "set data.on_device=false to transform samples one by one in DataLoader workers" \
            if cfg.name in SOURCES else "a dataset by import path applies its own transforms"
        raise UserError(f"data.trivial_augment / data.random_erasing apply to file-backed data (imagefolder, shards, "
                        f"or {', '.join(SOURCES)} with data.on_device=false); data.name={cfg.name}: {where}")
    if is_import_path(cfg.name):
        user_function(cfg)  # imported and checked
    elif source_of(cfg.name) == "hf":
        from accel_train.data.hub import check_hub_data

        check_hub_data(cfg)
    elif source_of(cfg.name) is not None:
        raise UserError(f"data.name={cfg.name}: datasets come from the Hub as hf:NAME; {cfg.name.partition(':')[0]}: "
                        "names models only")
    elif not is_given_object(cfg.name):
        DATASETS.get(cfg.name)
