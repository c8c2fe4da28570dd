"""Who reads what: the positions of an epoch's order each process takes (Accelerate's batch splitting), and the
read plan of a whole job, on paper: for a manifest of any size, the bytes each node reads in an epoch against its
share, without a byte of data (`simulate`, what docs/data.md's scale figures come from)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from accel_train.data.shards.order import epoch_order


def process_positions(length: int, batch: int, processes: int, process: int) -> np.ndarray:
    """The positions in an order of `length` (whole batches of `batch`) that process `process` of `processes` takes:
    Accelerate's split_batches gives process r the r-th equal slice of every batch."""
    share = batch // processes
    return np.arange(length).reshape(-1, batch)[:, process * share:(process + 1) * share].reshape(-1)


@dataclass
class JobPlan:
    samples: int
    shards: int
    processes: int
    nodes: int
    global_batch: int
    streams: int
    plan_s: float  # seconds to compute one epoch's order and every node's reads
    share_bytes: float  # the set's bytes / nodes
    node_bytes: np.ndarray  # bytes each node reads in the epoch (whole blocks)
    batches: int

    @property
    def worst_ratio(self) -> float:
        return float(self.node_bytes.max() / self.share_bytes)


def simulate(samples: int = 1_281_167, shards: int = 1000, processes: int = 1024, nodes: int = 128,
             global_batch: int = 1024, streams: int = 1024, window_shards: int = 8, sample_bytes: int = 110_000,
             block_bytes: int = 4 * 2**20, seed: int = 0, epoch: int = 0) -> JobPlan:
    """One epoch of a job over a synthetic manifest (`samples` of `sample_bytes` each, in `shards` equal shards cut
    into blocks of about `block_bytes`): the order, and each node's bytes read (the blocks its processes touch)."""
    started = time.perf_counter()
    per_shard = -(-samples // shards)
    shard_of = np.minimum(np.arange(samples) // per_shard, shards - 1)
    per_block = max(1, block_bytes // sample_bytes)
    position_in_shard = np.arange(samples) - shard_of * per_shard
    block_of = shard_of * (-(-per_shard // per_block)) + position_in_shard // per_block
    order = epoch_order(shard_of, shards, seed, epoch, window_shards, streams, global_batch)
    # Processes are numbered node by node (torchrun's global rank), so a node's processes take one contiguous slice
    # of every global batch: its blocks are those of the columns it takes.
    by_node = block_of[order].reshape(-1, nodes, global_batch // nodes).transpose(1, 0, 2).reshape(nodes, -1)
    block_sizes = np.bincount(block_of) * sample_bytes
    node_bytes = np.array([block_sizes[np.unique(row)].sum() for row in by_node], dtype=np.float64)
    return JobPlan(samples, shards, processes, nodes, global_batch, streams, time.perf_counter() - started,
                   samples * sample_bytes / nodes, node_bytes, len(order) // global_batch)
