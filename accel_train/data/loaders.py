"""The DataLoaders over a split's data: global batches (or their equal micro-batches) that Accelerate's prepare
splits across processes, each epoch's order and augmentation a function of (seed, epoch)."""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.data import DataLoader, default_collate

from accel_train.config import DataConfig
from accel_train.data.in_memory import InMemoryImages, PerSampleImages, keep_batch
from accel_train.data.keyed import EVERY_GENERATOR, KeyedSamples, with_index, without_index
from accel_train.data.registry import DATASETS, Data
from accel_train.data.shards.dataset import shard_layout, under_subsets
from accel_train.data.shards.order import ShardOrder, check_order_settings
from accel_train.data.shards.prefetch import Prefetcher
from accel_train.distributed.devices import cores_per_process, dataloader_workers, finish_runs_in_workers
from accel_train.distributed.watchdog import stacks_on_request, worker_stacks_folder
from accel_train.errors import UserError


def start_epoch(loader: DataLoader, epoch: int, seed: int) -> None:
    """Data order (Accelerate's seedable sampler) and augmentation both become functions of (seed, epoch). Called
    before the epoch's iterator is made: it fetches the first batches (in workers too) as it starts."""
    loader.set_epoch(epoch)  # Accelerate passes it to the sampler only, not to the dataset
    order = _shard_order(loader)
    if order is not None:  # the seed too, and the prefetcher plans this process's reads of the epoch
        order.seed = seed
        order.prefetcher.follow(loader, order.order(epoch), order.global_batch)
    if isinstance(loader.dataset, InMemoryImages):
        loader.dataset.set_epoch(epoch, seed)
    elif isinstance(loader.dataset, KeyedSamples):
        loader.dataset.key_epoch(epoch, seed)


def _shard_order(loader) -> ShardOrder | None:
    """The ShardOrder under a (prepared, perhaps skipping) loader's batch samplers, if it has one."""
    sampler = loader.batch_sampler
    while sampler is not None and not isinstance(sampler, ShardOrder):
        sampler = getattr(sampler, "batch_sampler", None) or getattr(sampler, "sampler", None)
    return sampler


def slow_input_advice(cfg: DataConfig, data: Data) -> str:
    """The knob that feeds this data path's steps faster, for the warning a high data_wait brings."""
    if data.in_memory and cfg.on_device:  # batches are cut and augmented on the device, in the step's stream
        return "these batches are cut and augmented on the device: lower data.image_size or turn data.augment off"
    on_device = "set data.on_device=true (the dataset moves to the device once, augmented a batch at a time), or " \
        if data.in_memory else ""
    workers, cores = dataloader_workers(cfg.num_workers), cores_per_process()
    here = f"{cores} CPU core{'s' if cores != 1 else ''} per process here"
    if workers < cores:
        return f"{on_device}raise data.num_workers (now {workers}; {here})"
    # data.image_size resizes the registry's images; a user's dataset makes its own samples
    lighter = "lower data.image_size, lighten augmentation" if cfg.name in DATASETS \
        else "make the dataset's __getitem__ faster"
    return f"{on_device}{lighter} or read from faster storage: all {workers} DataLoader workers are busy ({here})"


def make_loader(data: Data, cfg: DataConfig, global_batch: int, train: bool, device: torch.device,
                accumulation: int = 1, sample_indices: bool = False) -> DataLoader:
    """A loader over GLOBAL batches, or over their `accumulation` equal micro-batches; Accelerate's prepare
    (split_batches) hands each process its slice. `sample_indices`: each batch carries its samples' indices in the
    dataset last (data/keyed.py's with_index), for dropout keyed by sample."""
    if train and len(data.dataset) < global_batch:
        raise UserError(f"the training set has {len(data.dataset)} samples, fewer than "
                        f"train.batch_size={global_batch}; "
                        "lower train.batch_size or raise data.train_subset")
    # A loader of its own generator: otherwise each new iterator draws its seed from the global RNG, the
    # stream dropout uses, and a resumed run (whose iterator starts mid-epoch) would see other dropout masks.
    # The order of samples is the seedable sampler's, a function of (seed, epoch) alone; the seeds the workers
    # get from this generator reach no transform (KeyedSamples seeds every sample).
    generator = torch.Generator().manual_seed(0)
    dataset, step_batch, global_batch = data.dataset, global_batch, global_batch // accumulation
    if data.in_memory:
        if cfg.on_device:  # no workers: a batch is a few kernels on the device, not per-image Python
            served = dataset.to(device)
            served.indices_with_samples = sample_indices
            return DataLoader(served, batch_size=global_batch, shuffle=train, drop_last=train,
                              collate_fn=keep_batch, generator=generator)
        dataset = PerSampleImages(dataset, cfg.trivial_augment, cfg.random_erasing)
    workers = dataloader_workers(cfg.num_workers)
    # A worker writes its stacks when the stuck-process watchdog asks: a blocked __getitem__ is named where it is.
    stacks = partial(stacks_on_request, str(worker_stacks_folder())) if workers else None
    collate = getattr(under_subsets(dataset)[0], "collate_fn", None)  # None: the default
    if finishes_in_loader(data, cfg, device):  # batches arrive finished: received_finish says so to the consumers
        collate = FinishingCollate(collate or default_collate, data.finish, sample_indices)
    serving = dict(batch_size=global_batch, num_workers=workers, pin_memory=device.type == "cuda",
                   persistent_workers=workers > 0, generator=generator, worker_init_fn=stacks, collate_fn=collate)
    layout = shard_layout(dataset)
    if train and layout is not None:  # shards: an order that reads a few shards at a time (shards/order.py)
        shard_of, shards = layout
        check_order_settings(step_batch, cfg.streams, len(shard_of))
        order = ShardOrder(shard_of, shards, 0, cfg.shuffle_window_shards, cfg.streams, step_batch)
        order.prefetcher = Prefetcher(dataset, min(int(cfg.cache_gb * 1e9) // 4, 2 * 2**30))
        order.on_batch = order.prefetcher.reached
        return DataLoader(keyed(dataset, sample_indices), sampler=order, drop_last=True, **serving)
    return DataLoader(keyed(dataset, sample_indices), shuffle=train, drop_last=train, **serving)


def finishes_in_loader(data: Data, cfg: DataConfig, device: torch.device) -> bool:
    """Whether make_loader's workers finish `data`'s batches (the place chosen from the device the run trains on:
    distributed/devices.py's finish_runs_in_workers), rather than the consumer where each batch is received."""
    served_on_device = data.in_memory and cfg.on_device  # no workers: the dataset serves the model's input
    return data.finish is not None and not served_on_device and \
        finish_runs_in_workers(device, dataloader_workers(cfg.num_workers))


def received_finish(data: Data, cfg: DataConfig, device: torch.device):
    """The finish a consumer of make_loader's batches applies (model_input) as it receives each: the data's own where
    the device finishes them, None where the loader's workers did."""
    return None if finishes_in_loader(data, cfg, device) else data.finish


class FinishingCollate:
    """collate_fn that finishes each batch where it is collated, in a DataLoader worker: the dataset's collation,
    then the data's finish on the batch without its samples' indices (keyed dropout's, last where they travel), as
    the consumer would have applied it on the device."""

    def __init__(self, collate, finish, indices_last: bool) -> None:
        self.collate, self.finish, self.indices_last = collate, finish, indices_last

    def __call__(self, samples: list):
        batch = self.collate(samples)
        if not self.indices_last:
            return self.finish(batch)
        fields, indices = without_index(batch)
        finished = self.finish(fields)  # a list stays a list, as the consumer's without_index gave it
        return [*finished, indices] if isinstance(finished, list) else with_index(finished, indices)


def keyed(dataset, sample_indices: bool = False) -> KeyedSamples:
    """`dataset`'s samples, each drawing by its key: seeded as draws_from says, or carrying its key to a finish that
    augments the batch on the device (`augments_on_device`: shards of the registry's raw pixels); and its index,
    where `sample_indices`."""
    return KeyedSamples(dataset, draws_from(dataset), getattr(under_subsets(dataset)[0], "augments_on_device", False),
                        sample_indices)


def draws_from(dataset) -> frozenset[str]:
    """The random generators a sample's transforms may draw from: every one unless the dataset (under its Subsets)
    names them by its own `draws_from` (ours, whose transforms we build: torch's, or none)."""
    return getattr(under_subsets(dataset)[0], "draws_from", EVERY_GENERATOR)
