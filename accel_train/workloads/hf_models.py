"""model.name=hf:REPO: a transformers image classifier (AutoModelForImageClassification: any architecture transformers
maps to it) from a Hub repository or a local folder, with a head for the run's classes; its image processor gives the
data's defaults (input size, normalisation, evaluation crop, interpolation).

A Hub name is someone else's upload: the repository's own Python code (auto_map) runs only with
model.trust_remote_code=true, and its weights load from safetensors only, unless model.allow_pickled_weights=true
(transformers then reads a pytorch_model.bin with weights_only). Offline (HF_HUB_OFFLINE=1) it resolves from the
Hugging Face cache; what the cache lacks is one line naming the repository, exit 3.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import pickle
from contextlib import contextmanager
from pathlib import Path

from torch import nn

from accel_train.config import ModelConfig
from accel_train.config.schema import expand_home
from accel_train.errors import DataNotFoundError, UserError, refused_call
from accel_train.versions import check_versions
from accel_train.workloads.heads import replace_head
from accel_train.workloads.inputs import InputDefaults

INSTALL = "pip install 'accel-train[hub]'"


def repository(cfg: ModelConfig) -> str:
    """What follows hf:, a Hub name or a local folder (`~` expanded, as in every path key)."""
    return expand_home(cfg.name.partition(":")[2])


@contextmanager
def loading(cfg: ModelConfig, what: str = "loading it"):
    """transformers quiet (its load report and progress bars), and what it raises while `what` as one line naming
    model.name: a repository that is neither cached nor reachable (exit 3), code it would have to run, weights that
    are only a pickle."""
    check_versions(("hub",))  # an older transformers, timm or huggingface_hub: one line, not a later failure
    try:
        import transformers
    except ImportError:
        raise UserError(f"model.name={cfg.name}: transformers is not installed: {INSTALL}") from None
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    try:
        yield transformers
    except (UserError, KeyboardInterrupt):
        raise
    except (OSError, ValueError, pickle.UnpicklingError) as err:
        raise load_error(cfg, what, err) from None
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()


def load_error(cfg: ModelConfig, what: str, err: Exception) -> UserError:
    """The line for what transformers raised while `what`: pickled weights that torch.load(weights_only=True)
    refused (exit 3; transformers before 4.47 raises OSError from that error), a repository that is neither cached
    nor reachable (exit 3), code it would have to run, another mistake (exit 2)."""
    chain = [err]
    while len(chain) < 8 and (chain[-1].__cause__ or chain[-1].__context__):
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    unpickling = next((cause for cause in chain if isinstance(cause, pickle.UnpicklingError)), None)
    if unpickling is not None:  # model.allow_pickled_weights=true, and the pickle is not tensors alone
        refused, where = refused_call(unpickling), Path(repository(cfg))
        named = where / PICKLED if where.is_dir() else f"the repository's {PICKLED}"
        why = (f"holds a call to {refused}, which torch.load(weights_only=True) refuses; nothing in it was run" if
               refused else f"does not load with torch.load(weights_only=True) ({weights_only_words(unpickling)}): "
               "damaged, or not weights")
        return DataNotFoundError(f"model.name={cfg.name}: {named} {why}; use a repository with safetensors weights, "
                                 "or convert these to safetensors where you trust their source")
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    if isinstance(err, OSError):
        from huggingface_hub.constants import HF_HUB_CACHE

        return DataNotFoundError(f"model.name={cfg.name}: {what} failed ({text[:200]}): a Hub repository must be in "
                                 f"the Hugging Face cache ({HF_HUB_CACHE}; HF_HOME sets it) or downloadable, a local "
                                 "folder must hold what save_pretrained writes (config.json, model.safetensors)")
    if "trust_remote_code" in str(err):
        return UserError(f"model.name={cfg.name}: the repository ships Python code of its own (auto_map), which runs "
                         "only with model.trust_remote_code=true: set it only for a repository you trust")
    return UserError(f"model.name={cfg.name}: {what} failed: {text}")


def _source(cfg: ModelConfig) -> dict:
    return {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}


def check(cfg: ModelConfig) -> None:
    """Before any data loads: the repository's config reads (cached, downloadable, or a local folder with one)."""
    with loading(cfg, "reading its config") as transformers:
        transformers.AutoConfig.from_pretrained(repository(cfg), **_source(cfg))


def input_defaults(cfg: ModelConfig) -> InputDefaults:
    """What the repository's image processor expects of its inputs (nothing where it has none), and the channels
    its config builds the model for."""
    with loading(cfg, "reading its config") as transformers:
        channels = getattr(transformers.AutoConfig.from_pretrained(repository(cfg), **_source(cfg)), "num_channels",
                           None)
    with loading(cfg, "reading its image processor") as transformers:
        try:
            processor = transformers.AutoImageProcessor.from_pretrained(repository(cfg), **_source(cfg))
        except OSError:  # no preprocessor_config.json: the data's own defaults
            return InputDefaults(channels=channels)
    return dataclasses.replace(processor_defaults(processor), channels=channels)


def processor_defaults(processor) -> InputDefaults:
    """An image processor's size, crop, normalisation and interpolation as the data keys say them. A processor that
    resizes to (height, width) without a crop (ViT's) is taken as a crop of all of the resized image (fraction 1)."""
    size = dict(getattr(processor, "size", None) or {})
    crop = dict(getattr(processor, "crop_size", None) or {}) if getattr(processor, "do_center_crop", False) else {}
    side = crop.get("height") or size.get("shortest_edge") or size.get("height")
    fraction = getattr(processor, "crop_pct", None)
    if fraction is None and crop.get("height") and size.get("shortest_edge"):  # resize, then crop: DeiT, BEiT
        fraction = crop["height"] / size["shortest_edge"]
    if fraction is None and size.get("height"):
        fraction = 1.0
    resample = getattr(processor, "resample", None)
    interpolation = {2: "bilinear", 3: "bicubic"}.get(int(resample)) if resample is not None else None
    mean, std = getattr(processor, "image_mean", None), getattr(processor, "image_std", None)
    return InputDefaults(int(side) if side else None, list(mean) if mean is not None else None,
                         list(std) if std is not None else None, fraction, interpolation)


def build(cfg: ModelConfig, num_classes: int, classes: list[str] | None) -> nn.Module:
    """The classifier, with a head for `num_classes` (named by `classes`): the repository's pretrained weights with
    model.pretrained, its head kept only where its classes are the run's; else its architecture, freshly initialised."""
    names = classes or [str(index) for index in range(num_classes)]
    labels = {"num_labels": num_classes, "id2label": dict(enumerate(names)),
              "label2id": {name: index for index, name in enumerate(names)}}
    repo = repository(cfg)
    with loading(cfg) as transformers:
        saved = transformers.AutoConfig.from_pretrained(repo, **_source(cfg))
        if not cfg.pretrained:
            config = transformers.AutoConfig.from_pretrained(repo, **_source(cfg), **labels)
            return transformers.AutoModelForImageClassification.from_config(
                config, trust_remote_code=cfg.trust_remote_code, **cfg.args)
        try:
            model = transformers.AutoModelForImageClassification.from_pretrained(
                repo, **_source(cfg), **labels, ignore_mismatched_sizes=True,
                use_safetensors=None if cfg.allow_pickled_weights else True, **cfg.args)
        except OSError:
            if not cfg.allow_pickled_weights and _has_pickled_weights(transformers, cfg):
                raise UserError(f"model.name={cfg.name}: the repository has no safetensors weights, only a pickled "
                                f"file ({PICKLED}); set model.allow_pickled_weights=true to load it (read with "
                                "weights_only) if you trust its source") from None
            raise
    if saved.num_labels == num_classes and [saved.id2label[index] for index in range(num_classes)] != names:
        replace_head(model, num_classes, num_classes)  # the same count of other classes: a head of its own
    return model


PICKLED = "pytorch_model.bin"


def weights_only_words(err: Exception) -> str:
    """What torch's weights-only unpickler says is wrong, from the paragraphs of advice around it."""
    text = str(err)
    said = text.partition("WeightsUnpickler error:")[2].strip() or text
    return said.splitlines()[0][:200]


def _has_pickled_weights(transformers, cfg: ModelConfig) -> bool:
    """Whether the repository (a folder, cached, or reachable) holds weights as a pickle, without downloading them;
    offline (HF_HUB_OFFLINE=1) the cache answers."""
    try:
        return transformers.utils.has_file(repository(cfg), PICKLED, revision=cfg.revision)
    except OSError:  # a repository or revision that is not there: the load's own error says so
        return False


def export(model: nn.Module, cfg: ModelConfig, data, classes: list[str], folder: Path) -> list[str]:
    """`model` (the run's weights) in save_pretrained's layout, id2label from the run's classes, and an image
    processor that makes the inputs the run's evaluation made (its size, crop, normalisation); the files written."""
    with loading(cfg, "writing it") as transformers:
        model.config.id2label = dict(enumerate(classes))
        model.config.label2id = {name: index for index, name in enumerate(classes)}
        model.save_pretrained(folder, safe_serialization=True)
        processor = run_processor(transformers, cfg, data)
        processor.save_pretrained(folder)
    return sorted(path.name for path in folder.iterdir())


def run_processor(transformers, cfg: ModelConfig, data):
    """The repository's image processor set to the run's data keys; a ViT-style one where it has none."""
    side, fraction = data.image_size or 224, data.crop_fraction or 0.875
    try:
        processor = transformers.AutoImageProcessor.from_pretrained(repository(cfg), **_source(cfg))
    except OSError:
        processor = transformers.ViTImageProcessor()
    if getattr(processor, "crop_pct", None) is not None:  # ConvNeXt's: the short side to side / crop_pct, then crop
        processor.size, processor.crop_pct = {"shortest_edge": side}, fraction
    else:  # as evaluation made them (data/imagefolder.py): the short side resized, then the centre cropped
        processor.size, processor.crop_size, processor.do_center_crop = \
            {"shortest_edge": math.floor(side / fraction)}, {"height": side, "width": side}, True
    if data.normalize and data.mean is not None:
        processor.image_mean, processor.image_std = list(data.mean), list(data.std)
    processor.do_normalize = data.normalize
    processor.resample = {"bilinear": 2, "bicubic": 3}[data.interpolation or "bilinear"]
    return processor
