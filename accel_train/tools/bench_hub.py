"""`accel-train bench --hub [RECIPE] [KEY=VALUE ...]`: accel-train against the loop Hugging Face's own Accelerate
example writes (transformers' examples/pytorch/image-classification/run_image_classification_no_trainer.py), on the same
hf: model, hf: data, global batch, DataLoader workers and mixed precision: training samples per second, each the best
of WINDOWS windows after a warm-up one, the two loops interleaved over `rounds`.

The example's loop, as it is written there: the dataset's `with_transform` turns each PIL image into a normalised
float tensor with torchvision's transforms (RandomResizedCrop, RandomHorizontalFlip, ToTensor, Normalize), a
DataLoader with its collate_fn stacks them, and Accelerate prepares the model, optimizer and loader; a step is
`model(**batch).loss`, backward, step. Ours: `accel-train train` with the same keys (uint8 decoding, keyed
augmentation, normalisation on the device). Without a dataset named, one is made from the photographs of Debian's
mate-backgrounds (`accel-train photos`), read as an hf: dataset of image files; without a model named, a small
transformers ResNet (a ResNet-10 of a quarter of ResNet-18's widths, 0.3 M parameters, freshly initialised, saved into
output_dir): small enough that on a CPU the input pipeline, not the model, decides the speed.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import torch

from accel_train.config import Config, load_config
from accel_train.errors import UserError
from accel_train.import_paths import source_of

logger = logging.getLogger(__name__)

WINDOWS = 3


def run_hub_bench(recipe: str, overrides: list[str], steps: int | None, rounds: int = 2) -> dict:
    from accel_train.tools.bench import best_window, machine_info

    steps = steps or 8
    given = {override.partition("=")[0] for override in overrides}
    out = Path(load_config(recipe, overrides).output_dir if "output_dir" in given else "runs/bench_hub")
    defaults = []
    if "model.name" not in given:
        defaults.append(f"model.name=hf:{small_resnet(out / 'resnet10_thin')}")
    if "data.name" not in given:
        from accel_train.tools.photos import make_photo_folder

        config = load_config(recipe, [*defaults, *overrides])
        photos = make_photo_folder(out / "photos", train=config.train.batch_size * (steps * (1 + WINDOWS) + 1),
                                   test=16)
        defaults.append(f"data.name=hf:{photos}")
    timing = [f"train.max_steps={steps * (1 + WINDOWS)}", f"train.log_every_steps={steps}", "train.epochs=1000",
              "train.warmup_steps=0", "checkpoint.at_epoch_end=false", "train.progress_bar=false", "train.plot=false",
              "data.eval_subset=16"]
    config = load_config(recipe, [*defaults, *overrides, *timing, f"output_dir={out / 'ours'}"])
    if source_of(config.model.name) != "hf" or source_of(config.data.name) != "hf":
        raise UserError("bench --hub compares Hugging Face's example with accel-train on an hf: model and hf: data; "
                        f"model.name={config.model.name}, data.name={config.data.name}")
    from accel_train import api
    from accel_train.workloads.tasks import task_named

    task_named(config.task).check_config(config)  # the processor's input size and normalisation, for both loops
    shutil.rmtree(out / "ours", ignore_errors=True)  # the bench's own runs: trained again each time
    ours, theirs = [], []
    for number in range(rounds):  # interleaved, best of each: load from other jobs hits both alike
        logger.info(f"bench --hub: round {number + 1}/{rounds}: Hugging Face's example loop")
        theirs.append(example_loop(config, steps))
        logger.info(f"bench --hub: round {number + 1}/{rounds}: accel-train")
        run = load_config(recipe, [*defaults, *overrides, *timing, f"output_dir={out / 'ours' / str(number)}"])
        api.train(run)
        ours.append(best_window([line for line in _lines(Path(run.output_dir)) if line["split"] == "train"]))
    from accel_train.distributed.devices import dataloader_workers

    best = max(ours, key=lambda line: line["samples_per_s"])
    result = {"model": config.model.name, "data": config.data.name, "image_size": config.data.image_size,
              "batch_size": config.train.batch_size, "workers": dataloader_workers(config.data.num_workers),
              "steps_per_window": steps, "windows": WINDOWS, "rounds": rounds, "machine": machine_info(),
              "ours_samples_per_s": best["samples_per_s"], "ours_data_wait": best["data_wait"],
              "example_samples_per_s": max(theirs), "ratio": best["samples_per_s"] / max(theirs),
              "all_ours": [line["samples_per_s"] for line in ours], "all_example": theirs}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_hub.json").write_text(json.dumps(result, indent=2) + "\n")
    line = (f"bench --hub: accel-train {result['ours_samples_per_s']:,.1f} samples/s, Hugging Face's example loop "
            f"{result['example_samples_per_s']:,.1f}: {result['ratio']:.2f}x ({config.model.name} on "
            f"{config.data.name}, {config.data.image_size} px, batch {config.train.batch_size}, {result['workers']} "
            f"DataLoader workers; {result['machine']['cpu']}, {result['machine']['cpu_cores']} cores)")
    print(line, flush=True)
    return result


def _lines(folder: Path) -> list[dict]:
    from accel_train.run.layout import read_lines

    return read_lines(folder)


def small_resnet(folder: Path) -> Path:
    """A transformers ResNet-10 of a quarter of ResNet-18's widths, freshly initialised, with an image processor for
    224 px (a resize to 256, a centre crop)."""
    if (folder / "config.json").is_file():
        return folder
    from transformers import ConvNextImageProcessor, ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(layer_type="basic", depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128], embedding_size=16,
                          num_labels=10)
    ResNetForImageClassification(config).save_pretrained(folder)
    ConvNextImageProcessor(size={"shortest_edge": 224}, crop_pct=0.875).save_pretrained(folder)
    return folder


def example_loop(config: Config, steps: int) -> float:
    """Hugging Face's example loop on `config`'s model and data: its best window's training samples per second."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torchvision.transforms import Compose, Normalize, RandomHorizontalFlip, RandomResizedCrop, ToTensor

    from accel_train.data.hub import columns, splits_of
    from accel_train.data.registry import Data
    from accel_train.distributed.devices import dataloader_workers
    from accel_train.workloads.tasks import task_named

    set_seed(config.seed)
    split = splits_of(config.data)[config.data.train_split]
    image, label = columns(config.data, split)
    size = config.data.image_size
    normalize = Normalize(mean=config.data.mean, std=config.data.std)
    train_transforms = Compose([RandomResizedCrop(size), RandomHorizontalFlip(), ToTensor(), normalize])

    def preprocess_train(example_batch):  # the example's, as written there
        example_batch["pixel_values"] = [train_transforms(item.convert("RGB")) for item in example_batch[image]]
        return example_batch

    def collate_fn(examples):
        pixel_values = torch.stack([example["pixel_values"] for example in examples])
        labels = torch.tensor([example[label] for example in examples])
        return {"pixel_values": pixel_values, "labels": labels}

    train_dataset = split.with_transform(preprocess_train)
    accelerator = Accelerator(mixed_precision=None)
    loader = torch.utils.data.DataLoader(train_dataset, shuffle=True, collate_fn=collate_fn,
                                         batch_size=config.train.batch_size // accelerator.num_processes,
                                         num_workers=dataloader_workers(config.data.num_workers))
    names = split.features[label].names
    task = task_named(config.task)
    data = Data(None, len(names), (3, size, size), list(names))
    task.setup(config, data)
    model = task.build_model(config, data)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.train.lr, weight_decay=config.train.weight_decay)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    seconds, taken, batches = [], 0, iter(loader)
    while len(seconds) < 1 + WINDOWS:
        started = time.perf_counter()
        for _ in range(steps):
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(loader)
                batch = next(batches)
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            optimizer.step()
            optimizer.zero_grad()
            taken += 1
        outputs.loss.item()  # wait for the device, as its logging does
        seconds.append(time.perf_counter() - started)
    accelerator.free_memory()
    return steps * config.train.batch_size / min(seconds[1:])
