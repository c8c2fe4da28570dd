"""The run configuration: a tree of typed dataclasses, loaded from a YAML recipe plus dotted overrides.

Kept free of torch imports so `accel-train --help` and config errors answer instantly.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from accel_train.errors import UserError
from accel_train.import_paths import add_search_dir, is_given_object
from accel_train.run.layout import CONFIG_FILE

RECIPES_DIR = Path(__file__).parent / "recipes"
# Keys that decide what trained weights mean (model.* too): evaluating, predicting or resuming with another value
# would silently give other numbers, so a value that contradicts the run's is refused.
MEANING_KEYS = ("task", "data.name", "data.num_classes", "data.image_size", "data.normalize", "data.mean",
                "data.std")


def doc(text: str, **kwargs: Any) -> Any:
    """A field with a one-line description (shown in errors and the README's key table)."""
    return field(metadata={"help": text}, **kwargs)


@dataclass
class DataConfig:
    name: str = doc("dataset from the registry: mnist, fashion_mnist, cifar10, stl10, imagefolder; or an import path "
                    "module:function returning a torch Dataset (called with train=True/False and data.args)",
                    default="fashion_mnist")
    args: dict[str, Any] = doc("keyword arguments for a dataset given by import path", default_factory=dict)
    num_classes: int | None = doc("classes of a dataset given by import path (unset: len(dataset.classes))",
                                  default=None)
    root: str = doc("folder holding (or receiving) the dataset files", default="data")
    train_subset: int | None = doc("train on the first N samples only (same N at any world size)", default=None)
    eval_subset: int | None = doc("evaluate on the first N samples only (same N at any world size)", default=None)
    download: bool = doc("let torchvision download the dataset when no local copy exists", default=True)
    synthetic: bool = doc("replace the dataset by torchvision FakeData of the same shape (smoke tests)", default=False)
    augment: bool = doc("random crop + horizontal flip on training images", default=False)
    trivial_augment: bool = doc("file-backed data (imagefolder, data.on_device=false): torchvision's "
                                "TrivialAugmentWide on training images", default=False)
    random_erasing: float = doc("file-backed data: probability of torchvision's RandomErasing on a training image "
                                "(0 = off)", default=0.0)
    val_fraction: float = doc("hold out this fraction of the training set as the validation split, chosen by seed "
                              "(0 = none; ImageFolder's own val/ beside test/ is used as it is)", default=0.0)
    normalize: bool = doc("standardise pixels by the dataset's mean and std (false: raw values in [0, 1], as a VAE "
                          "needs)", default=True)
    mean: list[float] | None = doc("per-channel mean for normalize (unset: the dataset's own, or with "
                                   "model.pretrained the weights' own)", default=None)
    std: list[float] | None = doc("per-channel standard deviation for normalize (unset: as data.mean)", default=None)
    image_size: int | None = doc("resize images to this side length (STL-10, ImageFolder)", default=None)
    num_workers: int | Literal["auto"] = doc("DataLoader worker processes per process (file-backed datasets); auto: "
                                             "the CPU cores this machine has per process, at most 8", default="auto")
    on_device: bool = doc("MNIST family, CIFAR-10, STL-10: keep uint8 tensors on the training device and augment whole "
                          "batches there (false = per-sample torchvision transforms in DataLoader workers)",
                          default=True)


@dataclass
class ModelConfig:
    name: str = doc("mnist_cnn, bn_cnn, or any torchvision classification model name (resnet18, vgg16, ...); "
                    "conv_vae for task=vae; or an import path module:Attr (a class or function returning an "
                    "nn.Module, called with num_classes and image_shape where it takes them, and model.args)",
                    default="mnist_cnn")
    args: dict[str, Any] = doc("keyword arguments for a model given by import path", default_factory=dict)
    pretrained: bool = doc("torchvision models: start from torchvision's default pretrained weights (from TORCH_HOME's "
                           "cache, or downloaded) with a new head for the data's classes and the weights' "
                           "normalisation", default=False)
    freeze_backbone: bool = doc("train only the new classification head of a pretrained model (linear probing)",
                                default=False)
    dropout: bool = doc("keep the architecture's dropout layers (off for exact cross-world-size checks)", default=True)
    sync_batchnorm: bool = doc("synchronise BatchNorm statistics across GPUs", default=False)
    latent_size: int = doc("VAE: dimensions of the latent code z", default=16)
    hidden_size: int = doc("VAE: width of the fully connected layer between the convolutions and z", default=256)
    beta: float = doc("VAE: weight of the KL term in the loss (1 = the negative ELBO; beta-VAE otherwise)", default=1.0)


@dataclass
class TrainConfig:
    epochs: int = doc("passes over the training set", default=1)
    max_steps: int | None = doc("stop after this many optimizer steps (unset = no limit)", default=None)
    batch_size: int = doc("GLOBAL batch size per optimizer step, split across processes and accumulation steps: "
                          "same optimization at any world size", default=64)
    accumulation_steps: int = doc("micro-batches whose gradients add up to one optimizer step (each process takes "
                                  "batch_size / (processes x accumulation_steps) samples per micro-batch)", default=1)
    micro_batch_size: int | Literal["auto"] | None = doc(
        "samples per process per micro-batch; accumulation fills up batch_size (unset: batch_size / (processes x "
        "accumulation_steps); auto: the largest that fits in device memory, found before training and halved "
        "whenever a step runs out of memory)", default=None)
    eval_batch_size: int = doc("global batch size for evaluation (does not change results)", default=1000)
    lr: float = doc("peak learning rate (computed from lr_base when that is set)", default=1e-3)
    lr_base: float | None = doc("peak learning rate for a global batch of lr_base_batch samples: train.lr is computed "
                                "from it and train.batch_size by lr_scale (timm's --lr-base; unset = train.lr as "
                                "given)", default=None)
    lr_base_batch: int = doc("the global batch size lr_base is given for", default=256)
    lr_scale: Literal["linear", "sqrt"] = doc("how lr_base scales with the global batch: linear, lr = lr_base x "
                                              "batch_size / lr_base_batch; sqrt, lr = lr_base x sqrt(batch_size / "
                                              "lr_base_batch)", default="linear")
    optimizer: Literal["adamw", "adam", "sgd"] = doc("optimizer", default="adamw")
    weight_decay: float = doc("decoupled weight decay (adamw) or L2 penalty (adam, sgd)", default=0.01)
    decay_norm_and_bias: bool = doc("apply weight decay to biases and normalisation weights too (false: timm's "
                                    "convention, decay only on weights of 2 or more dimensions)", default=False)
    ema_decay: float | None = doc("keep an exponential moving average of the weights with this decay per optimizer "
                                  "step (e.g. 0.999): evaluated under the plain metric names, the raw model under "
                                  "raw_*, exported as model_ema.safetensors (unset = off)", default=None)
    label_smoothing: float = doc("classification: cross-entropy's label smoothing for training (0 = off; eval "
                                 "loss stays plain cross-entropy)", default=0.0)
    mixup_alpha: float = doc("classification: MixUp with Beta(alpha, alpha) mixing weights (0 = off; e.g. 0.2)",
                             default=0.0)
    cutmix_alpha: float = doc("classification: CutMix with Beta(alpha, alpha) box areas (0 = off; e.g. 1.0)",
                              default=0.0)
    mix_prob: float = doc("probability that a batch is mixed at all (MixUp / CutMix)", default=1.0)
    mix_switch_prob: float = doc("with both MixUp and CutMix on: probability that a mixed batch uses CutMix",
                                 default=0.5)
    momentum: float = doc("SGD momentum", default=0.9)
    schedule: Literal["constant", "step", "exponential", "cosine"] = doc("learning-rate schedule", default="constant")
    lr_gamma: float = doc("LR factor per decay (step: every lr_step_epochs epochs; exponential: per epoch)",
                          default=0.1)
    lr_step_epochs: int = doc("epochs between step decays", default=1)
    warmup_steps: int = doc("linear warmup over this many optimizer steps", default=0)
    clip_grad_norm: float = doc("clip the global gradient norm to this value before each step (0 = off)", default=0.0)
    on_nonfinite: Literal["stop", "skip"] = doc(
        "when the loss or gradient norm is NaN/inf on any process: stop every process (exit 5) or skip that step",
        default="stop")
    eval_every_steps: int | None = doc("also evaluate (on the validation split) every N optimizer steps, not only "
                                       "at each epoch end (unset = epoch ends only)", default=None)
    early_stop_patience: int | None = doc("stop training after this many evaluations in a row without improvement "
                                          "of early_stop_metric; every process stops at the same step and saves a "
                                          "checkpoint (unset = off)", default=None)
    early_stop_metric: str | None = doc("eval metric early stopping watches (unset: checkpoint.best_metric)",
                                        default=None)
    early_stop_mode: Literal["max", "min"] | None = doc("whether higher (max) or lower (min) early_stop_metric is "
                                                        "better (unset: checkpoint.best_mode)", default=None)
    early_stop_min_delta: float = doc("an improvement smaller than this does not count as one", default=0.0)
    log_every_steps: int | None = doc("write a train line to metrics.jsonl every N optimizer steps (unset: every "
                                      "50, or every tenth of a shorter run so that it still gets 10 lines)",
                                      default=None)
    progress_bar: bool = doc("show a tqdm progress bar on the main process (when stderr is a terminal)", default=True)
    progress_every_s: float = doc("without a bar (logs that are not a terminal: CI, SLURM), print one progress line "
                                  "every N seconds (0 = none)", default=30.0)
    plot: bool = doc("draw curves.png into output_dir when the run ends (1.2 to 1.8 s of matplotlib on a 2-core CPU, "
                     "which a sweep of short runs may skip; accel-train plot RUN draws it at any time)", default=True)
    log_with: Literal["auto", "none", "tensorboard", "wandb", "mlflow", "aim"] = doc(
        "experiment tracker fed through Accelerate with the metrics.jsonl scalars and the config (auto: tensorboard "
        "when installed, else none); local files go to output_dir/trackers/", default="auto")
    collective_timeout_s: int = doc("seconds a process waits for the others in a collective before the job fails "
                                    "(bounds the hang when a worker dies)", default=600)
    stuck_after_s: float | None = doc(
        "seconds without a micro-batch of training or evaluation (saves, exports and each start's first step not "
        "timed) after which every process writes its stacks to output_dir/stuck/ and the main process names the "
        "stopped ones in one line, exit 6; below collective_timeout_s (unset: half of it; 0 = off)", default=None)
    compile: bool = doc("torch.compile the model (exported weights are unaffected)", default=False)
    channels_last: bool = doc("channels_last memory format for conv nets (faster convolutions on GPU)", default=False)


@dataclass
class CheckpointConfig:
    every_steps: int | None = doc("save a checkpoint every N optimizer steps (unset = only at epoch ends)",
                                  default=None)
    at_epoch_end: bool = doc("save a checkpoint after each epoch's evaluation (and at the end of the run)",
                             default=True)
    keep_last: int = doc("keep the newest N checkpoints, plus the best one when best_metric is set", default=2)
    best_metric: str | None = doc("validation metric that picks the best checkpoint to keep and model_best.safetensors "
                                  "to export (e.g. accuracy; unset = none)", default=None)
    best_mode: Literal["max", "min"] = doc("whether a higher (max) or lower (min) best_metric is better", default="max")


@dataclass
class PredictConfig:
    top_k: int = doc("labels, each with its score, written per input file by accel-train predict", default=1)
    batch_size: int = doc("inputs per process in each forward pass of predict: the same at any world size, so the "
                          "scores are too", default=32)


@dataclass
class Config:
    description: str = doc("one line shown by `accel-train recipes`", default="")
    task: str = doc("what the model learns: classification, vae, or an import path module:Class (a subclass of "
                    "accel_train.Task)", default="classification")
    seed: int = doc("seed for model init and data order; per-process randomness derives from it", default=0)
    output_dir: str = doc("folder for config.yaml, metrics.jsonl, checkpoints/ and the final model",
                          default="runs/default")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)
    resume: str | None = doc("auto: continue from the newest complete checkpoint in output_dir, if any; "
                                "or the path of a checkpoint folder", default=None)

    # Recorded, not a key: the recipe name or file load_config read (None for a Config built in Python).
    recipe: typing.ClassVar[str | None] = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_POSITIVE = {
    "data.train_subset", "data.eval_subset", "data.image_size", "train.epochs", "train.max_steps",
    "train.batch_size", "train.eval_batch_size", "train.lr", "train.lr_base", "train.lr_base_batch",
    "train.lr_step_epochs", "train.log_every_steps",
    "model.latent_size", "model.hidden_size",
    "train.collective_timeout_s", "checkpoint.every_steps", "checkpoint.keep_last", "data.num_classes",
    "predict.top_k", "predict.batch_size", "train.accumulation_steps", "train.micro_batch_size",
    "train.eval_every_steps", "train.early_stop_patience",
}
_NON_NEGATIVE = {"data.num_workers", "train.progress_every_s", "train.weight_decay", "train.label_smoothing",
                 "train.momentum", "train.warmup_steps", "train.lr_gamma",
                 "train.clip_grad_norm", "model.beta", "train.mixup_alpha", "train.cutmix_alpha",
                 "train.early_stop_min_delta", "train.stuck_after_s"}
_PROBABILITY = {"data.random_erasing", "train.mix_prob", "train.mix_switch_prob"}


def list_recipes() -> dict[str, str]:
    """Shipped recipe names with their one-line descriptions."""
    return {
        path.stem: (yaml.safe_load(path.read_text()) or {}).get("description", "")
        for path in sorted(RECIPES_DIR.glob("*.yaml"))
    }


def load_config(recipe: str | Config, overrides: list[str] = ()) -> Config:
    """Resolve RECIPE (a shipped name, a YAML path, or a Config to copy), apply `key=value` overrides, validate."""
    if isinstance(recipe, Config):
        config = copy.deepcopy(recipe)
    else:
        config = _build(Config, _read_recipe(recipe), prefix="")
        config.recipe = recipe
    given = set()
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key:
            raise UserError(f"override '{override}' is not of the form key=value (e.g. train.lr=0.01)")
        _set(config, key.strip(), raw)
        given.add(key.strip())
    _check_ranges(config)
    _resolve_lr(config.train, lr_given="train.lr" in given)
    return config


def _resolve_lr(train: TrainConfig, lr_given: bool) -> None:
    """train.lr from train.lr_base and the global batch, as timm's --lr-base: a recipe's own train.lr (a run's
    config.yaml records the one computed) gives way, while train.lr given as an override contradicts lr_base."""
    if train.lr_base is None:
        return
    ratio = train.batch_size / train.lr_base_batch
    formula = ("train.lr_base x train.batch_size / train.lr_base_batch" if train.lr_scale == "linear" else
               "train.lr_base x sqrt(train.batch_size / train.lr_base_batch)")
    if lr_given:
        raise UserError(f"train.lr={spelled(train.lr)} and train.lr_base={spelled(train.lr_base)} both given: "
                        f"train.lr_base computes train.lr from the global batch ({formula}); give one of them "
                        "(train.lr_base=null to set train.lr directly)")
    train.lr = train.lr_base * (ratio if train.lr_scale == "linear" else math.sqrt(ratio))


def _read_recipe(recipe: str, seen: tuple[str, ...] = ()) -> dict:
    path = Path(recipe)
    if path.is_dir() and (path / CONFIG_FILE).is_file():  # a run folder: the config it ran with
        path = path / CONFIG_FILE
    elif path.is_dir():
        raise UserError(f"recipe {recipe} is a folder without {CONFIG_FILE}, so not a run; pass a YAML file, a "
                        f"run's output_dir or a shipped recipe name ({', '.join(list_recipes())})")
    if path.suffix in (".yaml", ".yml") and path.is_file():
        add_search_dir(path.parent)  # import paths in it find the modules beside it
    else:
        path = RECIPES_DIR / f"{recipe}.yaml"
        if not path.is_file():
            raise UserError(f"unknown recipe '{recipe}': not a YAML file; shipped recipes are "
                            f"{', '.join(list_recipes())}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"recipe {path} is not valid YAML: {err}".replace("\n", " ")) from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"recipe {path} cannot be read as text ({err})") from None
    if not isinstance(tree, dict):
        raise UserError(f"recipe {path} must be a mapping of config keys")
    tree.pop("run", None)  # what a run's config.yaml records of its launch: facts, not settings
    base = tree.pop("base", None)
    if base is None:
        return tree
    if base in seen:
        raise UserError(f"recipe {path}: 'base: {base}' forms a cycle")
    return _merge(_read_recipe(base, seen + (recipe,)), tree)


def _merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, tree: dict, prefix: str) -> Any:
    if not isinstance(tree, dict):
        raise UserError(f"{prefix.rstrip('.') or 'recipe'}: expected a mapping, got {tree!r}")
    fields, hints = _fields(cls), _hints(cls)
    kwargs = {}
    for key, value in tree.items():
        if key not in fields:
            raise UserError(_unknown_key(prefix + key, cls))
        if dataclasses.is_dataclass(hints[key]):
            kwargs[key] = _build(hints[key], value or {}, prefix + key + ".")
        else:
            kwargs[key] = _coerce(prefix + key, hints[key], value)
    return cls(**kwargs)


def _set(config: Config, dotted: str, raw: str) -> None:
    """Set `section.key=value`; `section.mapping.name=value` sets one entry of a mapping (model.args.depth=3)."""
    parts = dotted.split(".")
    node, prefix = config, ""
    for index, part in enumerate(parts):
        hints, rest = _hints(type(node)), parts[index + 1:]
        if part not in hints:
            raise UserError(_unknown_key(prefix + part, type(node)))
        key, hint = prefix + part, hints[part]
        if dataclasses.is_dataclass(hint):
            if not rest:
                sub = ", ".join(f"{key}.{name}" for name in _fields(hint))
                raise UserError(f"'{key}' is a section, not a value; set one of its keys: {sub}")
            node, prefix = getattr(node, part), key + "."
            continue
        if rest and _is_mapping(hint):
            entries = getattr(node, part)
            for name in rest[:-1]:
                entries = entries.setdefault(name, {})
                if not isinstance(entries, dict):
                    raise UserError(f"{dotted}: {key} has a value, not a mapping, at '{name}'")
            entries[rest[-1]] = _yaml_value(dotted, raw)
            return
        if rest:
            raise UserError(f"unknown config key '{dotted}': '{key}' is a value, not a section")
        setattr(node, part, _coerce(key, hint, raw, from_text=True))
        return


def _unknown_key(key: str, cls: type) -> str:
    prefix = key.rpartition(".")[0]
    valid = ", ".join((f"{prefix}." if prefix else "") + name for name in _fields(cls))
    return f"unknown config key '{key}'; valid keys here: {valid}"


_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def _is_union(hint: Any) -> bool:
    """`Optional[int]` and `int | None` alike."""
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _is_mapping(hint: Any) -> bool:
    return hint is dict or typing.get_origin(hint) is dict


def _yaml_value(key: str, raw: str) -> Any:
    """A command-line value read as YAML: 3 -> int, 0.5 -> float, true -> bool, [1, 2] -> list, text -> str."""
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise UserError(f"{key}: '{raw}' is not a valid value ({str(err).splitlines()[0]})") from None


def _coerce(key: str, hint: Any, value: Any, from_text: bool = False) -> Any:
    """Check `value` against the field's type; text from the command line is parsed first."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if _is_union(hint) and type(None) in args:
        if value is None or (from_text and str(value).lower() in ("null", "none", "")):
            return None
        members = [a for a in args if a is not type(None)]
        if len(members) > 1:  # e.g. int | Literal["auto"]: the first member the value fits
            return _coerce_any(key, members, value, from_text)
        (hint,) = members
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    elif _is_union(hint):
        return _coerce_any(key, list(args), value, from_text)
    if origin is list:
        value = _yaml_value(key, value) if from_text else value
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(item, (int, float)) and not isinstance(item, bool) for item in value):
            raise UserError(f"{key}: expected a list of numbers, e.g. {key}=[0.5,0.5,0.5], got {value!r}")
        return [float(item) for item in value]
    if _is_mapping(hint):
        value = _yaml_value(key, value) if from_text else value
        if not isinstance(value, dict) or not all(isinstance(name, str) for name in value):
            raise UserError(f"{key}: expected a mapping of names to values, e.g. {key}={{depth: 3}}, got {value!r}")
        return dict(value)
    if origin is Literal:
        text = str(value)
        if text not in args:
            raise UserError(f"{key}: '{text}' is not a valid choice; choose one of {', '.join(args)}")
        return text
    try:
        if hint is bool:
            text = str(value).lower()
            if isinstance(value, bool):
                return value
            if text in _TRUE | _FALSE:
                return text in _TRUE
            raise ValueError
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value) if not isinstance(value, str) else int(value.strip())
        if hint is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if hint is str:
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        name = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]
        raise UserError(f"{key}: expected {name}, got {value!r}") from None
    raise TypeError(f"unsupported config type {hint} for {key}")


def _coerce_any(key: str, members: list, value: Any, from_text: bool) -> Any:
    for member in members:
        try:
            return _coerce(key, member, value, from_text)
        except UserError:
            continue
    raise UserError(f"{key}: expected {' or '.join(_type_name(member) for member in members)}, got {value!r}")


def _check_ranges(config: Config) -> None:
    for section in ("data", "model", "train", "checkpoint", "predict"):
        for name, value in dataclasses.asdict(getattr(config, section)).items():
            key = f"{section}.{name}"
            if value is None or isinstance(value, (dict, str, list)):
                continue
            if key in _POSITIVE and value <= 0:
                raise UserError(f"{key}: must be greater than 0, got {value}")
            if key in _NON_NEGATIVE and value < 0:
                raise UserError(f"{key}: must be 0 or more, got {value}")
            if key in _PROBABILITY and not 0 <= value <= 1:
                raise UserError(f"{key}: a probability, must be between 0 and 1, got {value}")
    if not 0 <= config.data.val_fraction < 1:
        raise UserError(f"data.val_fraction: must be at least 0 and below 1 (e.g. 0.1), got {config.data.val_fraction}")
    if config.train.ema_decay is not None and not 0 < config.train.ema_decay < 1:
        raise UserError(f"train.ema_decay: must be between 0 and 1 (e.g. 0.999), got {config.train.ema_decay}")
    if config.train.early_stop_patience and not (config.train.early_stop_metric or config.checkpoint.best_metric):
        raise UserError("train.early_stop_patience: set train.early_stop_metric (or checkpoint.best_metric) to the "
                        "eval metric it watches, e.g. train.early_stop_metric=accuracy")
    stuck, timeout = config.train.stuck_after_s, config.train.collective_timeout_s
    if stuck and stuck >= timeout:
        raise UserError(f"train.stuck_after_s={stuck:g} must be below train.collective_timeout_s={timeout}: the stuck "
                        "report comes before torch's timeout ends the processes; lower the first or raise the second")
    if config.train.label_smoothing >= 1:
        raise UserError(f"train.label_smoothing: must be below 1, got {config.train.label_smoothing}")


def _type_name(hint: Any) -> str:
    """int, float, str, bool; `int|null` for optional keys; `a|b|c` for a fixed set of choices."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        return "|".join(args)
    if _is_union(hint):
        return "|".join(_type_name(a) if a is not type(None) else "null" for a in args)
    if _is_mapping(hint):
        return "mapping"
    if typing.get_origin(hint) is list:
        return "list"
    return hint.__name__


def describe_keys(values: Config | None = None) -> list[tuple[str, str, str, Any]]:
    """(key, type, help, value) for every config key, for the README and `accel-train keys`: the defaults, or the
    values of `values` (a recipe's)."""
    rows = []

    def walk(cls: type, node: Any, prefix: str) -> None:
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], getattr(node, f.name) if node is not None else None, prefix + f.name + ".")
                continue
            if node is not None:
                value = getattr(node, f.name)
            else:
                value = f.default if f.default is not dataclasses.MISSING else \
                    f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            rows.append((prefix + f.name, _type_name(hints[f.name]), f.metadata.get("help", ""), value))

    walk(Config, values, "")
    return rows


def save_config(config: Config, path: Path, run_info: dict) -> None:
    """Write the fully resolved config plus how the run was launched (when, where, the command line, processes,
    precision, versions). A recipe in itself: `run:` is read back as a record, not applied."""
    tree = config.to_dict()
    tree["run"] = {"recipe": config.recipe, **run_info}
    path.write_text(yaml.safe_dump(tree, sort_keys=False))


def spelled(value: Any) -> str:
    """A value as an override takes it: null, true, 0.001, [0.5, 0.5], {depth: 3}, text unquoted."""
    if isinstance(value, str):
        return value if value else '""'
    return yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip().removesuffix("...").strip()


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 0.1}} -> {"train.lr": 0.1}; mappings that are values (model.args) are walked too."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def contradictions(recorded: dict, config: Config) -> list[tuple[str, Any, Any]]:
    """(key, recorded value, value in `config`) for each key that decides what trained weights mean
    (MEANING_KEYS, model.*) on which `config` differs from a run's recorded config. Keys the record lacks (a run
    of an older version) are not compared, nor those an object given in Python stands in for (<module.Class>):
    that object is the caller's to match."""
    def settings(tree: dict) -> dict[str, Any]:  # section.key -> value; a mapping such as model.args stays whole
        return {f"{name}.{key}" if isinstance(section, dict) else name: value
                for name, section in tree.items() if name != "run"
                for key, value in (section.items() if isinstance(section, dict) else [(None, section)])}

    saved, ours = settings(recorded), settings(config.to_dict())
    given = [value for value in ours.values() if isinstance(value, str) and is_given_object(value)]
    return [(key, saved[key], ours.get(key)) for key in saved
            if (key in MEANING_KEYS or key.startswith("model.")) and saved[key] != ours.get(key)
            and ours.get(key) not in given]


def refuse_contradictions(recorded: dict, config: Config, what: str, remedy: str) -> None:
    """One line naming every contradicting key with both values, e.g. for `eval RECIPE checkpoint=RUN`."""
    found = contradictions(recorded, config)
    if found:
        listed = ", ".join(f"{key}={spelled(ours)} (trained with {spelled(saved)})" for key, saved, ours in found)
        raise UserError(f"{what}: {listed}; {remedy}")
