"""Contracts of the order over shards (data/shards/order.py) and of who reads what (data/shards/plan.py): an epoch's
order is a function of (seed, epoch) and the run's order settings alone, made of whole global batches of distinct
samples, each drawn from a few shards; with `streams`, a process whose slice covers whole streams reads only their
shards; every process takes the slice of each global batch that Accelerate's batch splitting gives it, so the global
batches are the same at any world size; and the read plan of an ImageNet-sized job at 1024 processes on 128 nodes
keeps each node near its share of the bytes.

Pure arithmetic on sample ids: no data is read and no process started."""

import numpy as np
import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, prepare_data_loader
from torch.utils.data import BatchSampler, DataLoader, Dataset

from accel_train.config import load_config
from accel_train.data.shards.order import ShardOrder, check_order_settings, epoch_order
from accel_train.data.shards.plan import process_positions, simulate
from accel_train.data.shards.prefetch import process_slice
from accel_train.errors import UserError

# 40 shards of 25 samples: a window of 2 shards is 50 samples, and 4 streams of 250 samples hold 10 whole shards each.
SHARDS, PER_SHARD = 40, 25
SHARD_OF = np.repeat(np.arange(SHARDS), PER_SHARD)


def order_of(seed=0, epoch=0, window_shards=2, streams=1, global_batch=20, shard_of=SHARD_OF):
    return epoch_order(shard_of, int(shard_of.max()) + 1, seed, epoch, window_shards, streams, global_batch)


def shard_sets(order: np.ndarray, size: int) -> list[set]:
    """The shards of each run of `size` consecutive positions of `order`."""
    return [set(SHARD_OF[order[start:start + size]].tolist()) for start in range(0, len(order), size)]


# The order of an epoch


def test_the_same_seed_and_epoch_give_the_same_order_and_another_epoch_or_seed_permutes_the_shards_anew():
    order = order_of(seed=3, epoch=1)
    assert np.array_equal(order, order_of(seed=3, epoch=1))
    sampler = ShardOrder(SHARD_OF, SHARDS, seed=3, window_shards=2, streams=1, global_batch=20)  # a new instance
    sampler.set_epoch(1)
    assert list(sampler) == order.tolist() and len(sampler) == len(order)

    windows = shard_sets(order, 2 * PER_SHARD)  # the shards each window of 2 shards' samples holds, in order
    in_file_order = [{2 * k, 2 * k + 1} for k in range(SHARDS // 2)]
    assert windows != in_file_order, "the shards are permuted"
    for other in (order_of(seed=3, epoch=2), order_of(seed=4, epoch=1)):
        assert not np.array_equal(other, order)
        assert shard_sets(other, 2 * PER_SHARD) != windows, "each epoch (and each seed) permutes the shards anew"


@pytest.mark.parametrize("streams", [1, 2, 4])
def test_every_epoch_is_whole_global_batches_of_distinct_samples_leaving_out_less_than_a_batch(streams):
    # Shards of uneven sizes (10 to 40 samples), 24 samples a global batch: batches rarely end where shards do.
    sizes = np.random.default_rng(0).integers(10, 41, 37)
    shard_of = np.repeat(np.arange(37), sizes)
    for epoch in range(3):
        order = order_of(epoch=epoch, window_shards=3, streams=streams, global_batch=24, shard_of=shard_of)
        assert len(order) % 24 == 0 and len(order) == len(ShardOrder(shard_of, 37, 0, 3, streams, 24))
        assert len(set(order.tolist())) == len(order), "no sample twice in an epoch"
        assert order.min() >= 0 and order.max() < len(shard_of)
        left_out = len(shard_of) - len(order)
        assert 0 <= left_out < 24 + streams, "only the remainder of a batch per stream is left out"

    whole = order_of(global_batch=20)  # 1000 samples, 50 batches of 20: nothing left out
    assert sorted(whole.tolist()) == list(range(SHARDS * PER_SHARD))


@pytest.mark.parametrize("window_shards", [1, 2, 4])
def test_a_global_batch_draws_from_a_window_of_shards_in_which_the_samples_are_shuffled(window_shards):
    window = window_shards * PER_SHARD
    for epoch in range(3):
        order = order_of(epoch=epoch, window_shards=window_shards, global_batch=20)
        # Each window of the sequence holds exactly `window_shards` shards, whole, in a shuffled order ...
        for start in range(0, len(order), window):
            samples = order[start:start + window]
            assert len(set(SHARD_OF[samples].tolist())) == window_shards
            assert sorted(samples.tolist()) == sorted(np.flatnonzero(np.isin(SHARD_OF, SHARD_OF[samples])).tolist())
        assert sum(not np.array_equal(order[start:start + window], np.sort(order[start:start + window]))
                   for start in range(0, len(order), window)) >= len(order) // window - 1, "shuffled within windows"
        # ... so a global batch, which may straddle two windows, draws from at most twice that many shards.
        assert max(len(shards) for shards in shard_sets(order, 20)) <= 2 * window_shards


def test_with_streams_each_global_batch_takes_an_equal_part_of_every_stream_and_a_process_reads_only_its_streams():
    streams, batch = 4, 20  # 5 samples of each stream in every global batch; each stream 250 samples, 10 shards
    order = order_of(streams=streams, global_batch=batch, epoch=1)
    parts = order.reshape(-1, streams, batch // streams)  # (global batch, stream, samples)
    stream_shards = [set(SHARD_OF[parts[:, stream]].ravel().tolist()) for stream in range(streams)]
    assert [len(shards) for shards in stream_shards] == [SHARDS // streams] * streams
    assert set().union(*stream_shards) == set(range(SHARDS)), "the streams are disjoint runs of the epoch's shards"
    for stream in range(streams):  # each stream walks through its shards a window (2 shards) at a time
        assert all(len(shards) == 2 for shards in shard_sets(parts[:, stream].ravel(), 2 * PER_SHARD))

    for processes in (2, 4):  # each process's slice of every global batch covers whole streams
        per_process = streams // processes
        for process in range(processes):
            read = set(SHARD_OF[order[process_positions(len(order), batch, processes, process)]].tolist())
            assert read == set().union(*stream_shards[process * per_process:(process + 1) * per_process])


class SampleIds(Dataset):
    def __len__(self):
        return len(SHARD_OF)

    def __getitem__(self, index):
        return index


@pytest.mark.parametrize("processes", [1, 2, 3])
def test_each_process_takes_the_positions_accelerates_batch_splitting_gives_it_so_the_global_batches_are_the_same(
        processes):
    sampler = ShardOrder(SHARD_OF, SHARDS, seed=5, window_shards=2, streams=2, global_batch=24)
    sampler.set_epoch(2)
    order = sampler.order()
    global_batches = order.reshape(-1, 24)
    slices = []
    for process in range(processes):
        # Accelerate's own splitting of torch's BatchSampler, as the prepared training loader does it
        shard = BatchSamplerShard(BatchSampler(sampler, 24, drop_last=True), processes, process, split_batches=True)
        taken = np.array([index for batch in shard for index in batch])
        positions = process_positions(len(order), 24, processes, process)
        assert np.array_equal(order[positions], taken)
        # The prefetcher reads (batch, processes, process) off the prepared loader: the same positions again.
        loader = prepare_data_loader(DataLoader(SampleIds(), sampler=sampler, batch_size=24, drop_last=True),
                                     num_processes=processes, process_index=process, split_batches=True,
                                     put_on_device=False)
        loader.set_epoch(2)  # as the loop starts each epoch (the prepared loader hands it to the sampler)
        loaded = torch.cat(list(loader)).numpy()
        assert np.array_equal(order[process_positions(len(order), *process_slice(loader))], loaded)
        slices.append(taken.reshape(len(global_batches), -1))
    assert np.array_equal(np.concatenate(slices, axis=1), global_batches), "together: the same global batches"


def test_order_settings_that_cannot_make_equal_parts_or_order_other_data_are_refused_in_one_line(tmp_path):
    check_order_settings(global_batch=24, streams=4, samples=1000)
    with pytest.raises(UserError, match=r"^data.streams=5 must divide train.batch_size=24: ") as refused:
        check_order_settings(global_batch=24, streams=5, samples=1000)
    with pytest.raises(UserError, match=r"^data.streams=8: each stream of 40 training samples would hold fewer than "
                                        r"one batch's share \(8\); lower data.streams or train.batch_size$"):
        check_order_settings(global_batch=64, streams=8, samples=40)
    assert "\n" not in str(refused.value)
    for override in ("data.streams=2", "data.shuffle_window_shards=4"):
        with pytest.raises(UserError, match=rf"^{override.split('=')[0]} order data.name=shards; "
                                            r"data.name=fashion_mnist is ordered by Accelerate's seedable sampler"):
            load_config("fashion_mnist_cnn", [override, f"data.root={tmp_path}"])


# The read plan of a job, on paper


def manifest_blocks(samples=1_281_167, shards=1000, sample_bytes=110_000, block_bytes=4 * 2**20):
    """simulate()'s manifest at its defaults, as its docstring describes it: samples of `sample_bytes` in equal
    shards, each cut into blocks of whole samples of about `block_bytes`: each sample's shard and block, and each
    block's bytes."""
    per_shard = -(-samples // shards)
    shard_of = np.minimum(np.arange(samples) // per_shard, shards - 1)
    per_block = block_bytes // sample_bytes
    block_of = shard_of * -(-per_shard // per_block) + (np.arange(samples) - shard_of * per_shard) // per_block
    return shard_of, block_of, np.bincount(block_of) * sample_bytes


def test_a_1024_process_job_on_128_nodes_trains_the_global_batches_of_2_processes_each_node_reading_its_share():
    # ImageNet-sized: 1.28M samples in 1000 shards, global batch 1024, streams=1024 (one stream a process)
    plan = simulate()
    print(f"plan_s {plan.plan_s:.2f} for {plan.batches} global batches at 1024 processes on 128 nodes")
    assert (plan.processes, plan.nodes, plan.streams, plan.global_batch) == (1024, 128, 1024, 1024)
    shard_of, block_of, block_bytes = manifest_blocks()
    order = epoch_order(shard_of, 1000, seed=0, epoch=0, window_shards=8, streams=1024, global_batch=1024)
    global_batches = order.reshape(-1, 1024)
    assert len(global_batches) == plan.batches == simulate(processes=2, nodes=2).batches

    for processes in (2, 1024):  # the union of the processes' slices of each global batch is that batch
        slices = np.stack([order[process_positions(len(order), 1024, processes, process)].reshape(plan.batches, -1)
                           for process in range(processes)], axis=1)  # (global batch, process, samples)
        assert np.array_equal(slices.reshape(plan.batches, 1024), global_batches)

    # The node of 8 processes (numbered node by node) reads the blocks of its processes' samples: the plan's bytes.
    by_node = slices.reshape(plan.batches, 128, 8).transpose(1, 0, 2).reshape(128, -1)
    node_bytes = np.array([block_bytes[np.unique(block_of[samples])].sum() for samples in by_node])
    assert np.array_equal(node_bytes, plan.node_bytes)
    assert plan.worst_ratio <= 1.1, f"a node reads {plan.worst_ratio:.2f}x its share of the bytes"

    # Without streams, every node reads nearly every shard's blocks in every window: the locality is the streams'.
    assert simulate(streams=1).worst_ratio > 10
