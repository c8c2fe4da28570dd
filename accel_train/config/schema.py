"""The run configuration's schema: a tree of typed dataclasses, each key with its one-line meaning, default and
the range its values must keep, declared on the field itself; and what the keys mean together (cross-key rules).

Kept free of torch imports so `accel-train --help` and config errors answer instantly.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from accel_train.errors import UserError
from accel_train.import_paths import is_import_path, source_of


@dataclass(frozen=True)
class Range:
    """The values a numeric key may take; a value outside is refused when the config is loaded, naming the key."""

    holds: Callable[[float], bool]
    text: str  # what the value must be, e.g. "must be greater than 0"

    def check(self, key: str, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not self.holds(value):
            raise UserError(f"{key}: {self.text}, got {value}")


POSITIVE = Range(lambda value: value > 0, "must be greater than 0")
NON_NEGATIVE = Range(lambda value: value >= 0, "must be 0 or more")
PROBABILITY = Range(lambda value: 0 <= value <= 1, "a probability, must be between 0 and 1")
FRACTION = Range(lambda value: 0 <= value < 1, "must be at least 0 and below 1 (e.g. 0.1)")
OPEN_UNIT = Range(lambda value: 0 < value < 1, "must be between 0 and 1 (e.g. 0.999)")
BELOW_ONE = Range(lambda value: value < 1, "must be below 1")


# PIL's Image.MAX_IMAGE_PIXELS (1024 ** 3 // 4 // 3: a quarter of a GiB of 3-byte pixels), written out so that the
# schema stays free of image libraries; a test holds it to PIL's own
MAX_IMAGE_PIXELS = 89_478_485


def doc(text: str, within: Range | tuple[Range, ...] = (), path: bool = False, **kwargs: Any) -> Any:
    """A field with a one-line description (shown in errors and `accel-train keys`), the ranges its values keep, and
    whether it is a path (`~` expanded: expand_paths)."""
    return field(metadata={"help": text, "within": within if isinstance(within, tuple) else (within,), "path": path},
                 **kwargs)


@dataclass
class DataConfig:
    name: str = doc("dataset from the registry: mnist, fashion_mnist, cifar10, stl10, imagefolder, shards (written by "
                    "accel-train shard, at data.root: a folder or a URL such as s3://bucket/data); hf:REPO, a Hugging "
                    "Face dataset (a Hub name, a local folder of parquet, arrow or images, or a save_to_disk folder); "
                    "or an import path module:function returning a torch Dataset (called with train=True/False and "
                    "data.args)", default="fashion_mnist")
    args: dict[str, Any] = doc("keyword arguments for a dataset given by import path (data.name=hf:...: for "
                               "datasets' load_dataset, e.g. data.args.name=CONFIG)", default_factory=dict)
    image_column: str | None = doc("data.name=hf:...: the column of images (unset: the one column of the Image "
                                   "feature type)", default=None)
    label_column: str | None = doc("data.name=hf:...: the column of labels (unset: the one column of the ClassLabel "
                                   "feature type; its names are the classes)", default=None)
    train_split: str = doc("data.name=hf:...: the split to train on", default="train")
    eval_split: str | None = doc("data.name=hf:...: the split to evaluate on (unset: validation, else test; none: "
                                 "hold out data.val_fraction of the training split)", default=None)
    revision: str | None = doc("data.name=hf:...: the Hub dataset's commit, branch or tag (unset: main)",
                               default=None)
    image_transform: str | None = doc("a dataset given by import path: how `accel-train predict` turns one image file "
                                      "(a PIL image) into the model's input, as an import path module:function "
                                      "(unset: the `transform` of the dataset's evaluation split, train=False)",
                                      default=None)
    num_classes: int | None = doc("classes of a dataset given by import path (unset: len(dataset.classes))",
                                  default=None, within=POSITIVE)
    root: str = doc("folder holding (or receiving) the dataset files; for data.name=shards a folder or any fsspec URL "
                    "(s3://, gs://, az://; credentials from the storage's own environment)", default="data", path=True)
    train_subset: int | None = doc("train on the first N samples only (same N at any world size)",
                                   default=None, within=POSITIVE)
    eval_subset: int | None = doc("evaluate on the first N samples only (same N at any world size)",
                                  default=None, within=POSITIVE)
    download: bool = doc("let torchvision download the dataset when no local copy exists", default=True)
    synthetic: bool = doc("replace the dataset by torchvision FakeData of the same shape (smoke tests)", default=False)
    augment: bool = doc("random crop + horizontal flip on training images", default=False)
    trivial_augment: bool = doc("file-backed data (imagefolder, shards, data.on_device=false): torchvision's "
                                "TrivialAugmentWide on training images", default=False)
    random_erasing: float = doc("file-backed data: probability of torchvision's RandomErasing on a training image "
                                "(0 = off)", default=0.0, within=PROBABILITY)
    val_fraction: float = doc("hold out this fraction of the training set as the validation split, chosen by seed "
                              "(0 = none; ImageFolder's own val/ beside test/ is used as it is)",
                              default=0.0, within=FRACTION)
    normalize: bool = doc("standardise pixels by the dataset's mean and std (false: raw values in [0, 1], as a VAE "
                          "needs)", default=True)
    mean: list[float] | None = doc("per-channel mean for normalize (unset: the dataset's own, or with "
                                   "model.pretrained the weights' own)", default=None)
    std: list[float] | None = doc("per-channel standard deviation for normalize (unset: as data.mean)", default=None)
    channels: int | None = doc("image channels the model is given: images of another count are converted where they "
                               "are normalised, 1 channel repeated, 3 into 1 by their luma (unset: the model's, 3 for "
                               "a torchvision model, a timm model's in_chans, an hf: model's num_channels; else the "
                               "data's own); the run records the value taken", default=None, within=POSITIVE)
    image_size: int | None = doc("resize images to this side length (STL-10, ImageFolder, hf:; unset: the data's own, "
                                 "the model's image processor's or pretrained_cfg's for hf: and timm: models, else "
                                 "224)", default=None, within=POSITIVE)
    crop_fraction: float | None = doc("ImageFolder-like data (imagefolder, hf:, their shards): evaluation resizes the "
                                      "short side to image_size / crop_fraction, then crops the centre (1: no crop; "
                                      "unset: 0.875, as torchvision's 224 of 256, or the hf:/timm: model's)",
                                      default=None, within=(POSITIVE, Range(lambda value: value <= 1,
                                                                            "must be 1 or less")))
    interpolation: Literal["bilinear", "bicubic"] | None = doc(
        "ImageFolder-like data: how crops and evaluation resize images (unset: bilinear, or the hf:/timm: model's)",
        default=None)
    decode: Literal["scaled", "full"] = doc(
        "data.name=imagefolder, JPEG files: scaled decodes each at the smallest of libjpeg-turbo's 1/2, 1/4 and 1/8 "
        "DCT scales that keeps the training crop (evaluation's resize) at least the output size, within a stated "
        "tolerance of full (simplejpeg; docs/contracts.md); full: every file at full size", default="scaled")
    num_workers: int | Literal["auto"] = doc("DataLoader worker processes per process (file-backed datasets); auto: "
                                             "training measures a micro-batch loaded in the main process against a "
                                             "training step and takes the fewest that keep the step fed (none where "
                                             "loading costs under 5% of a step), at most the CPU cores per process "
                                             "and 8 (eval, predict: that cap)", default="auto", within=NON_NEGATIVE)
    shuffle_window_shards: int = doc("data.name=shards: samples are shuffled within windows of this many shards "
                                     "(each epoch permutes the shards); larger mixes more, and caches and reads "
                                     "more at a time", default=8, within=POSITIVE)
    streams: int = doc("data.name=shards: each global batch takes equal parts from this many streams, each a "
                       "contiguous run of the epoch's shards; a multiple of the machines lets each machine read "
                       "only its own shards (must divide train.batch_size)", default=1, within=POSITIVE)
    cache_dir: str | None = doc("data.name=shards: this machine's cache of shard blocks, shared by its processes "
                                "(unset: ~/.cache/accel-train/shards, or under XDG_CACHE_HOME)", default=None,
                                path=True)
    cache_gb: float = doc("data.name=shards: the most the cache keeps, in GB; the least recently used blocks go first",
                          default=50.0, within=POSITIVE)
    max_image_pixels: int = doc("image files (imagefolder, hf:, shards, accel-train shard, predict, bench --input): "
                                "the most pixels (width x height) an image's header may declare; a larger one is "
                                "refused in one line before it is decoded (a decompression bomb) (default: PIL's "
                                "Image.MAX_IMAGE_PIXELS)", default=MAX_IMAGE_PIXELS, within=POSITIVE)
    store_patience_s: float = doc("data.name=shards: how long reads retry a store that does not answer (or answers "
                                  "wrong bytes) before the run stops with exit 3", default=60.0, within=POSITIVE)
    on_device: bool = doc("MNIST family, CIFAR-10, STL-10: keep uint8 tensors on the training device and augment whole "
                          "batches there (false = per-sample torchvision transforms in DataLoader workers)",
                          default=True)


@dataclass
class ModelConfig:
    name: str = doc("mnist_cnn, bn_cnn, or any torchvision classification model name (resnet18, vgg16, ...); "
                    "conv_vae for task=vae; hf:REPO, a transformers image classifier (a Hub name or a local folder); "
                    "timm:NAME, a timm model; or an import path module:Attr (a class or function returning an "
                    "nn.Module, called with num_classes and image_shape where it takes them, and model.args)",
                    default="mnist_cnn")
    args: dict[str, Any] = doc("keyword arguments for a model given by import path, or for timm's create_model "
                               "(timm:) and transformers' from_pretrained / from_config (hf:)", default_factory=dict)
    pretrained: bool = doc("torchvision, hf: and timm: models: start from the pretrained weights (from the cache, "
                           "or downloaded) with a new head for the data's classes, and their input size and "
                           "normalisation", default=False)
    revision: str | None = doc("hf: and timm: models: the Hub repository's commit, branch or tag (unset: main)",
                               default=None)
    trust_remote_code: bool = doc("hf: models: run the Python code a Hub repository ships (auto_map): only for a "
                                  "repository you trust", default=False)
    allow_pickled_weights: bool = doc("hf: models: load weights from a pickled file (pytorch_model.bin) where the "
                                      "repository has no safetensors (read with weights_only, but only from a source "
                                      "you trust)", default=False)
    init_from: str | None = doc("start from the weights of an earlier run: its output_dir (model.safetensors), one of "
                                "its checkpoint folders or a .safetensors file; a new run, the optimizer and "
                                "schedule fresh (unset: the model's own initialisation)", default=None, path=True)
    freeze_backbone: bool = doc("train only the new classification head of a pretrained model (linear probing)",
                                default=False)
    dropout: bool = doc("keep the architecture's dropout layers (off for exact cross-world-size checks)", default=True)
    sync_batchnorm: bool = doc("synchronise BatchNorm statistics across GPUs", default=False)
    latent_size: int = doc("VAE: dimensions of the latent code z", default=16, within=POSITIVE)
    hidden_size: int = doc("VAE: width of the fully connected layer between the convolutions and z",
                           default=256, within=POSITIVE)
    beta: float = doc("VAE: weight of the KL term in the loss (1 = the negative ELBO; beta-VAE otherwise)",
                      default=1.0, within=NON_NEGATIVE)


@dataclass
class TrainConfig:
    epochs: int = doc("passes over the training set", default=1, within=POSITIVE)
    max_steps: int | None = doc("stop after this many optimizer steps (unset = no limit)",
                                default=None, within=POSITIVE)
    batch_size: int = doc("GLOBAL batch size per optimizer step, split across processes and accumulation steps: "
                          "same optimization at any world size", default=64, within=POSITIVE)
    accumulation_steps: int = doc("micro-batches whose gradients add up to one optimizer step (each process takes "
                                  "batch_size / (processes x accumulation_steps) samples per micro-batch)",
                                  default=1, within=POSITIVE)
    micro_batch_size: int | Literal["auto"] | None = doc(
        "samples per process per micro-batch; accumulation fills up batch_size (unset: batch_size / (processes x "
        "accumulation_steps); auto: the largest that fits in device memory, found before training and halved "
        "whenever a step runs out of memory)", default=None, within=POSITIVE)
    eval_batch_size: int = doc("global batch size for evaluation (does not change results)",
                               default=1000, within=POSITIVE)
    lr: float = doc("peak learning rate (computed from lr_base when that is set)", default=1e-3, within=POSITIVE)
    lr_base: float | None = doc("peak learning rate for a global batch of lr_base_batch samples: train.lr is computed "
                                "from it and train.batch_size by lr_scale (timm's --lr-base; unset = train.lr as "
                                "given)", default=None, within=POSITIVE)
    lr_base_batch: int = doc("the global batch size lr_base is given for", default=256, within=POSITIVE)
    lr_scale: Literal["linear", "sqrt"] = doc("how lr_base scales with the global batch: linear, lr = lr_base x "
                                              "batch_size / lr_base_batch; sqrt, lr = lr_base x sqrt(batch_size / "
                                              "lr_base_batch)", default="linear")
    keyed_dropout: bool = doc("a training sample's dropout masks a function of (seed, step, its index, the layer), "
                              "the same at any world size, micro-batch and resume (false: torch's masks, drawn per "
                              "process)", default=True)
    optimizer: Literal["adamw", "adam", "sgd"] = doc("optimizer", default="adamw")
    weight_decay: float = doc("decoupled weight decay (adamw) or L2 penalty (adam, sgd)",
                              default=0.01, within=NON_NEGATIVE)
    decay_norm_and_bias: bool = doc("apply weight decay to biases and normalisation weights too (false: timm's "
                                    "convention, decay only on weights of 2 or more dimensions)", default=False)
    ema_decay: float | None = doc("keep an exponential moving average of the weights with this decay per optimizer "
                                  "step (e.g. 0.999): evaluated under the plain metric names, the raw model under "
                                  "raw_*, exported as model_ema.safetensors (unset = off)",
                                  default=None, within=OPEN_UNIT)
    label_smoothing: float = doc("classification: cross-entropy's label smoothing for training (0 = off; eval "
                                 "loss stays plain cross-entropy)", default=0.0, within=(NON_NEGATIVE, BELOW_ONE))
    mixup_alpha: float = doc("classification: MixUp with Beta(alpha, alpha) mixing weights (0 = off; e.g. 0.2)",
                             default=0.0, within=NON_NEGATIVE)
    cutmix_alpha: float = doc("classification: CutMix with Beta(alpha, alpha) box areas (0 = off; e.g. 1.0)",
                              default=0.0, within=NON_NEGATIVE)
    mix_prob: float = doc("probability that a batch is mixed at all (MixUp / CutMix)", default=1.0, within=PROBABILITY)
    mix_switch_prob: float = doc("with both MixUp and CutMix on: probability that a mixed batch uses CutMix",
                                 default=0.5, within=PROBABILITY)
    momentum: float = doc("SGD momentum", default=0.9, within=NON_NEGATIVE)
    schedule: Literal["constant", "step", "exponential", "cosine"] = doc("learning-rate schedule", default="constant")
    lr_gamma: float = doc("LR factor per decay (step: every lr_step_epochs epochs; exponential: per epoch)",
                          default=0.1, within=NON_NEGATIVE)
    lr_step_epochs: int = doc("epochs between step decays", default=1, within=POSITIVE)
    warmup_steps: int = doc("linear warmup over this many optimizer steps", default=0, within=NON_NEGATIVE)
    clip_grad_norm: float = doc("clip the global gradient norm to this value before each step (0 = off)",
                                default=0.0, within=NON_NEGATIVE)
    on_nonfinite: Literal["stop", "skip"] = doc(
        "when the loss or gradient norm is NaN/inf on any process: stop every process (exit 5) or skip that step",
        default="stop")
    fp16_max_consecutive_overflows: int = doc(
        "fp16: this many steps in a row whose gradients overflow (each skipped, the loss scale halved) stop every "
        "process (exit 5): the gradients are not finite at any scale (0 = no limit)", default=20, within=NON_NEGATIVE)
    fp16_min_loss_scale: float = doc("fp16: a loss scale that falls below this stops every process (exit 5), as "
                                     "DeepSpeed's min_loss_scale (0 = no floor)", default=1.0, within=NON_NEGATIVE)
    eval_every_steps: int | None = doc("also evaluate (on the validation split) every N optimizer steps, not only "
                                       "at each epoch end (unset = epoch ends only)", default=None, within=POSITIVE)
    early_stop_patience: int | None = doc("stop training after this many evaluations in a row without improvement "
                                          "of early_stop_metric; every process stops at the same step and saves a "
                                          "checkpoint (unset = off)", default=None, within=POSITIVE)
    early_stop_metric: str | None = doc("eval metric early stopping watches (unset: checkpoint.best_metric)",
                                        default=None)
    early_stop_mode: Literal["max", "min"] | None = doc("whether higher (max) or lower (min) early_stop_metric is "
                                                        "better (unset: checkpoint.best_mode)", default=None)
    early_stop_min_delta: float = doc("an improvement smaller than this does not count as one",
                                      default=0.0, within=NON_NEGATIVE)
    log_every_steps: int | None = doc("write a train line to metrics.jsonl every N optimizer steps (unset: every "
                                      "50, or every tenth of a shorter run so that it still gets 10 lines)",
                                      default=None, within=POSITIVE)
    progress_bar: bool = doc("show a tqdm progress bar on the main process (when stderr is a terminal)", default=True)
    progress_every_s: float = doc("without a bar (logs that are not a terminal: CI, SLURM), print one progress line "
                                  "every N seconds (0 = none)", default=30.0, within=NON_NEGATIVE)
    plot: bool = doc("draw curves.png into output_dir when the run ends (1.2 to 1.8 s of matplotlib on a 2-core CPU, "
                     "which a sweep of short runs may skip; accel-train plot RUN draws it at any time)", default=True)
    log_with: Literal["auto", "none", "tensorboard", "wandb", "mlflow", "aim"] = doc(
        "experiment tracker fed through Accelerate with the metrics.jsonl scalars and the config (auto: tensorboard "
        "when installed, else none); local files go to output_dir/trackers/", default="auto")
    collective_timeout_s: int = doc("seconds a process waits for the others in a collective before the job fails "
                                    "(bounds the hang when a worker dies)", default=600, within=POSITIVE)
    stuck_after_s: float | None = doc(
        "seconds without a micro-batch of training or evaluation (saves, exports and each start's first step not "
        "timed) after which every process writes its stacks to output_dir/stuck/ and the main process names the "
        "stopped ones in one line, exit 6; below collective_timeout_s (unset: half of it; 0 = off)",
                                      default=None, within=NON_NEGATIVE)
    compile: bool = doc("torch.compile the model (exported weights are unaffected)", default=False)
    channels_last: bool = doc("channels_last memory format for conv nets (faster convolutions on GPU)", default=False)
    deterministic: bool = doc("GPUs: the same numbers on every run of the same config and world size (cuDNN's "
                              "benchmark off, torch's deterministic algorithms, TF32 off; slower): docs/contracts.md",
                              default=False)
    tf32: bool | Literal["auto"] = doc("GPUs from Ampere on: fp32 matrix products and convolutions on TF32 tensor "
                                       "cores (about 10 significant bits; much faster); auto: on unless "
                                       "train.deterministic", default="auto")


@dataclass
class CheckpointConfig:
    every_steps: int | None = doc("save a checkpoint every N optimizer steps (unset = only at epoch ends)",
                                  default=None, within=POSITIVE)
    at_epoch_end: bool = doc("save a checkpoint after each epoch's evaluation (and at the end of the run)",
                             default=True)
    keep_last: int = doc("keep the newest N checkpoints, plus the best one when best_metric is set",
                         default=2, within=POSITIVE)
    best_metric: str | None = doc("validation metric that picks the best checkpoint to keep and model_best.safetensors "
                                  "to export (e.g. accuracy; unset = none)", default=None)
    best_mode: Literal["max", "min"] = doc("whether a higher (max) or lower (min) best_metric is better", default="max")
    upload_wait_s: float = doc("how long the end of a run (or a stop) waits for a checkpoint still being written or "
                               "uploaded in the background, and a save for its processes' parts", default=600.0,
                               within=POSITIVE)
    require_upload: bool = doc("output_dir at a URL: a checkpoint that cannot reach the store stops the run (exit 3) "
                               "instead of a warning and the next save trying again", default=False)
    store_patience_s: float | None = doc("output_dir at a URL: how long each read and write of the run folder retries "
                                         "a store that does not answer before it gives up (a save then warns, or "
                                         "stops the run with require_upload); unset: data.store_patience_s",
                                         default=None, within=POSITIVE)


@dataclass
class PredictConfig:
    top_k: int = doc("labels, each with its score, written per input file by accel-train predict",
                     default=1, within=POSITIVE)
    batch_size: int = doc("inputs per process in each forward pass of predict: the same at any world size, so the "
                          "scores are too", default=32, within=POSITIVE)


@dataclass
class Config:
    description: str = doc("one line shown by `accel-train recipes`", default="")
    task: str = doc("what the model learns: classification, vae, or an import path module:Class (a subclass of "
                    "accel_train.Task)", default="classification")
    seed: int = doc("seed for model init and data order; per-process randomness derives from it", default=0)
    output_dir: str = doc("folder for config.yaml, metrics.jsonl, checkpoints/ and the final model: a local path, "
                          "or a URL in object storage (s3://bucket/runs/a, gs://, az://; credentials from the "
                          "storage's own environment)", default="runs/default", path=True)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)
    resume: str | None = doc("auto: continue from the newest complete checkpoint in output_dir, if any; "
                                "or the path (or URL) of one of its checkpoint folders", default=None, path=True)

    # Recorded, not a key: the recipe name or file load_config read (None for a Config built in Python).
    recipe: typing.ClassVar[str | None] = None
    # Recorded by load_config, not keys: import paths read from a file this command does not trust (config/trust.py),
    # and the trust keys a file set, which were set back to false.
    untrusted_code: typing.ClassVar[tuple] = ()
    ignored_trust: typing.ClassVar[tuple] = ()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = ("data", "model", "train", "checkpoint", "predict")
# The data keys an epoch's order over shards depends on: refused with other datasets, and on a resume that changes them
SHARD_ORDER_KEYS = ("streams", "shuffle_window_shards")
HUB_DATA_KEYS = ("image_column", "label_column", "train_split", "eval_split", "revision")  # data.name=hf:... alone
HUB_MODEL_KEYS = ("revision", "trust_remote_code", "allow_pickled_weights")  # hf: (revision: timm: too)


def spelled_mapping(mapping: dict) -> str:
    """{width: 64} as a line shows a mapping."""
    return "{" + ", ".join(f"{name}: {value}" for name, value in mapping.items()) + "}"


def check_values(config: Config, given: set[str] | frozenset[str] = frozenset()) -> None:
    """Every key within its ranges, then the rules that tie keys together; the first broken one, in one line.
    `given`: the keys overrides set on the recipe."""
    if config.output_dir.startswith("file://"):  # as a path it would be a local folder named "file:"
        raise UserError(f"output_dir={config.output_dir}: give a local folder as a path, without file:// "
                        f"(output_dir={config.output_dir[len('file://'):]})")
    for section in SECTIONS:
        node = getattr(config, section)
        for spec in dataclasses.fields(node):
            for bound in spec.metadata.get("within", ()):
                bound.check(f"{section}.{spec.name}", getattr(node, spec.name))
    for key, section, kind in (("model", config.model, "model"), ("data", config.data, "dataset")):
        if section.args and not (is_import_path(section.name) or source_of(section.name)):
            raise UserError(f"{key}.args={spelled_mapping(section.args)}: keyword arguments go to a {kind} given by "
                            f"import path (module:Attr) or from the Hub (hf:, timm:); {key}.name={section.name} takes "
                            "none, so they would be ignored: remove them")
    for key, section, sources, names in (("data", config.data, ("hf",), HUB_DATA_KEYS),
                                         ("model", config.model, ("hf", "timm"), HUB_MODEL_KEYS)):
        set_here = [f"{key}.{name}" for name in names
                    if getattr(section, name) != fields_of(type(section))[name].default]
        if set_here and source_of(section.name) not in sources:
            them, kinds = ("them", "they apply") if len(set_here) > 1 else ("it", "it applies")
            raise UserError(f"{' and '.join(set_here)}: {kinds} to {' and '.join(f'{source}:' for source in sources)} "
                            f"{'datasets' if key == 'data' else 'models'} only; {key}.name={section.name} is not one, "
                            f"so {them.replace('them', 'they')} would be ignored: remove {them}")
    if config.data.image_transform and not is_import_path(config.data.name):
        raise UserError(f"data.image_transform={config.data.image_transform}: it serves a dataset given by import path "
                        f"(module:Attr); data.name={config.data.name} turns image files into inputs itself: remove it")
    # A run trained from shards, evaluated on their source (eval RUN data.name=imagefolder ...), keeps its recorded
    # order keys: only an override, or a recipe that sets them beside another dataset, sets them in vain.
    ordering = [f"data.{key}" for key in SHARD_ORDER_KEYS
                if getattr(config.data, key) != fields_of(DataConfig)[key].default
                and (f"data.{key}" in given or "data.name" not in given)]
    if ordering and config.data.name != "shards":
        raise UserError(f"{' and '.join(ordering)} order data.name=shards; data.name={config.data.name} is ordered by "
                        "Accelerate's seedable sampler, so they would be ignored: remove them")
    caching = [f"data.{key}" for key in ("cache_dir", "cache_gb")
               if getattr(config.data, key) != fields_of(DataConfig)[key].default
               and (f"data.{key}" in given or "data.name" not in given)]
    if caching and config.data.name != "shards":
        raise UserError(f"{' and '.join(caching)}: the block cache of data.name=shards; data.name={config.data.name} "
                        "reads no shards, so they would be ignored: remove them")
    if config.train.early_stop_patience and not (config.train.early_stop_metric or config.checkpoint.best_metric):
        raise UserError("train.early_stop_patience: set train.early_stop_metric (or checkpoint.best_metric) to the "
                        "eval metric it watches, e.g. train.early_stop_metric=accuracy")
    if config.model.sync_batchnorm and config.train.micro_batch_size == "auto":
        # SyncBatchNorm's collectives run inside the forward pass: a process out of memory there would leave the
        # others waiting until the collective timeout, where auto agrees before any collective of the step.
        raise UserError("model.sync_batchnorm=true with train.micro_batch_size=auto: SyncBatchNorm gathers statistics "
                        "inside the forward pass, before the processes can agree that none ran out of memory; set a "
                        "train.micro_batch_size, or turn model.sync_batchnorm off")
    if config.train.deterministic and config.train.tf32 is True:
        raise UserError("train.deterministic=true with train.tf32=true: determinism here means full fp32 "
                        "arithmetic as well; leave train.tf32 unset (auto), or turn train.deterministic off")
    stuck, timeout = config.train.stuck_after_s, config.train.collective_timeout_s
    if stuck and stuck >= timeout:
        raise UserError(f"train.stuck_after_s={stuck:g} must be below train.collective_timeout_s={timeout}: the stuck "
                        "report comes before torch's timeout ends the processes; lower the first or raise the second")


def expand_home(path: str | None) -> str | None:
    """`~` (or `~user`) at the start of a local path made that home folder, as a shell does; anything else (a URL,
    None) as it is. Wherever a path comes from a recipe, an override or a NAME=VALUE argument: a shell expands `~`
    after `NAME=` at most where NAME could be a variable of its own (bash: `output_dir=~/x`, never `data.root=~/x`;
    sh, zsh and a quoted word: neither), so most reach us as they were typed."""
    return os.path.expanduser(path) if path is not None else None


def expand_paths(config: Config) -> None:
    """expand_home of every key that is a path (doc(..., path=True)): a recipe's `output_dir: ~/runs/x` or an override
    `data.root=~/data` would otherwise make a folder named `~`."""
    for node in (config, *(getattr(config, section) for section in SECTIONS)):
        for spec in dataclasses.fields(node):
            if spec.metadata.get("path"):
                setattr(node, spec.name, expand_home(getattr(node, spec.name)))


def fields_of(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


@functools.cache  # get_type_hints evaluates every annotation again: a third of load_config's time uncached
def hints_of(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def is_union(hint: Any) -> bool:
    """`Optional[int]` and `int | None` alike."""
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def is_mapping(hint: Any) -> bool:
    return hint is dict or typing.get_origin(hint) is dict


def type_name(hint: Any) -> str:
    """int, float, str, bool; `int|null` for optional keys; `a|b|c` for a fixed set of choices."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        return "|".join(args)
    if is_union(hint):
        return "|".join(type_name(a) if a is not type(None) else "null" for a in args)
    if is_mapping(hint):
        return "mapping"
    if typing.get_origin(hint) is list:
        return "list"
    return hint.__name__


def describe_keys(values: Config | None = None) -> list[tuple[str, str, str, Any]]:
    """(key, type, help, value) for every config key, for the README and `accel-train keys`: the defaults, or the
    values of `values` (a recipe's)."""
    rows = []

    def walk(cls: type, node: Any, prefix: str) -> None:
        hints = hints_of(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], getattr(node, f.name) if node is not None else None, prefix + f.name + ".")
                continue
            if node is not None:
                value = getattr(node, f.name)
            else:
                value = f.default if f.default is not dataclasses.MISSING else \
                    f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            rows.append((prefix + f.name, type_name(hints[f.name]), f.metadata.get("help", ""), value))

    walk(Config, values, "")
    return rows
