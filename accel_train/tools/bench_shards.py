"""`accel-train bench --shards URL`: the input pipeline over the same images from shards in a store (a cold and a
warm cache), from an ImageFolder tree on local disk, and through webdataset's own loader over the same shards,
side by side; and the bytes each read from the store.

The recipe's images (a dataset of the registry) are written as an ImageFolder tree in a temporary folder (removed at
the end, as every scratch file of the bench) and as shards of that tree at URL; every row then decodes the same PNG
files with the same transforms (ImageFolder's, at the images' own size) on the same number of DataLoader workers, one
epoch each, every batch delivered to the training device. Bytes read from the store are what the cache took in
(blocks are only ever added by a download), or, for webdataset, the shards it streamed. A window too short to time
(fewer batches than four times those the workers hold ready) is refused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path

from accel_train.config import Config, load_config
from accel_train.data import build_dataset, make_loader, start_epoch
from accel_train.data.in_memory import pil_image
from accel_train.data.shards.dataset import open_store, read_index
from accel_train.data.shards.writer import write_shards
from accel_train.distributed.accelerator import make_accelerator
from accel_train.distributed.devices import dataloader_workers
from accel_train.errors import UserError

logger = logging.getLogger(__name__)


def run_shards_bench(recipe: str, overrides: list[str], url: str, batches: int | None) -> dict:
    config = load_config(recipe, ["output_dir=runs/bench_shards", "train.progress_bar=false", *overrides])
    with tempfile.TemporaryDirectory(prefix="accel-train-bench-tree-") as scratch:
        return _bench(recipe, config, url, batches, Path(scratch) / "images")


def _bench(recipe: str, config: Config, url: str, batches: int | None, tree: Path) -> dict:
    out = Path(config.output_dir)
    source = build_dataset(config.data, train=True)
    if not source.in_memory:
        raise UserError(f"bench --shards: data.name={config.data.name}: give a recipe of a dataset of the registry "
                        "(mnist, fashion_mnist, cifar10, stl10); its images are written as an ImageFolder tree and "
                        "as shards of it, so that every row reads the same files")
    started = time.perf_counter()
    _write_tree(config, tree)
    side = source.image_shape[-1]
    data = dataclasses.replace(config.data, name="imagefolder", root=str(tree), image_size=side, train_subset=None,
                               eval_subset=None)
    write_shards(data, url, shard_mb=16)
    logger.info(f"bench --shards: the images and the shards ready in {time.perf_counter() - started:.0f} s")
    shards = dataclasses.replace(data, name="shards", root=url)
    accelerator = make_accelerator(config.seed)
    batch, workers = config.train.batch_size, dataloader_workers(config.data.num_workers)
    rows = []
    with tempfile.TemporaryDirectory(prefix="accel-train-bench-cache-") as cache:
        shards = dataclasses.replace(shards, cache_dir=cache)
        for name in ("shards from the store, cold cache", "shards from the store, warm cache"):
            before = _folder_bytes(Path(cache))
            rate, samples = _epoch(accelerator, shards, batch, batches)
            rows.append({"source": name, "samples_per_s": rate, "samples": samples,
                         "store_bytes": _folder_bytes(Path(cache)) - before})
    rate, samples = _epoch(accelerator, data, batch, batches)
    rows.append({"source": "ImageFolder tree on local disk", "samples_per_s": rate, "samples": samples,
                 "store_bytes": 0})
    rows += _stored_anew(accelerator, config, batch, batches)
    try:
        rate, samples, streamed = _webdataset_epoch(shards, batch, workers, batches, accelerator.device)
        rows.append({"source": "webdataset's own loader over the same shards", "samples_per_s": rate,
                     "samples": samples, "store_bytes": streamed})
    except ImportError:
        logger.info("bench --shards: webdataset is not installed (pip install webdataset): its row is left out")
    result = {"recipe": recipe, "url": url, "batch_size": batch, "workers": workers, "image_size": side,
              "train_samples": len(source.dataset), "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_shards.json").write_text(json.dumps(result, indent=2) + "\n")
    table = to_markdown(result)
    (out / "bench_shards.md").write_text(table)
    print(table, flush=True)
    return result


def _stored_anew(accelerator, config: Config, batch: int, batches: int | None) -> list[dict]:
    """Rows for shards of the recipe's own data on local disk (its transforms, not ImageFolder's), as PNG files
    (images=as_given) and as raw pixels (images=auto, the default): what storing pixels saves, decoding aside.
    Each from a warm cache (an epoch read before the timed one)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="accel-train-bench-shards-") as scratch:
        for images, name in (("as_given", "PNG files"), ("raw", "raw pixels")):
            write_shards(config.data, f"{scratch}/{images}", shard_mb=16, images=images)
            shards = dataclasses.replace(config.data, name="shards", root=f"{scratch}/{images}",
                                         cache_dir=f"{scratch}/cache-{images}")
            _epoch(accelerator, shards, batch, batches)
            rate, samples = _epoch(accelerator, shards, batch, batches)
            rows.append({"source": f"shards of the recipe's data as {name} (images={images}) on local disk, warm "
                         "cache, the recipe's transforms", "samples_per_s": rate, "samples": samples,
                         "store_bytes": 0})
    return rows


def _write_tree(config: Config, tree: Path) -> None:
    """The recipe's train and test images as PNG files in class folders."""
    for split, train in (("train", True), ("test", False)):
        data = build_dataset(config.data, train)
        images, labels = data.dataset.images.cpu(), data.dataset.labels.cpu()
        for index in range(len(labels)):
            folder = tree / split / data.classes[int(labels[index])].replace("/", "_")
            folder.mkdir(parents=True, exist_ok=True)
            pil_image(images[index]).save(folder / f"{index:06d}.png")


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _epoch(accelerator, cfg, batch: int, batches: int | None) -> tuple[float, int]:
    """Samples per second over one epoch (or `batches`) of the training loader, after two warm-up batches."""
    data = build_dataset(cfg, train=True)
    loader = accelerator.prepare(make_loader(data, cfg, batch, True, accelerator.device))
    start_epoch(loader, 0, 0)
    rate, seen = _timed(loader, batches, dataloader_workers(cfg.num_workers))
    accelerator.free_memory()
    return rate, seen


def _timed(loader, batches: int | None, workers: int = 0) -> tuple[float, int]:
    """Samples per second over the loader's batches (or `batches` of them) after two warm-up batches, and how many.
    `workers` DataLoader workers hold up to two batches each ready before the clock starts: a window of fewer than
    four times those would report them as read in no time, so it is refused."""
    seen, started, timed = 0, None, 0
    for number, (images, *_) in enumerate(loader):
        if number < 2:  # warm-up: the clock starts once the second batch is there, which is not counted
            started = time.perf_counter()
            continue
        seen, timed = seen + len(images), timed + 1
        if batches is not None and number >= batches + 1:
            break
    needed = 4 * max(1, 2 * workers)
    if timed < needed:
        raise UserError(f"bench --shards: {timed} batch(es) to time after the 2 of warm-up, fewer than the {needed} a "
                        f"window needs with {workers} DataLoader worker(s) holding batches ready before the clock "
                        "starts; raise data.train_subset or --steps, or lower train.batch_size")
    return seen / (time.perf_counter() - started), seen


def _webdataset_epoch(cfg, batch: int, workers: int, batches: int | None, device) -> tuple[float, int, int]:
    """webdataset's loader over the same tars (read through the same fsspec client), with a shuffle buffer of one
    shard's samples and the same transforms; its batches copied to `device` from pinned memory, as the other rows'
    prepared loaders deliver theirs."""
    import sys

    import fsspec
    import webdataset as wds

    from accel_train.data.imagefolder import imagefolder_transform

    store = open_store(cfg)
    index = read_index(store, "train")
    urls = [store.url(f"train/{shard.name}") for shard in index.shards]
    gopen = sys.modules["webdataset.gopen"]
    for scheme in {url.split("://", 1)[0] for url in urls if "://" in url}:  # webdataset's own extension point
        gopen.gopen_schemes[scheme] = lambda url, mode="rb", bufsize=8192, **kw: fsspec.open(url, mode).open()
    transform = imagefolder_transform(cfg, train=True, normalization=(tuple(index.mean), tuple(index.std)))
    per_shard = max(1, index.samples // len(index.shards))
    pipeline = (wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.split_by_node, empty_check=False)
                .shuffle(per_shard).decode("pil").to_tuple("png", "cls")
                .map_tuple(lambda image: transform(image.convert("RGB")), int).batched(batch, partial=False))
    loader = wds.WebLoader(pipeline, batch_size=None, num_workers=workers, pin_memory=device.type == "cuda")
    rate, seen = _timed(((images.to(device), labels) for images, labels in loader), batches, workers)
    return rate, seen, index.bytes if batches is None else 0


def to_markdown(result: dict) -> str:
    lines = [f"# accel-train bench --shards: {result['recipe']} ({result['train_samples']:,} training images, "
             f"{result['image_size']} px, batch {result['batch_size']}, {result['workers']} DataLoader workers)", "",
             "| source | samples/s | bytes read from the store this epoch |", "|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['source']} | {row['samples_per_s']:,.0f} | {row['store_bytes'] / 1e6:,.1f} MB |")
    return "\n".join(lines) + "\n"

