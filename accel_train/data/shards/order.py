"""The order of an epoch over shards: a function of (seed, epoch) and the run's settings, never of the world size,
the DataLoader workers or an interruption; each global batch drawn from a few shards at a time.

Each epoch the shards are permuted and their samples laid end to end; that sequence is cut into `streams` equal
parts, and each part shuffled within consecutive windows of `window_shards` shards' worth of samples. Global batch k
takes `batch / streams` samples from each stream in turn, stream 0's first. Accelerate's batch splitting gives
process r the r-th equal slice of a global batch: with `streams` a multiple of the processes, a process reads one
stream, a contiguous run of the epoch's shards, and a node only the shards of its processes' streams.
"""

from __future__ import annotations

import numpy as np
from torch.utils.data import Sampler

from accel_train.errors import UserError

_ORDER_TAG = 0x5348_4152  # "SHAR": this generator's stream differs from any other drawn from the same seed


def check_order_settings(global_batch: int, streams: int, samples: int) -> None:
    if global_batch % streams:
        raise UserError(f"data.streams={streams} must divide train.batch_size={global_batch}: each global batch takes "
                        "the same number of samples from every stream")
    if samples // streams < global_batch // streams:
        raise UserError(f"data.streams={streams}: each stream of {samples} training samples would hold fewer than one "
                        f"batch's share ({global_batch // streams}); lower data.streams or train.batch_size")


def epoch_order(shard_of: np.ndarray, shards: int, seed: int, epoch: int, window_shards: int, streams: int,
                global_batch: int) -> np.ndarray:
    """The indices of one epoch's samples, global batch after global batch (len: a whole number of batches).

    `shard_of[i]` is the shard of the dataset's sample i (sample ids ascend through each shard). Samples left over
    (fewer than a batch per stream, or the last `len % streams`) are not trained this epoch, as drop_last drops
    the last batch; another epoch's permutation leaves out others.
    """
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, _ORDER_TAG])))
    rank_of_shard = np.empty(shards, dtype=np.int64)
    rank_of_shard[rng.permutation(shards)] = np.arange(shards)
    sequence = np.argsort(rank_of_shard[shard_of], kind="stable")  # the permuted shards end to end
    per_stream, per_batch = len(sequence) // streams, global_batch // streams
    batches = per_stream // per_batch
    lanes = sequence[:streams * per_stream].reshape(streams, per_stream)
    window = window_shards * -(-len(shard_of) // shards)  # samples in window_shards shards of the mean size
    # Shuffle within each window: sort by (window, a random key); windows start at each stream's beginning.
    keys = rng.random((streams, per_stream)) + (np.arange(per_stream) // window)[None, :]
    lanes = np.take_along_axis(lanes, np.argsort(keys, axis=1, kind="stable"), axis=1)
    return lanes[:, :batches * per_batch].reshape(streams, batches, per_batch).transpose(1, 0, 2).reshape(-1)


class ShardOrder(Sampler[int]):
    """The training loader's sampler over shards: epoch_order for the epoch Accelerate's set_epoch names. As its
    global batches are pulled, it tells `on_batch(epoch, k)` (the prefetcher follows the run this way)."""

    def __init__(self, shard_of: np.ndarray, shards: int, seed: int, window_shards: int, streams: int,
                 global_batch: int, on_batch=None) -> None:
        self.shard_of, self.shards, self.seed = np.asarray(shard_of), shards, seed
        self.window_shards, self.streams, self.global_batch = window_shards, streams, global_batch
        self.on_batch = on_batch
        self.epoch = 0
        self._cached: tuple[int, np.ndarray] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int | None = None) -> np.ndarray:
        epoch = self.epoch if epoch is None else epoch
        if self._cached is None or self._cached[0] != epoch:
            self._cached = epoch, epoch_order(self.shard_of, self.shards, self.seed, epoch, self.window_shards,
                                              self.streams, self.global_batch)
        return self._cached[1]

    def __len__(self) -> int:
        per_batch = self.global_batch // self.streams
        return (len(self.shard_of) // self.streams // per_batch) * self.global_batch

    def __iter__(self):
        epoch, order, size = self.epoch, self.order(), self.global_batch
        for batch in range(len(order) // size):
            if self.on_batch is not None:
                self.on_batch(epoch, batch)
            yield from order[batch * size:(batch + 1) * size].tolist()
