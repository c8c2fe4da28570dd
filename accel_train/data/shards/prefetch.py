"""Prefetching: the blocks this process reads next, fetched into the node's cache on background threads while the
current ones train. The plan follows from the epoch's order and Accelerate's batch splitting; the sampler says which
global batch the loader has reached."""

from __future__ import annotations

import queue
import threading
import weakref

import numpy as np

from accel_train.data.shards.dataset import under_subsets
from accel_train.data.shards.plan import process_positions

FETCHING_THREADS = 4  # parallel range reads: one stream of an object store rarely fills a node's bandwidth


def process_slice(loader) -> tuple[int, int, int]:
    """(the loader's batch, processes, this process's number) as Accelerate's prepared loader splits it (its
    BatchSamplerShard); an unprepared loader is one process's."""
    sampler, batch = loader.batch_sampler, loader.batch_size
    while sampler is not None and not hasattr(sampler, "process_index"):
        batch = getattr(sampler, "batch_size", None) or batch
        sampler = getattr(sampler, "batch_sampler", None)
    if sampler is None:
        return batch, 1, 0
    return sampler.batch_size, sampler.num_processes, sampler.process_index


class Prefetcher:
    """Keeps up to `ahead_bytes` of the blocks this process will read next in the node's cache."""

    def __init__(self, dataset, ahead_bytes: int) -> None:
        base, indices = under_subsets(dataset)  # the shards (ShardSamples) under data.train_subset's Subset
        self.cache, self.split, self.shards = base.cache, base.split, base.index.shards
        sample_block, self.blocks = [], []  # each sample's block number (over all shards); each block's (shard, block)
        for number, shard in enumerate(self.shards):
            sample_block.append(len(self.blocks) + shard.block_of(np.arange(shard.samples)))
            self.blocks.extend((number, block) for block in range(len(shard.blocks)))
        block_of_sample = np.concatenate(sample_block)
        self.block_of_index = block_of_sample if indices is None else block_of_sample[indices]
        self.block_bytes = np.array([self._span(shard, block) for shard, block in self.blocks])
        self.ahead_bytes = ahead_bytes
        self._plan: tuple[np.ndarray, np.ndarray] = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        self._step, self._next, self._generation = 0, 0, 0
        self._wake = threading.Condition()
        self._jobs: queue.Queue = queue.Queue(maxsize=FETCHING_THREADS)
        self._started = False

    def _span(self, shard: int, block: int) -> int:
        start, end = self.shards[shard].block_span(block)
        return end - start

    def follow(self, loader, order: np.ndarray, global_batch: int) -> None:
        """Plan the epoch `order` (a whole number of global batches) for this process of `loader`."""
        positions = process_positions(len(order), *process_slice(loader))
        blocks = self.block_of_index[order[positions]]
        unique, first = np.unique(blocks, return_index=True)
        by_first_use = np.argsort(first)
        with self._wake:
            self._plan = unique[by_first_use], positions[first[by_first_use]] // global_batch
            self._step, self._next, self._generation = 0, 0, self._generation + 1
            self._wake.notify_all()

    def reached(self, epoch: int, step: int) -> None:
        """The loader is forming global batch `step` (the sampler's call). The threads start at the first one: the
        DataLoader's workers are forked by then, not while these threads hold a lock."""
        if not self._started:
            self._started = True
            # The threads hold the prefetcher weakly and end once it is gone: a script that trains several runs
            # (the Python API) keeps no idle threads, nor the blocks' plan, of the runs before.
            this, jobs = weakref.ref(self), self._jobs
            for _ in range(FETCHING_THREADS):
                threading.Thread(target=_fetching, args=(this, jobs), daemon=True,
                                 name="accel-train shard fetch").start()
            threading.Thread(target=_planning, args=(this, jobs), daemon=True,
                             name="accel-train shard prefetch").start()
        with self._wake:
            self._step = step
            self._wake.notify_all()

    def _next_job(self) -> tuple[int, int] | None:
        """The next block to fetch (its generation, its number), or None after a second with nothing to do."""
        with self._wake:
            blocks, steps = self._plan
            current = int(np.searchsorted(steps, self._step))  # blocks first used before now: fetched on demand
            self._next = max(self._next, current)
            ahead = self.block_bytes[blocks[current:self._next]].sum() if self._next > current else 0
            if self._next >= len(blocks) or ahead >= self.ahead_bytes:
                self._wake.wait(timeout=1.0)
                return None
            job = self._generation, int(blocks[self._next])
            self._next += 1
            return job

    def _fetch(self, generation: int, block: int) -> None:
        if generation != self._generation:
            return  # planned for an epoch the loader has left
        shard, number = self.blocks[block]
        try:
            self.cache.fetch(self.shards[shard], self.split, number)
        except Exception:  # noqa: BLE001  the reader that needs this block meets the error and reports it
            pass


def _planning(prefetcher: weakref.ref, jobs: queue.Queue) -> None:
    while (alive := prefetcher()) is not None:
        job = alive._next_job()
        del alive  # not held while waiting for room in the queue
        if job is not None:
            while prefetcher() is not None:
                try:
                    jobs.put(job, timeout=1.0)
                    break
                except queue.Full:
                    continue


def _fetching(prefetcher: weakref.ref, jobs: queue.Queue) -> None:
    while True:
        try:
            job = jobs.get(timeout=1.0)
        except queue.Empty:
            job = None
        alive = prefetcher()
        if alive is None:
            return
        if job is not None:
            alive._fetch(*job)
        del alive
