"""What a run did, recorded through the package's hooks (accel_train.hooks): the batches each process read, the
pixels the model received, the steps it took and the checkpoints it saved. A recorder never changes what the run
computes. The launched probe (tests/launched_probe.py) writes them per process; in-process tests use them directly.
"""

from __future__ import annotations

import dataclasses
import hashlib
from contextlib import contextmanager

import torch

from accel_train import hooks
from accel_train.data import InMemoryImages
from accel_train.data.in_memory import pad_for
from accel_train.data.shards.dataset import ShardSamples


class RecordedImages(InMemoryImages):
    """The same in-memory images; the indices of each batch the loader fetches are appended to `into`."""

    def __init__(self, source: InMemoryImages, into: list) -> None:
        vars(self).update(vars(source))
        self.into = into

    def __getitems__(self, indices):
        self.into.append([int(index) for index in indices])
        return super().__getitems__(indices)


class RecordedShardSamples(ShardSamples):
    """The same shards (still a ShardSamples, so the loader orders them with ShardOrder); the id of each sample read
    is appended to `into`, in the order read. The DataLoader reads them through KeyedSamples one by one, so this
    records in the process only with data.num_workers=0 (a worker's reads stay in the worker)."""

    def __init__(self, source: ShardSamples, into: list) -> None:
        vars(self).update(vars(source))
        self.into = into

    def __getitem__(self, sample: int):
        self.into.append(int(sample))
        return super().__getitem__(sample)

    def __getitems__(self, samples: list[int]) -> list:
        self.into.extend(int(sample) for sample in samples)
        return super().__getitems__(samples)


def recorded_shards(dataset, into: list):
    """`dataset` (shards, or a Subset of them: data.train_subset) with its ShardSamples recording into `into`; None
    for any other dataset."""
    if isinstance(dataset, ShardSamples):
        return RecordedShardSamples(dataset, into)
    if isinstance(dataset, torch.utils.data.Subset) and isinstance(dataset.dataset, ShardSamples):
        return torch.utils.data.Subset(RecordedShardSamples(dataset.dataset, into), dataset.indices)
    return None


class CropFinder:
    """Which training image, crop offset and mirroring an augmented model input shows, found from its pixels: a
    table of every zero-padded crop of every training image, and its mirror image. Meant for a few dozen noise
    images (synthetic data), where each crop is unique; a random crop + flip of (seed, epoch, index) or of a
    DataLoader worker's random state is then observed in what the model received, not in how it was drawn."""

    def __init__(self, images, mean, std, padding: int) -> None:
        import torch.nn.functional as F

        self.mean, self.std = mean.cpu().view(1, -1, 1, 1), std.cpu().view(1, -1, 1, 1)
        images = images.cpu()
        side, offsets = images.shape[-1], range(2 * padding + 1)
        padded = F.pad(images, (padding,) * 4)
        draws = [(top, left, flip) for top in offsets for left in offsets for flip in (False, True)]
        crops = [padded[..., top:top + side, left:left + side].flip(-1) if flip else
                 padded[..., top:top + side, left:left + side] for top, left, flip in draws]
        rows = torch.stack(crops).flatten(2).numpy()  # (draw, image, pixels)
        self.table = {rows[d, index].tobytes(): [index, *draw] for d, draw in enumerate(draws)
                      for index in range(len(images))}

    def __call__(self, inputs) -> list[list | None]:
        """[index, top, left, flip] for each normalised model input of a batch; None where no crop matches."""
        pixels = ((inputs.detach().float().cpu() * self.std + self.mean) * 255).round().clamp(0, 255)
        return [self.table.get(image.to(torch.uint8).contiguous().numpy().tobytes()) for image in pixels]


class Crops(hooks.Hooks):
    """Each training micro-batch a classification model receives (this process's share) appends
    [epoch, [[index, top, left, flip] for each image]] to `into`, found by a CropFinder over the training set of an
    in-memory dataset (on the device or file-backed, data.on_device=false)."""

    def __init__(self, into: list) -> None:
        self.into, self.finder = into, None

    def data_built(self, data, split):
        if split == "train" and isinstance(data.dataset, InMemoryImages):
            samples = data.dataset
            self.finder = CropFinder(samples.images, samples.mean, samples.std, pad_for(samples.images.shape[-1]))
        return data

    def micro_batch_loaded(self, progress, batch):
        if self.finder is not None:
            self.into.append([progress.epoch, self.finder(batch[0])])


class Inputs(hooks.Hooks):
    """Each training micro-batch a classification model receives (this process's share) appends
    [epoch, [[label, digest of the input] for each sample]] to `into`: with labels that are the samples' indices,
    what each sample looked like after its transforms, bit for bit."""

    def __init__(self, into: list) -> None:
        self.into = into

    def micro_batch_loaded(self, progress, batch):
        inputs, labels = batch[0].detach().cpu(), batch[1].tolist()
        self.into.append([progress.epoch, [[label, hashlib.sha1(sample.contiguous().numpy().tobytes()).hexdigest()[:16]]
                                           for label, sample in zip(labels, inputs)]])


@contextmanager
def crops_of_training_batches(into: list):
    with hooks.added(Crops(into)):
        yield into


@contextmanager
def inputs_of_training_batches(into: list):
    with hooks.added(Inputs(into)):
        yield into


def digests(state: dict) -> dict[str, str]:
    """A digest of each tensor of a state dict (its dtype, shape and bytes), by name."""
    return {name: hashlib.sha1(f"{tensor.dtype} {tuple(tensor.shape)}".encode()
                               + tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
            for name, tensor in state.items()}


class Run(hooks.Hooks):
    """The launched probe's recorders (PROBE_DIR), each a list in `record` (see tests/launched_probe.py)."""

    def __init__(self, record: dict) -> None:
        self.record = record
        self.training_forwards = 0
        self.shard_reads: list[int] | None = None  # the ids of shard samples read and not yet in a loaded micro-batch

    def data_built(self, data, split):
        if split == "train" and not isinstance(data.dataset, InMemoryImages):
            reads = []
            recording = recorded_shards(data.dataset, reads)
            if recording is None:
                return data
            self.shard_reads = reads
            return dataclasses.replace(data, dataset=recording)
        if not isinstance(data.dataset, InMemoryImages):
            return data
        if split == "train":
            return dataclasses.replace(data, dataset=RecordedImages(data.dataset, self.record["batches"]))
        samples = data.dataset  # an evaluation split: (label, pixel sum) of each sample
        self.record["eval_sets"].append(list(zip(samples.labels.tolist(), samples.images.flatten(1).sum(1).tolist())))
        return data

    def micro_batch_loaded(self, progress, batch):
        # Shards are read a sample at a time, and Accelerate's loader reads the next micro-batch before it hands this
        # one over: this micro-batch's ids are the first len(batch) of those read and not yet handed over.
        if self.shard_reads is not None:
            size = len(batch[0])
            self.record["batches"].append(self.shard_reads[:size])
            del self.shard_reads[:size]

    def model_prepared(self, model):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        self.record["initial_weights"] = digests(getattr(model, "module", model).state_dict())
        if isinstance(model, DistributedDataParallel):
            def count(module, args):
                self.training_forwards += module.training

            def all_reduced(process_group, bucket):  # once per micro-step whose backward all-reduces
                if self.training_forwards not in self.record["allreduce_at"]:
                    self.record["allreduce_at"].append(self.training_forwards)
                return allreduce_hook(process_group, bucket)

            model.register_forward_pre_hook(count)
            model.register_comm_hook(None, all_reduced)
        from accel_train.training.dropout import KeyedDropout

        dropout = next((module for module in model.modules() if isinstance(module, (torch.nn.Dropout, KeyedDropout))),
                       None)
        if dropout is not None:
            # the process's stream at the layer: torch's masks are drawn from it (train.keyed_dropout=false, or dropout
            # a model draws in its forward), keyed ones are not
            def random_state(module, args):
                if module.training:
                    state = torch.cuda.get_rng_state() if args[0].is_cuda else torch.get_rng_state()
                    self.record["dropout"].append(hashlib.sha1(state.numpy().tobytes()).hexdigest())

            dropout.register_forward_pre_hook(random_state)

    def optimizer_stepped(self, progress, terms, skipped, lr):
        self.record["meter"].append([terms["loss"].item(), skipped.item()])
        self.record["step_lr"].append([progress.step, float(lr)])

    def checkpoint_saving(self, progress):
        self.record["saves"].append(progress.step)
