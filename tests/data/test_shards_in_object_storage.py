"""Contracts of data in object storage (data.name=shards), end to end against an S3 store: moto behind the counting,
fault-injecting proxy of support/object_store.py, one store for the module (module_object_store), which launched
processes reach through AWS_ENDPOINT_URL.

The node's block cache (a second epoch reads nothing from the store; processes of one node download each block
once; a bound smaller than the set trains alike), the store's failures (transient ones survived with identical
results; a shard changed after its index, or a store that stays down, stopped in one line with exit 3), tars
written by webdataset (and the tars accel-train writes, read by webdataset), and a run trained from shards of an
ImageFolder tree evaluated and predicted from that tree.

Fashion-MNIST's first 240 training and 100 test images are written once, in about 12 shards of about 20 samples in
blocks of about 4; a run is 2 epochs of 5 steps at 1 process, each with a cache folder of its own.
"""

import collections
import io
import re
import time

import numpy as np
import pytest
from PIL import Image

from accel_train import hooks
from accel_train.data.shards.format import SplitIndex
from support.commands import PYTHON, last_json_line, launch, run_cli, start, train_in_process
from support.locations import needs_fashion_mnist
from support.runs import assert_same_run, read_metrics

pytestmark = needs_fashion_mnist

TRAIN, TEST, BATCH = 240, 100, 48
RUN = ["fashion_mnist_cnn", "data.name=shards", "data.num_workers=0", f"train.batch_size={BATCH}", "train.epochs=2",
       "train.log_every_steps=1", "train.plot=false"]
TARS = ("/train/shard-", "/test/shard-")


@pytest.fixture(scope="module")
def fashion_mnist(tmp_path_factory):
    """The training and test splits of Fashion-MNIST (in memory: uint8 images, labels), as the recipe loads them."""
    from accel_train.config import load_config
    from accel_train.data import build_dataset

    cfg = load_config("fashion_mnist_cnn", [f"data.root={tmp_path_factory.mktemp('fashion_mnist')}"]).data
    return cfg, {split: build_dataset(cfg, train=split == "train").dataset for split in ("train", "test")}


@pytest.fixture(scope="module")
def shards(module_object_store, fashion_mnist):
    """The store and the URL of Fashion-MNIST's first 240 training and 100 test images written there as shards."""
    import dataclasses

    from accel_train.data.shards.writer import write_shards

    url = module_object_store.url("fashion_mnist")
    cfg = dataclasses.replace(fashion_mnist[0], train_subset=TRAIN, eval_subset=TEST)
    write_shards(cfg, url, shard_mb=0.045, block_mb=0.01, recipe="fashion_mnist_cnn")
    return module_object_store, url


@pytest.fixture
def store(shards):
    """The module's store and the shards' URL; a fault this test left is cleared after it. A test that counts resets
    the counts right before the run it counts (a module fixture set up for it may have read meanwhile)."""
    shared, url = shards
    yield shared, url
    shared.proxy.clear_faults()


def index_of(store, url: str, split: str) -> SplitIndex:
    return SplitIndex.from_json(store.fs().cat(f"{url}/{split}/index.json"))


def block_bytes_by_object(store, url: str) -> dict[str, int]:
    """"bucket/key" of each shard of both splits: the bytes of all its blocks (a whole download of each, once)."""
    return {f"{url.removeprefix('s3://')}/{split}/{shard.name}": shard.end - shard.offsets[0]
            for split in ("train", "test") for shard in index_of(store, url, split).shards}


def shard_bytes_read(proxy, url: str) -> dict[str, int]:
    """proxy.bytes_read_by_object of the shards under `url` (their indexes left out)."""
    return {name: read for name, read in proxy.bytes_read_by_object(url).items() if name.endswith(".tar")}


def shard_gets(request_method: str, path: str) -> bool:
    """A fault's `match`: reads of the shards (not of the indexes)."""
    return request_method == "GET" and any(part in path for part in TARS)


class BytesReadAtEachSave(hooks.Hooks):
    """(step, the bytes read from the store so far) at each checkpoint: the one at an epoch's end (after its
    evaluation; the next epoch has not begun)."""

    def __init__(self, proxy) -> None:
        self.proxy, self.read = proxy, []

    def checkpoint_saved(self, progress, folder):
        self.read.append((progress.step, self.proxy.bytes_read_by_object()))


@pytest.fixture(scope="module")
def clean_run(shards, tmp_path_factory):
    """The run in this process with an empty cache and a store without faults: (output_dir, BytesReadAtEachSave's
    record, the bytes read from the store by the end)."""
    store, url = shards
    tmp = tmp_path_factory.mktemp("clean")
    store.proxy.reset_counts()
    saves = BytesReadAtEachSave(store.proxy)
    with hooks.added(saves):
        train_in_process(*RUN, f"data.root={url}", f"data.cache_dir={tmp / 'cache'}", f"output_dir={tmp / 'run'}")
    return tmp / "run", saves.read, store.proxy.bytes_read_by_object()


@pytest.mark.floors
def test_a_second_epoch_reads_no_byte_from_the_store_once_the_cache_holds_the_set(store, clean_run):
    shared, url = store
    _, saves, _ = clean_run
    (first_epoch, read_by_then), (second_epoch, read_by_the_end) = saves
    assert (first_epoch, second_epoch) == (5, 10)
    assert {name: read for name, read in read_by_then.items() if name.endswith(".tar")} == \
        block_bytes_by_object(shared, url), "the first epoch and its evaluation read every block of the set once"
    assert read_by_the_end == read_by_then, "the second epoch or its evaluation read from the store"


def test_a_run_that_ended_leaves_no_prefetch_thread_behind_in_the_process_that_trained_it(store, clean_run):
    """A script that trains several runs (the Python API) keeps no idle thread, nor the read plan, of those before:
    the prefetch threads end within a second or two of their run's loader."""
    import gc
    import threading

    deadline = time.monotonic() + 5
    while True:
        gc.collect()
        left = [thread.name for thread in threading.enumerate() if thread.name.startswith("accel-train shard")]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"{len(left)} prefetch threads outlived their run: {left}"


def test_two_processes_of_one_node_and_their_workers_download_each_block_once(store, tmp_path):
    """One cache for the node, a lock per block: every process and DataLoader worker that needs a block waits for
    the one download under way. Each shard is read exactly once over 2 epochs (the bytes of all its blocks)."""
    shared, url = store
    blocks = block_bytes_by_object(shared, url)
    shared.proxy.reset_counts()
    launch(2, "train", *RUN, f"data.root={url}", "data.num_workers=1", f"data.cache_dir={tmp_path / 'cache'}",
           f"output_dir={tmp_path / 'run'}", timeout=300)
    assert shard_bytes_read(shared.proxy, url) == blocks
    (test,) = [line for line in read_metrics(tmp_path / "run", "test") if line["step"] == 10]
    assert test["num_samples"] == TEST


def test_a_cache_smaller_than_the_set_trains_to_the_same_result_reading_blocks_again(store, clean_run, tmp_path,
                                                                                      capsys):
    """A quarter of the set, less than a window of 8 of its 12 shards: the same weights, the blocks read again, and
    one warning naming the keys that make it fast again."""
    shared, url = store
    blocks = block_bytes_by_object(shared, url)
    bound_gb = sum(blocks.values()) / 4 / 1e9
    shared.proxy.reset_counts()
    train_in_process(*RUN, f"data.root={url}", f"data.cache_dir={tmp_path / 'cache'}", f"data.cache_gb={bound_gb}",
                     f"output_dir={tmp_path / 'run'}")
    warnings = [line for line in capsys.readouterr().err.splitlines() if "holds less than one window" in line]
    assert len(warnings) == 1 and warnings[0].startswith(f"accel-train: warning: data.cache_gb={bound_gb:g} holds ")
    assert warnings[0].endswith("raise data.cache_gb, or lower data.shuffle_window_shards"), warnings[0]
    assert_same_run(tmp_path / "run", clean_run[0])
    assert (tmp_path / "run" / "model.safetensors").read_bytes() == (clean_run[0] / "model.safetensors").read_bytes()
    read = shard_bytes_read(shared.proxy, url)
    assert sum(read.values()) > 1.5 * sum(blocks.values()), "a cache of a quarter of the set read it only once"
    cached = sum(path.stat().st_size for path in (tmp_path / "cache" / "blocks").rglob("*") if path.is_file())
    assert cached <= bound_gb * 1e9 * 1.1, f"the cache holds {cached} bytes, its bound is {bound_gb * 1e9:.0f}"


@pytest.mark.floors
def test_transient_store_errors_during_training_are_survived_with_identical_results(store, clean_run, tmp_path):
    """503 SlowDown, a connection reset, a body cut short (the connection closed: the client sees it) and a body cut
    short that the answer's length hides (only the block's sha256 shows it), while the shards are read; and, on the
    training index, more in a row than the storage client's own retries absorb (s3fs and botocore make 2 to 4
    attempts of a read: support/object_store.py), so that accel-train's own retries must carry the run. Each
    retried, the run the same bit for bit as the one without them."""
    shared, url = store
    index = f"{url.removeprefix('s3://')}/train/index.json"
    on_the_index = [("503", 5), ("reset", 3), ("truncate", 3)]
    while_training = [("503", 3), ("reset", 2), ("truncate", 2), ("short", 2)]
    shared.proxy.reset_counts()
    for kind, times in on_the_index:
        shared.proxy.inject(kind, times=times, match=lambda method, path: path == f"/{index}")
    for kind, times in while_training:
        shared.proxy.inject(kind, times=times, match=shard_gets)
    train_in_process(*RUN, f"data.root={url}", f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}")
    injected = collections.Counter()
    for kind, times in on_the_index + while_training:
        injected[kind] += times
    assert {kind: shared.proxy.faults_applied(kind) for kind in injected} == injected
    assert_same_run(tmp_path / "run", clean_run[0])
    assert (tmp_path / "run" / "model.safetensors").read_bytes() == (clean_run[0] / "model.safetensors").read_bytes()


def one_error_line(output: str) -> str:
    """The one error line of a run's output (and no traceback)."""
    errors = [line for line in output.splitlines() if line.startswith("accel-train: error")]
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    return errors[0]


def test_a_shard_changed_in_the_store_after_its_index_was_written_stops_the_run_with_exit_3_naming_its_url(
        store, tmp_path):
    shared, url = store
    fs, changed = shared.fs(), shared.url("changed")
    fs.copy(url, changed, recursive=True)
    shard = index_of(shared, url, "train").shards[3]
    data = bytearray(fs.cat(f"{changed}/train/{shard.name}"))
    start, end = shard.sample_span(shard.samples // 2)
    data[(start + end) // 2] ^= 0xFF  # one byte of a sample in the middle of the shard: the same size, other bytes
    fs.pipe(f"{changed}/train/{shard.name}", bytes(data))
    result = run_cli("train", *RUN, f"data.root={changed}", "data.store_patience_s=1",
                     f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}", check=False)
    assert result.returncode == 3, result.stderr[-3000:]
    line = one_error_line(result.stdout + result.stderr)
    assert f"cannot read {changed}/train/{shard.name}: block " in line and "not the index's" in line, line


def test_a_shard_cut_short_in_the_store_is_a_damaged_shard_in_one_line_exit_3_not_a_store_that_fails(store, tmp_path):
    """Its later blocks' ranges lie past its end (the store answers 416, "not satisfiable"), which retries would take
    for a store that fails; the size its index recorded says at once that the object is not the one indexed."""
    shared, url = store
    fs, cut = shared.fs(), shared.url("cut")
    fs.copy(url, cut, recursive=True)
    shard = index_of(shared, url, "train").shards[1]
    fs.pipe(f"{cut}/train/{shard.name}", fs.cat(f"{cut}/train/{shard.name}")[:shard.bytes // 3])
    result = run_cli("train", *RUN, f"data.root={cut}", "data.store_patience_s=20",
                     f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}", check=False)
    assert result.returncode == 3, result.stderr[-3000:]
    line = one_error_line(result.stdout + result.stderr)
    assert line.endswith(f"cannot read {cut}/train/{shard.name}: it has {shard.bytes // 3:,} bytes, "
                         f"{shard.bytes:,} when its index was written: cut short or written again since (a damaged "
                         "shard); put it back, or write the shards again with accel-train shard, then run again "
                         "with resume=auto"), line
    assert "retrying" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("when", ["before the run", "while it trains"])
def test_a_shard_deleted_from_the_store_while_its_index_lists_it_is_one_line_and_exit_3_naming_it(when, store,
                                                                                                   tmp_path):
    # Before: the run's one listing at its start finds it missing, and no run folder is made. While it trains: its
    # first read (held at the proxy until the shard is gone) finds it missing, where a traceback came before.
    shared, url = store
    fs, copied = shared.fs(), shared.url(f"deleted-{when.split()[0]}")
    fs.copy(url, copied, recursive=True)
    shard = index_of(shared, url, "train").shards[2]
    gone = f"{copied}/train/{shard.name}"
    run = ["train", *RUN, f"data.root={copied}", f"data.cache_dir={tmp_path / 'cache'}",
           f"output_dir={tmp_path / 'run'}"]
    if when == "before the run":
        fs.rm(gone)
        result = run_cli(*run, check=False)
        assert result.returncode == 3, result.stderr[-3000:]
        line = one_error_line(result.stdout + result.stderr)
        assert f"data.root={copied}: train/index.json lists {shard.name}, which the store does not have" in line, line
        assert not (tmp_path / "run").exists()
        return
    shared.proxy.inject("hold", match=lambda method, path: method == "GET" and gone[5:] in path)
    log = tmp_path / "log"
    job = start([PYTHON, "-m", "accel_train", *run], log)
    try:
        deadline = time.monotonic() + 120
        while not shared.proxy.holding.is_set() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shared.proxy.holding.is_set(), log.read_text()[-3000:]
        fs.rm(gone)
    finally:
        shared.proxy.release()
    assert job.wait(timeout=120) == 3, log.read_text()[-3000:]
    line = one_error_line(log.read_text())
    assert f"cannot read {gone}: its index (train/index.json) lists it, but it is not there" in line, line


@pytest.mark.floors
def test_a_store_that_stops_mid_run_stops_it_in_one_line_with_exit_3_after_data_store_patience_s(store, tmp_path):
    """The cache a tenth of the set, so the run keeps reading the store; once a step is logged, the store stops
    answering (connections refused) for good. Every read retries for data.store_patience_s, then the run ends with
    one line naming what it could not read, exit 3: within the patience plus the client's timeouts (docs/data.md;
    here the connection is refused at once)."""
    shared, url = store
    patience = 3
    out, log = tmp_path / "run", tmp_path / "log"
    bound_gb = sum(block_bytes_by_object(shared, url).values()) / 10 / 1e9
    run = start([PYTHON, "-m", "accel_train", "train", *RUN, f"data.root={url}", f"data.store_patience_s={patience}",
                 f"data.cache_gb={bound_gb}", f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={out}"], log)
    deadline = time.monotonic() + 240
    while not ((out / "metrics.jsonl").is_file() and read_metrics(out, "train")):
        assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)
    with shared.down():
        code = run.wait(timeout=patience + 60)  # a bound on a hang: the line comes after the patience
    output = log.read_text()
    assert code == 3, output[-3000:]
    line = one_error_line(output)
    said = re.search(rf"cannot read {re.escape(url)}/\S+: .* \((\d+) attempts in (\d+) s\); check that the store is "
                     r"reachable", line)
    # The last attempt may begin just before the patience ends, and takes the client's own retries (about a second
    # with a refused connection; 3 attempts in 4 s measured at the s3fs floor, 2024.6.1)
    assert said and int(said.group(2)) <= patience + 2, line
    assert not (out / "model.safetensors").exists()


# --- webdataset's tars, and webdataset reading ours ------------------------------------------------------------------


def png(pixels) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.floors
def test_tars_written_by_webdataset_and_indexed_by_accel_train_shard_index_train_and_evaluate_every_test_sample(
        store, fashion_mnist, tmp_path):
    import webdataset

    shared, _ = store
    url = shared.url("webdataset")
    splits = fashion_mnist[1]
    for split, tars, per_tar in (("train", 2, 100), ("test", 1, 60)):
        folder = tmp_path / split
        folder.mkdir()
        for number in range(tars):
            with webdataset.TarWriter(str(folder / f"part-{number}.tar")) as writer:
                for index in range(number * per_tar, (number + 1) * per_tar):
                    writer.write({"__key__": f"sample{index:06d}", "png": png(splits[split].images[index, 0].numpy()),
                                  "cls": int(splits[split].labels[index])})
        shared.fs().put(str(folder), f"{url}/{split}", recursive=True)
    indexed = run_cli("shard", "index", url)
    assert "200 samples in 2 tars" in indexed.stdout + indexed.stderr
    train_in_process(*RUN, f"data.root={url}", "data.image_size=28", "train.batch_size=50", "train.epochs=1",
                     f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}")
    assert [line["step"] for line in read_metrics(tmp_path / "run", "train")] == [1, 2, 3, 4]
    assert [line["num_samples"] for line in read_metrics(tmp_path / "run", "test")] == [60]


@pytest.mark.floors
def test_webdataset_reads_the_tars_accel_train_shard_wrote_sample_for_sample(store, fashion_mnist, monkeypatch):
    """webdataset.WebDataset over the shards in the store (opened through fsspec, as its gopen table allows), with
    its own decoders: every sample in order, with its pixels (KEY.pixels.npy) and label as the source has them."""
    import importlib

    import fsspec
    import webdataset

    shared, url = store
    def through_fsspec(url, mode="rb", bufsize=8192, **kw):
        return fsspec.open(url, mode, endpoint_url=shared.endpoint_url).open()

    monkeypatch.setitem(importlib.import_module("webdataset.gopen").gopen_schemes, "s3", through_fsspec)
    for split, count in (("train", TRAIN), ("test", TEST)):
        names = [shard.name for shard in index_of(shared, url, split).shards]
        read = list(webdataset.WebDataset([f"{url}/{split}/{name}" for name in names], shardshuffle=False).decode())
        source = fashion_mnist[1][split]
        assert [sample["__key__"] for sample in read] == [f"{index:09d}" for index in range(count)]
        assert [int(sample["cls"]) for sample in read] == source.labels[:count].tolist()
        assert all(np.array_equal(sample["pixels.npy"], source.images[index].numpy()) for index, sample in
                   enumerate(read))


# --- a run trained from shards of an ImageFolder tree ----------------------------------------------------------------


@pytest.fixture(scope="module")
def imagefolder_run(shards, fashion_mnist, tmp_path_factory):
    """An ImageFolder tree of Fashion-MNIST PNGs (10 classes, 50 training and 20 test images each), written as
    shards to the store (as `accel-train shard imagefolder data.root=TREE` does), and a run trained from them in this
    process: (tree, run folder)."""
    from accel_train.config import load_config
    from accel_train.data.shards.writer import write_shards

    store, _ = shards
    tmp = tmp_path_factory.mktemp("imagefolder")
    tree, url = tmp / "tree", store.url("imagefolder")
    for split, per_class in (("train", 50), ("test", 20)):
        source = fashion_mnist[1][split]
        for label in range(10):
            folder = tree / split / f"class{label}"
            folder.mkdir(parents=True)
            for index in np.flatnonzero(source.labels.numpy() == label)[:per_class]:
                (folder / f"{index:05d}.png").write_bytes(png(source.images[index, 0].numpy()))
    write_shards(load_config("imagefolder", [f"data.root={tree}"]).data, url, shard_mb=0.02)
    train_in_process("imagefolder", "data.name=shards", f"data.root={url}", "data.image_size=28",
                     "model.name=mnist_cnn", "train.batch_size=50", "train.epochs=1", "train.warmup_steps=0",
                     "data.num_workers=0", "train.plot=false", f"data.cache_dir={tmp / 'cache'}",
                     f"output_dir={tmp / 'run'}")
    return tree, tmp / "run"


def test_a_run_trained_from_shards_of_an_imagefolder_tree_evaluates_on_that_tree_as_on_its_shards(imagefolder_run):
    from accel_train import api

    tree, run = imagefolder_run
    from_tree = last_json_line(run_cli("eval", str(run), "data.name=imagefolder", f"data.root={tree}").stdout)
    from_shards = api.evaluate(str(run))  # accel-train eval RUN
    (trained,) = read_metrics(run, "test")  # the run's own evaluation, from the shards
    assert from_tree["num_samples"] == 200 and from_tree == from_shards
    assert all(trained[key] == value for key, value in from_tree.items() if key != "num_processes"), trained


def test_predict_of_a_shards_run_gives_each_image_the_label_its_evaluation_counts(imagefolder_run):
    """The test images as files: predict's top label is right for exactly as many as the evaluation found correct
    (the same transforms from a file as from its shard), and each file's row is the model's answer for it."""
    from accel_train import api

    tree, run = imagefolder_run
    rows = api.predict(str(run), inputs=str(tree / "test"))
    assert len(rows) == 200
    right = sum(row["labels"][0] == row["path"].split("/")[-2] for row in rows)
    assert right == api.evaluate(str(run))["correct"]
