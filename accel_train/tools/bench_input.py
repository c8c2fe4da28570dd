"""`accel-train bench --input [imagefolder] [data.root=FOLDER]`: images per second, per CPU core, that each way of
feeding a training step from image files delivers, side by side on the same files, at one core and at all of them;
and the cores a GPU needs to be fed at a stated demand.

Rows: decoding alone (accel-train's decoder: TorchCodec's or torchvision.io's libjpeg-turbo straight into a tensor;
the limit for a pipeline that decodes every image); torchvision's recipe (ImageFolder, PIL, transforms v2 with
Normalize on the CPU, a DataLoader: what a user writes); accel-train's ImageFolder path (data.name=imagefolder), its
JPEGs decoded at full size (data.decode=full) and at the scale each crop needs (data.decode=scaled, the default);
its shards of the same folder (images as given; JPEG shrunk to the evaluation resize; raw pixels at that size; each
from a warm cache); webdataset's loader over the shards of images as given with
torchvision's recipe; litdata's and NVIDIA DALI's CPU pipelines are named with why they have no row. Every row trains
nothing: its batches go to the training device as the float batch a step takes (torchvision's normalised on the host,
ours by the data's finish on the device: scaled, normalised, and random crops of raw pixels resized there), which
is what counts on a GPU machine, where the step costs the host little. On a CPU the device is the CPU: the finish
runs in the workers where there are some (as training runs it there), in the main process on one core.

"One core" is one process with one thread and no DataLoader worker; "all cores" one worker a core, each worker one
thread (the DataLoader's default), the main process one thread. Without a folder (the recipe's data.root missing),
one is made under output_dir from the photographs of Debian's mate-backgrounds (tools/photos.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch

from accel_train.config import DataConfig, load_config
from accel_train.errors import UserError

logger = logging.getLogger(__name__)

# ResNet-50 at 224 px with mixed precision on one A100: about 2,470 images/s (NVIDIA DeepLearningExamples' tables)
DEMAND_IMAGES_PER_S = 2470.0
# Timed from the first batch on (decoders loaded, every worker started): then at most a batch a worker is ready
# ahead, so a window of 8 batches a worker overstates a rate by at most an eighth, and typically far less
WARMUP_BATCHES = 1
BATCHES_PER_WORKER = 8


def run_input_bench(recipe: str, overrides: list[str], batches: int | None, demand: float | None) -> dict:
    from accel_train.data.decode import decoder_name
    from accel_train.data.imagefolder import evaluation_resize, imagefolder_normalization, training_split
    from accel_train.distributed.accelerator import make_accelerator
    from accel_train.tools.photos import make_photo_folder

    config = load_config(recipe, ["output_dir=runs/bench_input", "train.progress_bar=false", *overrides])
    if config.data.name != "imagefolder":
        raise UserError(f"bench --input reads a folder of image files: data.name={config.data.name}; use the "
                        "imagefolder recipe (accel-train bench --input imagefolder data.root=FOLDER), or leave "
                        "data.root out for a folder of photographs made here")
    from accel_train.distributed.devices import cores_per_process

    out = Path(config.output_dir)
    cores = cores_per_process()
    batch, batches = config.train.batch_size, batches or BATCHES_PER_WORKER * cores
    root_given = any(override.startswith("data.root=") for override in overrides)
    data = config.data
    if not root_given and not (Path(data.root) / "train").is_dir():
        started = time.perf_counter()
        root = make_photo_folder(out / "photos", train=batch * (batches + WARMUP_BATCHES), test=batch)
        logger.info(f"bench --input: a folder of photographs at {root} ({time.perf_counter() - started:.0f} s)")
        data = dataclasses.replace(data, root=str(root))
    data = dataclasses.replace(data, synthetic=False, train_subset=None, eval_subset=None)
    size = data.image_size or 224
    mean, std = imagefolder_normalization(data)  # as our path normalises: data.mean / data.std, else ImageNet's
    # exactly the files training reads (ImageFolder's: images by extension, in class folders), train/ alone needed
    files = sorted(path for path, _ in training_split(data).dataset.samples)
    if len(files) < batch * (batches + WARMUP_BATCHES):
        raise UserError(f"bench --input: {len(files)} files in {data.root}/train, fewer than the "
                        f"{batch * (batches + WARMUP_BATCHES)} that {WARMUP_BATCHES} warm-up and {batches} timed "
                        f"batches of train.batch_size={batch} take; lower --steps or train.batch_size")
    accelerator = make_accelerator(config.seed)
    device = accelerator.device
    torch.set_num_threads(1)  # the main process: one thread; the workers have one each (the DataLoader's default)

    shards_at = out / "shards"
    from accel_train.data.shards.writer import write_shards

    resize = evaluation_resize(data)  # the evaluation transform's: shrunk to it, evaluation sees the tree's pixels
    stored = {"as_given": shards_at, "jpeg": out / f"shards_jpeg_{resize}", "raw": out / f"shards_raw_{resize}"}
    # the first write reads every file of the rows and refuses one larger than data.max_image_pixels before any row
    # decodes (torchvision's and webdataset's rows decode through PIL, which refuses only at twice its own limit)
    for images, at in stored.items():
        started = time.perf_counter()
        shutil.rmtree(at, ignore_errors=True)  # written again: a rerun's check would not see the folder change
        write_shards(data, str(at), images=images, shrink_to=None if images == "as_given" else resize,
                     splits=("train",))
        logger.info(f"bench --input: shards of {data.root} ({images}) at {at} ({time.perf_counter() - started:.0f} s)")

    rows = []
    recipe_transform = torchvision_recipe(size, mean, std)
    with tempfile.TemporaryDirectory(prefix="accel-train-bench-cache-") as cache:
        shards = dataclasses.replace(data, name="shards", root=str(shards_at), cache_dir=cache)
        ways = [  # (row, its loader at N workers, whether a pass fills a cache before the row is timed)
            (f"decoding alone ({decoder_name()}, no transform): the limit",
             lambda workers: plain_loader(DecodeOnly(files, data.max_image_pixels), batch, workers, device,
                                          count_only=True), False),
            ("torchvision's recipe: ImageFolder, PIL, transforms v2, Normalize on the CPU",
             lambda workers: plain_loader(torchvision_imagefolder(data.root, recipe_transform), batch, workers,
                                          device), False),
            ("accel-train ImageFolder, JPEGs decoded at full size (data.decode=full)",
             lambda workers: our_loader(accelerator, dataclasses.replace(data, decode="full"), batch, workers),
             False),
            ("accel-train ImageFolder, JPEGs decoded at the scale the crop needs (data.decode=scaled)",
             lambda workers: our_loader(accelerator, scaled_decoding(data), batch, workers), False),
            ("accel-train shards of that folder, images as given, warm cache",
             lambda workers: our_loader(accelerator, shards, batch, workers), True),
            (f"accel-train shards, JPEG shrunk to a short side of {resize} px (images=jpeg), warm cache",
             lambda workers: our_loader(accelerator, dataclasses.replace(shards, root=str(stored["jpeg"])), batch,
                                        workers), True),
            (f"accel-train shards, raw pixels at a short side of {resize} px (images=raw), warm cache",
             lambda workers: our_loader(accelerator, dataclasses.replace(shards, root=str(stored["raw"])), batch,
                                        workers), True),
            ("webdataset's loader over those shards, torchvision's recipe",
             lambda workers: webdataset_loader(shards_at, recipe_transform, batch, workers, device), False),
        ]
        for name, loader_at, warm_first in ways:
            row = {"path": name}
            for label, workers in (("one_core", 0), ("all_cores", cores)):
                try:
                    if warm_first and label == "one_core":
                        images_per_s(loader_at(0), None)  # the cache filled once: the row reads it warm
                    loader = loader_at(workers)
                except ImportError as err:
                    row["note"] = f"not installed here ({err.name})"
                    break
                row[label] = images_per_s(loader, batches)
                del loader
                accelerator.free_memory()
            rows.append(row)
            logger.info(f"bench --input: {name}: " + (row.get("note") or f"{row['one_core']:,.0f} img/s on one core, "
                                                      f"{row['all_cores']:,.0f} on {cores}"))
    for library, why in other_pipelines().items():
        rows.append({"path": library, "note": why})
    demand = demand or DEMAND_IMAGES_PER_S
    for row in rows:
        if "all_cores" in row:
            row["per_core"] = row["all_cores"] / cores
            row["cores_per_gpu"] = demand / row["per_core"]
    result = {"recipe": recipe, "root": data.root, "files": len(files), "image_size": size, "batch_size": batch,
              "timed_batches": batches, "cores": cores, "device": device.type, "demand_images_per_s": demand,
              "cpu": _cpu_name(), "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_input.json").write_text(json.dumps(result, indent=2) + "\n")
    table = to_markdown(result)
    (out / "bench_input.md").write_text(table)
    print(table, flush=True)
    return result


def torchvision_recipe(size: int, mean, std):
    """torchvision's reference training transforms (references/classification, PIL backend): on the PIL image,
    then to a float tensor normalised on the CPU."""
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor(),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))])


def torchvision_imagefolder(root: str, transform):
    import torchvision

    return torchvision.datasets.ImageFolder(str(Path(root) / "train"), transform=transform)


class DecodeOnly(torch.utils.data.Dataset):
    """Each file read and decoded to a uint8 tensor by accel-train's decoder (data/decode.py), nothing else (none
    larger than `max_pixels`, data.max_image_pixels)."""

    def __init__(self, files: list[str], max_pixels: int) -> None:
        self.files, self.max_pixels = files, max_pixels

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int):
        from accel_train.data.decode import read_image

        return read_image(self.files[index], max_pixels=self.max_pixels)


def _count(samples) -> tuple[torch.Tensor, None]:
    """collate_fn of decoding alone: the images differ in size, and only their number is needed."""
    return torch.zeros(len(samples)), None


def plain_loader(dataset, batch: int, workers: int, device: torch.device, count_only: bool = False):
    """A DataLoader as a user writes it: shuffled, pinned for a GPU; each batch then copied to `device`."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True,
                                         num_workers=workers, pin_memory=device.type == "cuda",
                                         collate_fn=_count if count_only else None)
    return (_to(images, device) for images, _ in loader)


def _to(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    return images.to(device, non_blocking=True)


def our_loader(accelerator, cfg: DataConfig, batch: int, workers: int):
    """accel-train's training loader, each batch through the data's finish on the device (scaled, normalised, and
    crops of raw pixels resized there): the float batch a step takes."""
    from accel_train.data import build_dataset, make_loader, received_finish, start_epoch
    from accel_train.data.decode import model_input
    from accel_train.data.imagefolder import training_split

    cfg = dataclasses.replace(cfg, num_workers=workers)
    data = training_split(cfg) if cfg.name == "imagefolder" else build_dataset(cfg, train=True)
    loader = accelerator.prepare(make_loader(data, cfg, batch, True, accelerator.device))
    start_epoch(loader, 0, 0)
    finish = received_finish(data, cfg, accelerator.device)  # None: the workers finished them (a CPU with workers)
    return (model_input(finish, batch)[0] for batch in loader)


def scaled_decoding(cfg: DataConfig) -> DataConfig:
    """`cfg` with data.decode=scaled; ImportError where simplejpeg is missing (the row then says so)."""
    from accel_train.data.decode import scaling_decoder

    if scaling_decoder() is None:
        raise ImportError("simplejpeg is missing", name="simplejpeg")
    return dataclasses.replace(cfg, decode="scaled")


def webdataset_loader(shards: Path, transform, batch: int, workers: int, device: torch.device):
    """webdataset's pipeline over the shards' tar files on local disk: a shuffle buffer of a shard's samples,
    PIL decoding and torchvision's recipe, batched in the workers."""
    import webdataset as wds

    tars = sorted(str(path) for path in (shards / "train").glob("*.tar"))
    pipeline = (wds.WebDataset(tars, shardshuffle=len(tars), empty_check=False).shuffle(batch * 4).decode("pil")
                .to_tuple("jpg;jpeg;png;webp", "cls").map_tuple(lambda image: transform(image.convert("RGB")), int)
                .batched(batch, partial=False))
    loader = wds.WebLoader(pipeline, batch_size=None, num_workers=workers, pin_memory=device.type == "cuda")
    return (_to(images, device) for images, _ in loader)


def images_per_s(batches, count: int | None) -> float:
    """Images a second over `count` batches after the warm-up ones (all that come when `count` is None); each batch
    waited for on the device, as a step would use it."""
    seen, started, timed = 0, None, 0
    for number, images in enumerate(batches):
        if number + 1 == WARMUP_BATCHES:  # the clock starts once the last warm-up batch is there
            _sync(images)
            started = time.perf_counter()
            continue
        seen, timed = seen + len(images), timed + 1
        if count is not None and timed == count:
            break
    if started is None or count is not None and timed < count:
        raise UserError(f"bench --input: the loader gave fewer than the {WARMUP_BATCHES} + {count} batches to time; "
                        "add images or lower train.batch_size or --steps")
    _sync(images)
    return seen / (time.perf_counter() - started)


def _sync(images: torch.Tensor) -> None:
    if images.device.type == "cuda":
        torch.cuda.synchronize(images.device)


def other_pipelines() -> dict[str, str]:
    """The loaders named by the issue that have no row here, and why."""
    said = {}
    if importlib.util.find_spec("litdata") is None:
        said["litdata's loader"] = "not installed here (pip install litdata); no row"
    else:
        said["litdata's loader"] = "installed, but bench --input has no row for it yet"
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None:
        said["NVIDIA DALI's CPU pipeline"] = "not installed here (nvidia-dali-cuda wheels; no CPU-only build); no row"
    else:
        said["NVIDIA DALI's CPU pipeline"] = "installed, but bench --input has no row for it yet"
    return said


def _cpu_name() -> str:
    from accel_train.tools.bench import machine_info

    return str(machine_info().get("cpu", "?"))


def to_markdown(result: dict) -> str:
    cores, demand = result["cores"], result["demand_images_per_s"]
    lines = [f"# accel-train bench --input: {result['files']} files of {result['root']}, {result['image_size']} px, "
             f"batches of {result['batch_size']} ({result['cpu']}, {cores} cores, to {result['device']})", "",
             f"| path | img/s, one core | img/s, {cores} cores | img/s per core | cores per GPU at "
             f"{demand:,.0f} img/s |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        if "all_cores" not in row:
            lines.append(f"| {row['path']} | {row['note']} | | | |")
            continue
        lines.append(f"| {row['path']} | {row['one_core']:,.0f} | {row['all_cores']:,.0f} | {row['per_core']:,.0f} "
                     f"| {row['cores_per_gpu']:.1f} |")
    return "\n".join(lines) + "\n"
