"""model.name=timm:NAME: timm.create_model(NAME, num_classes=...), with model.args; model.pretrained loads timm's
weights (from the Hugging Face cache or the Hub, e.g. timm/resnet50.a1_in1k, or a local file named by
model.args.pretrained_cfg_overlay.file), safetensors where the repository has them and otherwise with weights_only, as
timm reads them. Its pretrained_cfg gives the data's defaults: input size, normalisation, crop fraction,
interpolation."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

from torch import nn

from accel_train.config import ModelConfig
from accel_train.errors import DataNotFoundError, UserError, did_you_mean
from accel_train.versions import check_versions
from accel_train.workloads.inputs import InputDefaults

INSTALL = "pip install 'accel-train[hub]'"


def model_name(cfg: ModelConfig) -> str:
    return cfg.name.partition(":")[2]


@contextmanager
def loading(cfg: ModelConfig, what: str = "loading it"):
    """timm, and what it raises while `what` as one line naming model.name: weights neither cached nor reachable
    (exit 3), arguments create_model does not take."""
    check_versions(("hub",))  # an older transformers, timm or huggingface_hub: one line, not a later failure
    try:
        import timm
    except ImportError:
        raise UserError(f"model.name={cfg.name}: timm is not installed: {INSTALL}") from None
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    try:
        yield timm
    except (UserError, KeyboardInterrupt):
        raise
    except OSError as err:
        from huggingface_hub.constants import HF_HUB_CACHE

        hub_id = getattr(timm.models.get_pretrained_cfg(model_name(cfg)), "hf_hub_id", None)
        weights = f"its pretrained weights ({hub_id} on the Hub)" if hub_id else "its pretrained weights"
        raise DataNotFoundError(f"model.name={cfg.name}: {weights} are neither in the Hugging Face cache "
                                f"({HF_HUB_CACHE}) nor downloadable ({type(err).__name__}); download them where the "
                                "Hub is reachable (HF_HOME sets the cache), or give a local file: "
                                "model.args.pretrained_cfg_overlay.file=PATH") from None
    except (TypeError, ValueError, RuntimeError) as err:
        raise UserError(f"model.name={cfg.name}: {what} failed: {type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}") from None


def check(cfg: ModelConfig) -> None:
    """Before any data loads: a model timm knows (its architecture, with or without a pretrained tag)."""
    with loading(cfg, "finding it") as timm:
        name = model_name(cfg)
        if not timm.is_model(name.split(".")[0]):
            known = timm.list_models()
            raise UserError(f"model.name={cfg.name}: timm has no model {name.split('.')[0]}"
                            f"{did_you_mean(name.split('.')[0], known)}; timm.list_models() lists its "
                            f"{len(known):,} models")


def pretrained_cfg(cfg: ModelConfig) -> dict:
    """The model's pretrained_cfg (its default tag's, or NAME.TAG's), with model.args.pretrained_cfg_overlay."""
    with loading(cfg, "reading its pretrained_cfg") as timm:
        found = timm.models.get_pretrained_cfg(model_name(cfg))
        values = found.to_dict() if found is not None else {}
    return {**values, **(cfg.args.get("pretrained_cfg_overlay") or {})}


def input_defaults(cfg: ModelConfig) -> InputDefaults:
    values = pretrained_cfg(cfg)
    size = values.get("test_input_size") or values.get("input_size")
    interpolation = values.get("interpolation")
    channels = cfg.args.get("in_chans") or (int(values["input_size"][0]) if values.get("input_size") else None)
    return InputDefaults(int(size[-1]) if size else None, list(values["mean"]) if values.get("mean") else None,
                         list(values["std"]) if values.get("std") else None, values.get("crop_pct"),
                         interpolation if interpolation in ("bilinear", "bicubic") else None, channels)


def build(cfg: ModelConfig, num_classes: int, classes: list[str] | None) -> nn.Module:
    """timm.create_model with the run's classes; model.revision pins the weights' Hub commit."""
    args = dict(cfg.args)
    if cfg.revision and cfg.pretrained:
        overlay = dict(args.get("pretrained_cfg_overlay") or {})
        hub_id = overlay.get("hf_hub_id") or pretrained_cfg(cfg).get("hf_hub_id")
        if hub_id:
            overlay["hf_hub_id"] = f"{hub_id.split('@')[0]}@{cfg.revision}"  # timm's hf_split reads the revision
            args["pretrained_cfg_overlay"] = overlay
    with loading(cfg) as timm:
        return timm.create_model(model_name(cfg), pretrained=cfg.pretrained, num_classes=num_classes, **args)


def export(model: nn.Module, cfg: ModelConfig, data, classes: list[str], folder: Path) -> list[str]:
    """`model` in timm's own layout (config.json with its pretrained_cfg, the run's label names and input settings;
    model.safetensors): timm.create_model("local-dir:FOLDER", pretrained=True) loads it."""
    side = data.image_size or 224
    data_config = {"input_size": (3, side, side), "crop_pct": data.crop_fraction or 0.875,
                   "interpolation": data.interpolation or "bilinear"}
    if data.mean is not None and data.normalize:
        data_config.update(mean=tuple(data.mean), std=tuple(data.std))
    with loading(cfg, "writing it") as timm:
        timm.models.save_for_hf(model, str(folder), model_config={"label_names": list(classes)},
                                safe_serialization=True, data_config=data_config)
    return sorted(path.name for path in folder.iterdir())
