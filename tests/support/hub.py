"""Hugging Face models and datasets made here, offline: tiny transformers classifiers saved by save_pretrained (with
their image processors), datasets of one-colour images written as local parquet repositories or by save_to_disk, and
a Hugging Face cache holding them under Hub names (the layout huggingface_hub reads: refs/main, snapshots/SHA/)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image

COLOURS = {"blue": (0, 0, 255), "green": (0, 255, 0), "red": (255, 0, 0)}
REVISION = "0123456789abcdef0123456789abcdef01234567"


def tiny_vit(folder: Path, classes: list[str] | None = None, side: int = 16, mean: float = 0.5,
             dropout: float = 0.0, channels: int = 3) -> Path:
    """A ViT of a few thousand parameters (16 px, 4 px patches) for images of `channels` channels with a ViT image
    processor: 16x16, mean `mean`; `dropout` its hidden layers' (nn.Dropout) probability."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    classes = classes or ["cat", "dog"]
    config = ViTConfig(image_size=side, patch_size=4, num_channels=channels, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=32, hidden_dropout_prob=dropout,
                       num_labels=len(classes), id2label=dict(enumerate(classes)),
                       label2id={name: index for index, name in enumerate(classes)})
    with torch.random.fork_rng():  # the same weights whatever the global stream holds: a test's numbers are fixed
        torch.manual_seed(0)
        ViTForImageClassification(config).save_pretrained(folder)
    ViTImageProcessor(size={"height": side, "width": side}, image_mean=[mean] * channels, image_std=[0.25] * channels,
                      resample=3).save_pretrained(folder)
    return folder


def tiny_resnet(folder: Path, classes: list[str] | None = None) -> Path:
    """A ResNet of a few thousand parameters with ConvNeXt's image processor (resize to 16 / 0.8, crop 16; ImageNet's
    normalisation)."""
    from transformers import ConvNextImageProcessor, ResNetConfig, ResNetForImageClassification

    classes = classes or ["cat", "dog"]
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                          num_labels=len(classes), id2label=dict(enumerate(classes)),
                          label2id={name: index for index, name in enumerate(classes)})
    with torch.random.fork_rng():  # the same weights whatever the global stream holds
        torch.manual_seed(0)
        ResNetForImageClassification(config).save_pretrained(folder)
    ConvNextImageProcessor(size={"shortest_edge": 16}, crop_pct=0.8, image_mean=[0.485, 0.456, 0.406],
                           image_std=[0.229, 0.224, 0.225]).save_pretrained(folder)
    return folder


def colour_rows(names: tuple[str, ...], per_class: int, size: tuple[int, int] = (12, 10)) -> dict:
    """{"image": PNG bytes, "label": class index in COLOURS} rows: one colour a class, a shade a row."""
    images, labels = [], []
    for name in names:
        for number in range(per_class):
            pixel = (np.array(COLOURS[name]) * (0.6 + 0.1 * (number % 4))).astype(np.uint8)
            encoded = io.BytesIO()
            Image.fromarray(np.full((*size, 3), pixel, np.uint8)).save(encoded, format="PNG")
            images.append({"bytes": encoded.getvalue(), "path": None})
            labels.append(list(COLOURS).index(name))
    return {"image": images, "label": labels}


def colour_dataset(splits: dict[str, tuple[tuple[str, ...], int]], class_names: tuple[str, ...] = tuple(COLOURS),
                   image_column: str = "image", label_column: str = "label"):
    """A DatasetDict of one-colour images: {split: (colours, images a colour)}; labels a ClassLabel of
    `class_names` (each colour's label is its index there)."""
    import datasets

    features = datasets.Features({image_column: datasets.Image(),
                                  label_column: datasets.ClassLabel(names=list(class_names))})
    made = {}
    for split, (names, per_class) in splits.items():
        rows = colour_rows(names, per_class)
        rows["label"] = [class_names.index(list(COLOURS)[label]) for label in rows["label"]]
        made[split] = datasets.Dataset.from_dict({image_column: rows["image"], label_column: rows["label"]},
                                                 features=features)
    return datasets.DatasetDict(made)


def as_image_files(split, folder: Path) -> Path:
    """A split's images as files folder/CLASS/i.png, each under its class's name (its own ClassLabel's)."""
    names = split.features["label"].names
    for index, (image, label) in enumerate(zip(split["image"], split["label"])):
        (folder / names[label]).mkdir(parents=True, exist_ok=True)
        image.save(folder / names[label] / f"{index}.png")
    return folder


def as_parquet_repository(dataset, folder: Path) -> Path:
    """A folder laid out as a Hub dataset repository of parquet files (data/SPLIT-00000-of-00001.parquet)."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    for split, rows in dataset.items():
        rows.to_parquet(str(folder / "data" / f"{split}-00000-of-00001.parquet"))
    return folder


def as_arrow_repository(dataset, folder: Path) -> Path:
    """A folder of arrow files as datasets writes them (data/SPLIT-00000-of-00001.arrow), each with its features."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    for split, rows in dataset.items():
        rows.save_to_disk(str(folder / "saved" / split))
        shutil.move(next((folder / "saved" / split).glob("*.arrow")), folder / "data" / f"{split}-00000-of-00001.arrow")
    shutil.rmtree(folder / "saved")
    return folder


def into_cache(hf_home: Path, kind: str, repo_id: str, files: Path) -> None:
    """`files` (a folder) as the snapshot of Hub repository `repo_id` (kind: models or datasets) in the Hugging Face
    cache at `hf_home`, at REVISION, which refs/main names."""
    repo = hf_home / "hub" / f"{kind}--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    shutil.copytree(files, repo / "snapshots" / REVISION)
