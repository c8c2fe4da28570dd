"""Contracts of the shard format (data/shards/format.py), of where bytes live (storage.py) and of a node's block cache
(data/shards/cache.py): tars of webdataset's and ours read each other's way and each sample comes back from its own
byte span; a store reads ranges, survives transient faults with one warning line, and answers what no retry fixes
in one line before reading anything; the cache downloads a block once per node, serves it again without the store,
stays under its bound, and never serves a shard rewritten at the same URL from the old bytes.

The store is the `object_store` fixture (moto's S3 server and a counting, fault-injecting proxy, threads of this
process). A block whose bytes differ from its index: tests/data/test_shard_blocks_are_checked_before_use.py."""

import hashlib
import importlib.util
import io
import json
import threading
import time

import numpy as np
import pytest
import webdataset as wds

from accel_train import cli, storage
from accel_train.config import DataConfig
from accel_train.data import build_dataset
from accel_train.data.shards.cache import BlockCache
from accel_train.data.shards.format import SplitIndex, index_tar, sample_members, tar_of
from accel_train.errors import UserError
from accel_train.storage import Store, StoreUnavailable, check_location

BUCKET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def samples_of(count: int, seed: int = 0, keys: str = "{:06d}") -> list[tuple[str, dict[str, bytes]]]:
    """`count` samples of 300 to 3000 bytes of noise as "png" (nothing here decodes it) with a label as "cls"."""
    rng = np.random.default_rng(seed)
    return [(keys.format(index), {"png": rng.bytes(int(rng.integers(300, 3000))), "cls": str(index % 7).encode()})
            for index in range(count)]


def shard_in_store(object_store, samples, block_bytes=16384, name="shard-000000.tar"):
    """`samples` as one tar at set/train/NAME in the store, and its entry in an index."""
    data = tar_of(samples)
    object_store.fs().pipe_file(f"{object_store.bucket}/set/train/{name}", data)
    return index_tar(name, data, block_bytes)[0]


def blocks_in(folder) -> list:
    return [path for path in folder.rglob("blocks/*/*") if not path.name.startswith(".")]


# The format


def test_a_tar_written_by_webdatasets_tarwriter_is_indexed_so_each_sample_comes_back_from_its_byte_span_alone():
    rng = np.random.default_rng(1)
    written = [{"__key__": f"{'photos/' if index % 2 else ''}{index:04d}", "png": rng.bytes(int(rng.integers(1, 5000))),
                "cls": index % 5, "json": {"label": index % 5, "index": index}} for index in range(50)]
    buffer = io.BytesIO()
    with wds.TarWriter(buffer) as writer:
        for sample in written:
            writer.write(sample)
    data = buffer.getvalue()

    shard, labels = index_tar("theirs.tar", data, block_bytes=8192)

    assert shard.samples == 50 and labels == [index % 5 for index in range(50)]
    assert shard.sha256 == hashlib.sha256(data).hexdigest() and shard.bytes == len(data)
    for position, sample in enumerate(written):
        start, end = shard.sample_span(position)
        members = sample_members(data[start:end])  # these bytes alone, as a ranged read brings them
        assert members == {"png": sample["png"], "cls": str(sample["cls"]).encode(),
                           "json": json.dumps(sample["json"]).encode()}


def test_webdatasets_own_reader_reads_our_tars_with_the_same_keys_extensions_and_bytes(tmp_path):
    ours = samples_of(30)
    for index, (_, members) in enumerate(ours):
        if index % 3 == 0:
            members["json"] = json.dumps({"label": index}).encode()
    (tmp_path / "shard-000000.tar").write_bytes(tar_of(ours))

    read = list(wds.WebDataset(str(tmp_path / "shard-000000.tar"), shardshuffle=False, empty_check=False))

    assert [sample["__key__"] for sample in read] == [key for key, _ in ours]
    for sample, (_, members) in zip(read, ours):
        assert {extension: value for extension, value in sample.items() if not extension.startswith("__")} == members


def test_an_index_round_trips_through_its_json_whose_sha256_is_the_index_hash():
    data = tar_of(samples_of(40))
    shard, labels = index_tar("shard-000000.tar", data, block_bytes=4096)
    index = SplitIndex("train", [shard, index_tar("shard-000001.tar", tar_of(samples_of(3, seed=2)))[0]],
                       classes=[f"class {label}" for label in range(7)], num_classes=7, channels=1, image_size=28,
                       mean=[0.5], std=[0.25], transforms="in_memory", source="fashion_mnist", block_bytes=4096,
                       settings={"source": "fashion_mnist", "shard_mb": 0.5})

    text = index.to_json()
    again = SplitIndex.from_json(text)

    assert again == index and again.to_json() == text
    assert again.hash == hashlib.sha256(text).hexdigest()
    assert again.samples == 43 and list(again.shard_starts()) == [0, 40, 43]
    with pytest.raises(ValueError, match="format 'accel-train shards 0', not 'accel-train shards 1'"):
        SplitIndex.from_json(text.replace(b'"format":"accel-train shards 1"', b'"format":"accel-train shards 0"'))


def test_blocks_are_runs_of_whole_samples_of_about_block_bytes_covering_every_sample_once_each_with_its_sha256():
    samples = samples_of(80)
    data = tar_of(samples)
    block_bytes = 8192
    shard, _ = index_tar("shard-000000.tar", data, block_bytes)

    assert len(shard.blocks) > 5
    spans = [shard.block_span(block) for block in range(len(shard.blocks))]
    assert spans[0][0] == shard.offsets[0] == 0 and spans[-1][1] == shard.end
    assert all(end == start for (_, end), (start, _) in zip(spans, spans[1:])), "the blocks tile the samples' bytes"
    assert set(data[shard.end:]) == {0}, "after the last block: only the tar's end-of-archive zeros"
    largest = max(shard.sample_span(position)[1] - shard.sample_span(position)[0] for position in range(80))
    held = [0] * len(shard.blocks)
    for position in range(80):
        block = shard.block_of(position)
        (start, end), (block_start, block_end) = shard.sample_span(position), spans[block]
        assert block_start <= start < end <= block_end
        held[block] += 1
    assert sum(held) == 80 and all(held)
    for (start, end), (_, sha256) in zip(spans, shard.blocks):
        assert hashlib.sha256(data[start:end]).hexdigest() == sha256
        assert end - start < block_bytes + largest


# The store


@pytest.mark.parametrize("where", ["folder", pytest.param("s3", marks=pytest.mark.store)])  # its store by name
def test_a_store_reads_ranges_writes_lists_and_removes_alike_at_a_folder_and_at_an_s3_url(where, tmp_path, request):
    object_store = request.getfixturevalue("object_store") if where == "s3" else None
    store = Store(object_store.url("set") if object_store else str(tmp_path / "set"))
    data = np.random.default_rng(0).bytes(100_000)

    store.write("train/shard-000000.tar", data)
    store.write("train/index.json", b"{}")
    if object_store:
        object_store.proxy.reset_counts()

    assert store.read("train/shard-000000.tar", 40_000, 41_000) == data[40_000:41_000]
    if object_store:  # a ranged read brings its range, not the object
        assert object_store.proxy.bytes_read(object_store.url("set/")) == 1000
    assert store.read("train/shard-000000.tar") == data
    assert store.size("train/shard-000000.tar") == len(data) and store.exists("train/index.json")
    assert store.names("train") == ["index.json", "shard-000000.tar"] and store.names("test") == []
    store.remove("train/index.json")
    assert store.names("train") == ["shard-000000.tar"] and not store.exists("train/index.json")
    with pytest.raises(FileNotFoundError):
        store.read("train/index.json")


@pytest.mark.parametrize("fault, times", [("503", 6), ("reset", 6), ("truncate", 5)])
def test_transient_faults_past_the_clients_own_retries_are_survived_with_the_exact_bytes_and_one_warning_line(
        object_store, fault, times, capsys):
    storage._warned.clear()  # the warning is said once per process: this test's own, whatever ran before it
    data = np.random.default_rng(0).bytes(50_000)
    object_store.fs().pipe_file(f"{object_store.bucket}/set/train/shard-000000.tar", data)
    store = Store(object_store.url("set"), patience_s=30)
    object_store.proxy.inject(fault, times=times, match=lambda method, path: method == "GET")

    assert store.read("train/shard-000000.tar", 1000, 41_000) == data[1000:41_000]

    assert object_store.proxy.faults_applied(fault) == times
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"accel-train: warning: {object_store.url('set/train/shard-000000.tar')}: "), lines
    assert lines[0].endswith("; retrying for up to 30 s")


def train_from(root: str, tmp_path, *overrides: str) -> tuple[int, float]:
    """`accel-train train fashion_mnist_cnn data.name=shards data.root=ROOT` in this process: its exit code and the
    seconds it took."""
    started = time.monotonic()
    with pytest.raises(SystemExit) as exited:
        cli.main(["train", "fashion_mnist_cnn", "data.name=shards", f"data.root={root}",
                  f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}", *overrides])
    return exited.value.code, time.monotonic() - started


def test_a_store_that_is_down_stops_the_read_of_the_shards_within_its_patience_in_one_line_exit_3(object_store,
                                                                                                tmp_path):
    storage._warned.clear()
    data = DataConfig(name="shards", root=object_store.url("set"), store_patience_s=1, cache_dir=str(tmp_path))
    with object_store.down():
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as stopped:
            build_dataset(data, train=True)
        took = time.monotonic() - started
    line = str(stopped.value)
    assert stopped.value.exit_code == 3 and "\n" not in line
    assert line.startswith(f"cannot read {object_store.url('set/train/index.json')}: ")
    assert "check that the store is reachable from this machine" in line and line.endswith("with resume=auto")
    # data.store_patience_s counts from the first failure: the first attempt before it and the last one after it, each
    # the client's own 2 tries (botocore's standard mode: a backoff of up to 2 s between them), may add 2.5 s each.
    assert took < 1 + 6, f"{took:.1f} s"


@pytest.mark.parametrize("problem", ["no credentials", "an unknown bucket"])
def test_missing_credentials_or_an_unknown_bucket_stop_a_run_in_one_line_before_anything_is_read(
        problem, object_store, tmp_path, monkeypatch, capsys):
    root = object_store.url("set")
    if problem == "no credentials":  # nor any file or service to find them in (the fixture's environment)
        for name in BUCKET_KEYS:
            monkeypatch.delenv(name)
        said = f"no credentials to read {root}/train/index.json: set the storage's own environment"
    else:
        root = "s3://no-such-bucket/set"
        said = f"{root}/train/index.json: The specified bucket does not exist; check the bucket's name"

    code, _ = train_from(root, tmp_path, "data.store_patience_s=30")

    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"accel-train: error: {said}"), lines
    # Not retried: nothing reached the store, or the requests that found no bucket (the object's, then its folder's).
    statuses = [request.status for request in object_store.proxy.requests]
    assert statuses == ([] if problem == "no credentials" else [404, 404])
    assert object_store.proxy.bytes_read() == 0


def test_credentials_inside_a_url_are_refused_without_repeating_them_and_a_missing_library_names_its_extra(
        tmp_path, capsys):
    code, _ = train_from("s3://AKIAEXAMPLE:wJalrXUtnFEMIK7MDENG@bucket/shards", tmp_path, "data.store_patience_s=1")
    stderr = capsys.readouterr().err
    assert code == 2 and stderr.splitlines() == [
        "accel-train: error: data.root: credentials inside the URL would be recorded in config.yaml; give them "
        "through the storage's own environment (for s3://, AWS_PROFILE or AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY) and write s3://bucket/shards"]
    assert not [path for path in tmp_path.rglob("*") if path.is_file() and b"wJalr" in path.read_bytes()]

    for url, library, extra in (("gs://bucket/shards", "gcsfs", "gcs"), ("az://container/shards", "adlfs", "azure")):
        if importlib.util.find_spec(library) is not None:
            continue  # installed here: nothing to name
        with pytest.raises(UserError) as refused:
            check_location(url, "data.root")
        assert str(refused.value) == (f"data.root={url}: reading {url[:url.index('/') + 2]} needs its storage "
                                      f"library: pip install 'accel-train[{extra}]'")


# The node's block cache


def test_two_readers_of_the_same_blocks_on_one_node_download_each_block_once(object_store, tmp_path):
    samples = samples_of(60)
    shard = shard_in_store(object_store, samples)
    start = threading.Barrier(2)
    read, downloaded = {}, {}

    def reader(name):  # a process of its own would do the same: its own store client, its own cache object
        cache = BlockCache(Store(object_store.url("set")), tmp_path / "cache", 10**9)
        start.wait()
        read[name] = [sample_members(cache.read_sample(shard, "train", position)) for position in range(60)]
        downloaded[name] = cache.downloaded

    threads = [threading.Thread(target=reader, args=(name,)) for name in ("first", "second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert read["first"] == read["second"] == [members for _, members in samples]
    assert len(shard.blocks) > 5
    assert object_store.proxy.bytes_read_by_object() == {f"{object_store.bucket}/set/train/shard-000000.tar":
                                                         shard.end}, "every block once, and only the blocks"
    assert downloaded["first"] + downloaded["second"] == shard.end


def test_a_second_pass_over_cached_blocks_reads_nothing_from_the_store(object_store, tmp_path):
    samples = samples_of(60)
    shard = shard_in_store(object_store, samples)
    first = BlockCache(Store(object_store.url("set")), tmp_path / "cache", 10**9)
    assert [sample_members(first.read_sample(shard, "train", p)) for p in range(60)] == [m for _, m in samples]
    object_store.proxy.reset_counts()

    again = BlockCache(Store(object_store.url("set")), tmp_path / "cache", 10**9)  # another process of the node
    assert [sample_members(again.read_sample(shard, "train", p)) for p in range(60)] == [m for _, m in samples]

    assert object_store.proxy.requests == [] and again.downloaded == 0


def test_a_cache_bound_below_the_blocks_read_still_serves_every_sample_and_keeps_the_folder_under_it(object_store,
                                                                                                     tmp_path):
    samples = samples_of(200)
    shard = shard_in_store(object_store, samples)
    spans = [shard.block_span(block) for block in range(len(shard.blocks))]
    largest = max(end - start for start, end in spans)
    bound = 3 * largest
    assert shard.end > 10 * bound
    cache = BlockCache(Store(object_store.url("set")), tmp_path / "cache", bound)

    for position in [*range(200), *reversed(range(200))]:
        assert sample_members(cache.read_sample(shard, "train", position)) == samples[position][1]
        held = sum(path.stat().st_size for path in blocks_in(tmp_path / "cache"))
        assert held <= bound + largest, f"{held} bytes cached after sample {position}; the bound is {bound}"
    assert cache.downloaded > shard.end, "evicted blocks were downloaded again when read again"


def test_a_shard_rewritten_at_the_same_url_with_a_new_index_is_never_served_from_the_old_blocks(object_store,
                                                                                             tmp_path):
    before = samples_of(60, seed=1)
    old = shard_in_store(object_store, before)
    cache = BlockCache(Store(object_store.url("set")), tmp_path / "cache", 10**9)
    assert [sample_members(cache.read_sample(old, "train", p)) for p in range(60)] == [m for _, m in before]

    # The same keys and sizes, other bytes: every sample's span and every block's span are the old ones.
    rng = np.random.default_rng(2)
    after = [(key, {"png": rng.bytes(len(members["png"])), "cls": members["cls"]}) for key, members in before]
    new = shard_in_store(object_store, after)
    assert new.offsets == old.offsets and [first for first, _ in new.blocks] == [first for first, _ in old.blocks]

    again = BlockCache(Store(object_store.url("set")), tmp_path / "cache", 10**9)
    assert [sample_members(again.read_sample(new, "train", p)) for p in range(60)] == [m for _, m in after]
    assert again.downloaded == new.end
