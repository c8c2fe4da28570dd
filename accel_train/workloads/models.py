"""Models by name (our own small nets, any torchvision classification model, a library's by name: hf_models.py,
timm_models.py; a user's by import path) and device speed switches."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch import nn

from accel_train.config import ModelConfig
from accel_train.errors import DataNotFoundError, UnreadableFileError, UserError
from accel_train.import_paths import building, check_call, import_object, is_given_object, is_import_path, source_of
from accel_train.registry import Registry
from accel_train.workloads.heads import replace_head
from accel_train.workloads.inputs import InputDefaults

MODELS: Registry[nn.Module] = Registry("model", "model.name")
# Every kind of dropout layer torch has: model.dropout=false removes them, train.keyed_dropout keys them
DROPOUT_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


@MODELS.register("mnist_cnn")
class MnistCNN(nn.Module):
    """The classic two-conv MNIST net of the PyTorch and Keras examples."""

    def __init__(self, num_classes: int, image_shape: tuple[int, int, int]) -> None:
        super().__init__()
        channels, height, width = image_shape
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.25),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * ((height - 4) // 2) * ((width - 4) // 2), 128), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(128, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


@MODELS.register("bn_cnn")
class BatchNormCNN(nn.Module):
    """Two conv blocks with BatchNorm and max-pooling ("2 Conv+pooling+BN" of the Fashion-MNIST benchmark table).

    Padded convolutions keep the resolution until each pool, so the FLOPs sit in a few large kernels: the
    shape that keeps a GPU busy when the data already lives on it.
    """

    def __init__(self, num_classes: int, image_shape: tuple[int, int, int]) -> None:
        super().__init__()
        channels, height, width = image_shape

        def block(c_in: int, c_out: int) -> list[nn.Module]:
            return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
                    nn.MaxPool2d(2)]

        self.features = nn.Sequential(*block(channels, 32), *block(32, 64), nn.Dropout(0.25))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * (height // 4) * (width // 4), 256, bias=False), nn.BatchNorm1d(256),
            nn.ReLU(inplace=True), nn.Dropout(0.5), nn.Linear(256, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


def torchvision_model_names() -> list[str]:
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def model_source(cfg: ModelConfig):
    """The module of a model that comes from a library by name (hf:, timm:): check, input_defaults, build, export;
    None for the others."""
    source = source_of(cfg.name)
    if source == "hf":
        from accel_train.workloads import hf_models

        return hf_models
    if source == "timm":
        from accel_train.workloads import timm_models

        return timm_models
    return None


TORCHVISION_CHANNELS = 3  # torchvision's classification models are built for RGB, their constructors take no other


def input_defaults(cfg: ModelConfig) -> InputDefaults:
    """What the model expects of its inputs: a Hub model's processor's, timm's pretrained_cfg, torchvision's
    pretrained weights' normalisation and RGB; nothing for the others (built for the data's channels)."""
    source = model_source(cfg)
    if source is not None:
        return source.input_defaults(cfg)
    if cfg.name in MODELS or is_import_path(cfg.name) or is_given_object(cfg.name):
        return InputDefaults()
    if cfg.pretrained:
        return InputDefaults(None, *weights_normalization(cfg.name), channels=TORCHVISION_CHANNELS)
    return InputDefaults(channels=TORCHVISION_CHANNELS)


def check_model(cfg: ModelConfig) -> None:
    """Before any data loads: a registered or torchvision name, a library's model by name, or an import path whose
    signature fits."""
    check_pretrained(cfg)
    source = model_source(cfg)
    if source is not None:
        source.check(cfg)
    elif is_import_path(cfg.name):
        factory = import_object(cfg.name, "model.name")
        check_call(factory, "model.name", cfg.name, "model.args", _given(None, None), cfg.args, _GIVEN, _THROUGH_ANY)
    elif not is_given_object(cfg.name) and cfg.name not in MODELS and cfg.name not in torchvision_model_names():
        raise UserError(f"model.name: unknown model '{cfg.name}'; choose one of {', '.join(MODELS.names())}, a "
                        "torchvision classification model (resnet18, resnet50, vgg16, vit_b_16, ...) or an import "
                        "path module:Class")


_GIVEN = frozenset({"num_classes", "image_shape"})  # passed to a user's model only where its signature takes them
_THROUGH_ANY = frozenset({"num_classes"})  # ... or its **kwargs: what every zoo's factory takes, image_shape none does


def _given(num_classes: int | None, image_shape: tuple | None) -> dict:
    return {"num_classes": num_classes, "image_shape": image_shape}


def build_by_import_path(cfg: ModelConfig, num_classes: int | None, image_shape: tuple[int, ...]) -> nn.Module:
    """The user's model: model.name=module:Attr called with num_classes / image_shape and model.args."""
    factory = import_object(cfg.name, "model.name")
    call = check_call(factory, "model.name", cfg.name, "model.args", _given(num_classes, image_shape), cfg.args, _GIVEN,
                      _THROUGH_ANY)
    with building(f"model.name={cfg.name}"):
        model = factory(**call)
    if not isinstance(model, nn.Module):
        raise UserError(f"model.name={cfg.name}: returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def build_model(cfg: ModelConfig, num_classes: int | None, image_shape: tuple[int, ...],
                classes: list[str] | None = None) -> nn.Module:
    """The model model.name names: registered, torchvision, a library's by name (hf:, timm:: its head named by
    `classes`) or by import path; model.dropout applies to all."""
    check_model(cfg)
    if is_given_object(cfg.name):
        raise UserError(f"model.name={cfg.name}: this run's model was given as a Python object; pass it again "
                        "(accel_train.evaluate(..., model=...))")
    source = model_source(cfg)
    if source is not None and num_classes is None:
        raise UserError(f"model.name={cfg.name} needs the number of classes, which the data does not give; set "
                        "data.num_classes")
    if source is not None:
        model = source.build(cfg, num_classes, classes)
    elif is_import_path(cfg.name):
        model = build_by_import_path(cfg, num_classes, image_shape)
    elif num_classes is None:
        raise UserError(f"model.name={cfg.name} needs the number of classes, which the data does not give; set "
                        "data.num_classes")
    elif cfg.name in MODELS:
        model = MODELS.get(cfg.name)(num_classes, image_shape)
    elif cfg.pretrained:
        model = pretrained_model(cfg.name, num_classes)
    else:
        import torchvision

        model = torchvision.models.get_model(cfg.name, weights=None, num_classes=num_classes)
    if cfg.freeze_backbone:
        freeze_all_but_the_head(model, num_classes)
    if not cfg.dropout:
        remove_dropout(model)
    return model


def freeze_all_but_the_head(model: nn.Module, num_classes: int) -> None:
    """model.freeze_backbone: only the last layer that outputs the classes trains (linear probing)."""
    heads = [module for module in model.modules()
             if isinstance(module, nn.Linear) and module.out_features == num_classes
             or isinstance(module, nn.Conv2d) and module.out_channels == num_classes]
    if not heads:
        raise UserError(f"model.freeze_backbone=true: no output layer of {num_classes} classes found in "
                        f"{type(model).__name__} to train alone")
    for parameter in model.parameters():
        parameter.requires_grad = False
    for parameter in heads[-1].parameters():
        parameter.requires_grad = True


def check_pretrained(cfg: ModelConfig) -> None:
    """model.pretrained and model.freeze_backbone apply to torchvision, hf: and timm: models only."""
    if cfg.freeze_backbone and not cfg.pretrained:
        raise UserError("model.freeze_backbone=true needs model.pretrained=true (a backbone worth keeping)")
    if cfg.pretrained and (cfg.name in MODELS or is_import_path(cfg.name) or is_given_object(cfg.name)):
        raise UserError(f"model.pretrained=true: {cfg.name} is not a torchvision, hf: or timm: model; load your own "
                        "weights in your model's constructor, or choose one of those (resnet18, hf:REPO, "
                        "timm:NAME, ...)")


def pretrained_weights(name: str):
    """torchvision's default weights for `name` (an enum member: its url, categories and eval transforms)."""
    import torchvision

    return torchvision.models.get_model_weights(name).DEFAULT


def weights_normalization(name: str) -> tuple[list[float], list[float]]:
    """The mean and std the pretrained weights were trained with (their eval transforms')."""
    transforms = pretrained_weights(name).transforms()
    return list(transforms.mean), list(transforms.std)


def pretrained_model(name: str, num_classes: int) -> nn.Module:
    """A torchvision model with its default weights from TORCH_HOME's cache (or downloaded), and a new head."""
    import torchvision

    weights = pretrained_weights(name)
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
    try:
        model = torchvision.models.get_model(name, weights=weights)
    except OSError as err:  # URLError, HTTPError, a refused or reset connection: no network here
        raise DataNotFoundError(f"model.pretrained=true: {cached.name} is not in {cached.parent} and downloading "
                                f"{weights.url} failed ({str(err).splitlines()[0] if str(err) else type(err).__name__}"
                                f"); put the file in that folder (TORCH_HOME sets it) or allow the download") from None
    except (RuntimeError, EOFError, pickle.UnpicklingError) as err:
        raise UnreadableFileError(f"model.pretrained=true: {cached} is damaged ({str(err).splitlines()[0]}); delete "
                                  "it to download it again, or replace it") from None
    replace_head(model, len(weights.meta["categories"]), num_classes)
    return model


def remove_dropout(model: nn.Module) -> None:
    for name, child in model.named_children():
        if isinstance(child, DROPOUT_LAYERS):
            setattr(model, name, nn.Identity())
        else:
            remove_dropout(child)


def tune_for_device(model: nn.Module, channels_last: bool) -> nn.Module:
    """Speed switches that leave what a model computes and exports unchanged, applied before prepare."""
    if channels_last and any(isinstance(m, nn.Conv2d) for m in model.modules()):
        model = model.to(memory_format=torch.channels_last)
    return model


def compile_model(model: nn.Module, compile: bool) -> nn.Module:
    """train.compile, after micro_batch_size=auto's search (which would compile again for every size it tries)."""
    if compile:
        # In place rather than torch.compile(model): no `_orig_mod.` wrapper, so the state_dict keys, the
        # exported model.safetensors and checkpoints are exactly those of the uncompiled model.
        model.compile()
    return model
