"""`accel-train predict`: the top labels of image files, each file exactly once, the same at any world size.

Each file is read and converted as the recipe's evaluation data is (channels, size, normalisation). The
files are split across processes by Accelerate's prepared DataLoader, and `gather_for_metrics` drops the
padding of the last batch, so every file gets exactly one row. The global batch is `predict.batch_size` per
process, so the model sees batches of that size at any world size. The class names come from the run
folder (classes.json, written by training).
"""

from __future__ import annotations

import csv
import glob
import io
from pathlib import Path

import torch
from torch.utils.data import Dataset

from accel_train.config import Config
from accel_train.data import Data, image_converter, load_image, make_loader
from accel_train.distributed.accelerator import finish_command, make_accelerator
from accel_train.distributed.devices import set_numerics
from accel_train.errors import DataNotFoundError, writing
from accel_train.run.weights import class_names, load_weights, read_weights, weights_file
from accel_train.storage import Store, check_location, is_remote
from accel_train.workloads.tasks import Task, task_named

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def find_images(spec: str) -> list[Path]:
    """An image file, the images under a folder (recursively), or those a glob matches; sorted by path."""
    path = Path(spec)
    if path.is_file():
        found = [path]
    elif path.is_dir():
        found = [file for file in path.rglob("*") if file.is_file() and file.suffix.lower() in IMAGE_EXTENSIONS]
    else:
        found = [Path(name) for name in glob.glob(spec, recursive=True)
                 if Path(name).is_file() and Path(name).suffix.lower() in IMAGE_EXTENSIONS]
    if not found:
        raise DataNotFoundError(f"input={spec}: no image file there ({' '.join(IMAGE_EXTENSIONS)}); pass a file, "
                                "a folder or a glob such as 'photos/*.jpg' (quoted)")
    return sorted(found, key=str)


class ImageFiles(Dataset):
    """(model input, index) for each file; the index says which file a gathered row belongs to.

    Padded to whole global batches with copies of the last file (index -1, dropped from the results), so every
    process runs full batches of predict.batch_size, and each file is in the same batch, at the same place, at any
    world size: a batch of another shape may run other kernels, whose last bits differ."""

    def __init__(self, files: list[Path], convert, global_batch: int, max_pixels: int) -> None:
        self.files, self.convert, self.max_pixels = files, convert, max_pixels
        self.length = -(-len(files) // global_batch) * global_batch

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        padding = index >= len(self.files)
        image = self.convert(load_image(str(self.files[-1 if padding else index]), "predict", self.max_pixels))
        return image, -1 if padding else index


def predict(config: Config, checkpoint: str, inputs: str, output: str | None = None, *, task: Task | None = None,
            model: torch.nn.Module | None = None) -> list[dict]:
    """Rows {"path", "labels", "scores"} for every input file, sorted by path; written as CSV to `output` (a local
    file or a URL)."""
    if output:
        check_location(str(output), "output")  # before any work: a mistyped URL, a store's missing library
    task = task if task is not None else task_named(config.task)
    task.check_config(config)
    convert, shape = image_converter(config.data)
    weights = weights_file(checkpoint)
    classes = class_names(checkpoint, config.data.num_classes)
    files = find_images(inputs)
    if shape is None:  # a user's transform: the shape of what it makes of the first file
        shape = tuple(convert(load_image(str(files[0]), "predict", config.data.max_image_pixels)).shape)
    state = read_weights(weights)
    set_numerics(config.train.deterministic, config.train.tf32)  # as the run trained
    accelerator = make_accelerator(config.seed)
    data = Data(None, len(classes), shape, classes)
    task.setup(config, data)
    model = load_weights(model if model is not None else task.build_model(config, data), state, checkpoint,
                         f"model.name={config.model.name} on {config.data.name}")
    global_batch = config.predict.batch_size * accelerator.num_processes
    loader = make_loader(Data(ImageFiles(files, convert, global_batch, config.data.max_image_pixels), len(classes),
                              shape), config.data, global_batch, False, accelerator.device)
    model, loader = accelerator.prepare(model, loader)
    model.eval()
    found: dict[int, tuple[list[int], list[float]]] = {}
    with torch.no_grad():
        for images, indices in loader:
            rows = accelerator.gather_for_metrics({"index": indices, **task.predict_step(model, images)})
            for index, labels, scores in zip(rows["index"].tolist(), rows["labels"].tolist(), rows["scores"].tolist()):
                if index >= 0:
                    found[index] = (labels, scores)
    results = [{"path": str(files[index]), "labels": [classes[label] for label in found[index][0]],
                "scores": found[index][1]} for index in range(len(files))]
    if output and accelerator.is_main_process:
        write_csv(results, output)
    finish_command(accelerator)
    return results


def write_csv(results: list[dict], output: str | Path) -> None:
    """path,label,score[,label_2,score_2,...]: best first, scores (softmax probabilities) with 6 decimals; into a
    local file, or an object at a URL."""
    top_k = len(results[0]["labels"])
    header = ["path", "label", "score"]
    header += [f"{name}_{rank}" for rank in range(2, top_k + 1) for name in ("label", "score")]
    text = io.StringIO(newline="")
    rows = csv.writer(text)
    rows.writerow(header)
    for result in results:
        pairs = [value for label, score in zip(result["labels"], result["scores"]) for value in (label, f"{score:.6f}")]
        rows.writerow([result["path"], *pairs])
    if is_remote(str(output)):
        folder, _, name = str(output).rstrip("/").rpartition("/")
        Store(folder, "output").write(name, text.getvalue().encode())
        return
    path = Path(output)
    with writing(path, "writing the predictions"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.getvalue(), newline="")
