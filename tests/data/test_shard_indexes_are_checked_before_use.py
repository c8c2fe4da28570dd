"""A shard index is data from a store others may write to: checked where it is read, and its offsets again against
the tar's own headers where a sample is read. A hash that is not 64 lowercase hex digits, a shard name that is a path,
an offset or size outside its tar, or offsets that do not match the tar's members are one line naming the shard (and
the sample), exit 3: never a file outside the cache read or touched, never a traceback, never another sample's bytes.

The shards are the registry's synthetic MNIST (24 training samples in one shard, raw pixels: a .cls member of one
block, then a .pixels.npy member of three, 2,560 bytes a sample), written in this process once; each test forges a
copy of their index."""

import io
import json
import os
import shutil

import numpy as np
import pytest

from accel_train import cli
from accel_train.config import DataConfig
from accel_train.data import build_dataset
from accel_train.data.shards.cache import BlockCache
from accel_train.data.shards.dataset import read_index
from accel_train.data.shards.format import INDEX_FILE, Shard, SplitIndex, index_tar, tar_of
from accel_train.errors import DataNotFoundError
from accel_train.storage import Store

TRAINING = ["data.train_subset=24", "data.eval_subset=10", "train.batch_size=12", "train.max_steps=2",
            "train.plot=false", "data.num_workers=0"]
SAMPLE = 2560  # the bytes of one sample of these shards


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("written") / "shards"
    cli.main(["shard", "mnist_cnn", "data.synthetic=true", "data.train_subset=24", "data.eval_subset=10",
              f"output={out}"])
    return out


def forged(written, tmp_path, change) -> str:
    """A copy of the shards whose training index's first shard `change` altered (its entry as JSON)."""
    copy = tmp_path / "shards"
    shutil.copytree(written, copy)
    index = json.loads((copy / "train" / INDEX_FILE).read_text())
    change(index["shards"][0])
    (copy / "train" / INDEX_FILE).write_text(json.dumps(index))
    return str(copy)


def one_line(capsys, stopped, code: int) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert stopped.value.code == code and len(lines) == 1, lines
    assert lines[0].startswith("accel-train: error: ") and "Traceback" not in lines[0]
    return lines[0]


def test_a_block_hash_that_names_a_file_outside_the_cache_is_one_line_and_no_file_outside_is_read_or_touched(
        written, tmp_path, capsys):
    cache = tmp_path / "machine" / "cache"
    outside = "../../victim"  # blocks/../../../victim: beside the cache's folder
    victim = tmp_path / "victim"
    assert os.path.normpath(cache / "blocks" / outside[:2] / outside) == str(victim)
    victim.write_bytes(b"not a block" * 1000)
    os.utime(victim, (1_000_000_000, 1_000_000_000))
    root = forged(written, tmp_path, lambda shard: shard["blocks"][0].__setitem__(1, outside))

    with pytest.raises(SystemExit) as stopped:
        cli.main(["train", "mnist_cnn", "data.name=shards", f"data.root={root}", f"data.cache_dir={cache}",
                  f"output_dir={tmp_path / 'run'}", *TRAINING])

    line = one_line(capsys, stopped, 3)
    assert f"{root}/train/{INDEX_FILE}" in line and "shard 'shard-000000.tar', block 0: its sha256 '../../victim' " \
        "is not 64 lowercase hex digits" in line, line
    assert victim.stat().st_mtime == 1_000_000_000 and victim.read_bytes() == b"not a block" * 1000
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob("machine/cache/blocks/*/*"))

    # The cache keeps that promise itself, for a shard entry no index check saw
    index = read_index(Store(str(written)), "train")
    shard = index.shards[0]
    unchecked = Shard(shard.name, shard.bytes, shard.sha256, shard.offsets, shard.end, [(0, outside)])
    with pytest.raises(DataNotFoundError) as refused:
        BlockCache(Store(root), cache, 10**9).read_sample(unchecked, "train", 0)
    assert str(refused.value).startswith("data.cache_dir: a shard block's sha256 '../../victim' is not 64 lowercase "
                                         "hex digits")
    assert victim.stat().st_mtime == 1_000_000_000 and victim.read_bytes() == b"not a block" * 1000


def set_block_field(block: int, position: int, value):
    return lambda shard: shard["blocks"][block].__setitem__(position, value)


def set_offset(sample: int, value):
    return lambda shard: shard["offsets"].__setitem__(sample, value(shard["offsets"][sample]))


FORGED = {  # how an index's first shard is forged, and what the line says of it
    "a block hash in capitals": (set_block_field(0, 1, "A" * 64), "block 0: its sha256 'AAAA"),
    "a block hash of 63 digits": (set_block_field(0, 1, "a" * 63), "block 0: its sha256 'aaaa"),
    "the shard's hash not hex": (lambda shard: shard.__setitem__("sha256", "z" * 64), "its sha256 'zzzz"),
    "a shard name that is a path": (lambda shard: shard.__setitem__("name", "../test/shard-000000.tar"),
                                    "shard '../test/shard-000000.tar': not the name of a file in its split's folder"),
    "an offset 100 bytes off": (set_offset(3, lambda offset: offset + 100),
                                "sample 3: its offset 7780 is not a tar block's start"),
    "an offset before the previous one": (set_offset(3, lambda offset: offset - SAMPLE),
                                          "sample 3: its offset 5120 is not a tar block's start after sample 2's 5120"),
    "an offset past the samples' end": (set_offset(23, lambda offset: 10**6), "sample 23: its offset 1000000"),
    "an offset that is not a whole number": (set_offset(3, float), "sample 3: its offset 7680.0"),
    "samples that end inside the tar's end blocks": (lambda shard: shard.__setitem__("end", shard["bytes"]),
                                                     "its samples end at byte 71680, which is not a tar block's"),
    "a first block that starts after the first sample": (set_block_field(0, 0, 1),
                                                         "block 0: its first sample 1 is not 0"),
}


@pytest.mark.parametrize("case", list(FORGED))
def test_an_index_that_cannot_describe_its_tar_is_one_line_naming_the_shard_before_any_sample_is_read(
        case, written, tmp_path):
    change, says = FORGED[case]
    root = forged(written, tmp_path, change)
    with pytest.raises(DataNotFoundError) as refused:
        build_dataset(DataConfig(name="shards", root=root, cache_dir=str(tmp_path / "cache")), train=True)
    line = str(refused.value)
    assert line.startswith(f"{root}/train/{INDEX_FILE} is not an index of accel-train shards (shard '") and \
        says in line and "\n" not in line, line
    assert refused.value.exit_code == 3 and not (tmp_path / "cache").exists()


def whole_samples(root: str, cache) -> list[tuple[bytes, int]]:
    dataset = build_dataset(DataConfig(name="shards", root=root, cache_dir=str(cache)), train=True).dataset
    return [(image.numpy().tobytes(), label) for image, label in (dataset[index] for index in range(len(dataset)))]


MOVED = {  # an offset the index lost, or moved onto another tar header or into a member's contents; the samples whose
    # reads stop, and what their line says
    "removed": (lambda offsets: offsets.pop(3), {2: "its bytes hold members of two samples, 000000002 and 000000003 "
                                                    "(an offset missing from the index)"}),
    "moved onto the sample's second member": (lambda offsets: offsets.__setitem__(3, offsets[3] + 1024), {
        2: "its bytes hold members of two samples, 000000002 and 000000003",
        3: "it has no label (.cls or .json), only ['pixels.npy']"}),
    "moved into a member's contents": (lambda offsets: offsets.__setitem__(3, offsets[3] + 512), {
        2: "its member 000000003.cls runs to byte 3,073 of the 3,072 up to the next sample's offset",
        3: "no tar member at its offset"}),
}


@pytest.mark.parametrize("case", list(MOVED))
def test_an_offset_removed_or_moved_stops_the_samples_it_touches_in_one_line_and_never_gives_another_samples_bytes(
        case, written, tmp_path):
    whole = set(whole_samples(str(written), tmp_path / "cache"))
    change, stopped = MOVED[case]
    root = forged(written, tmp_path, lambda shard: change(shard["offsets"]))
    dataset = build_dataset(DataConfig(name="shards", root=root, cache_dir=str(tmp_path / "cache")), train=True).dataset
    for sample in range(len(dataset)):
        if sample in stopped:
            with pytest.raises(DataNotFoundError) as refused:
                dataset[sample]
            line = str(refused.value)
            assert line.startswith(f"shards: cannot read {root}/train/shard-000000.tar (sample {sample}): ") and \
                stopped[sample] in line and "\n" not in line, line
            assert refused.value.exit_code == 3
        else:
            image, label = dataset[sample]
            assert (image.numpy().tobytes(), label) in whole, f"sample {sample} is no sample of the shard, whole"


def test_an_npy_member_holding_an_object_array_is_one_line_naming_the_shard_and_the_sample(tmp_path, capsys):
    """np.load reads no pickles: an object array is refused there (ValueError), and named here, exit 3. Its shards
    hold a dataset by import path's samples (.npy tensors), whose first sample set-up reads for its shape."""
    def npy(array: np.ndarray, pickles: bool) -> bytes:
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=pickles)
        return buffer.getvalue()

    plain, pickled = npy(np.zeros(3, np.float32), False), npy(np.array([{"a": 1}, None], dtype=object), True)
    for split, first in (("train", pickled), ("test", plain)):
        data = tar_of([(f"{index:09d}", {"npy": first if index == 0 else plain, "cls": b"0"}) for index in range(3)])
        (tmp_path / "shards" / split).mkdir(parents=True)
        (tmp_path / "shards" / split / "shard-000000.tar").write_bytes(data)
        index = SplitIndex(split, [index_tar("shard-000000.tar", data)[0]], classes=["zero"], num_classes=1,
                           channels=0, image_size=None, mean=None, std=None, transforms="as_written", source="mine")
        (tmp_path / "shards" / split / INDEX_FILE).write_bytes(index.to_json())
    test = build_dataset(DataConfig(name="shards", root=str(tmp_path / "shards"), cache_dir=str(tmp_path / "cache")),
                         train=False).dataset
    assert test[0][0].tolist() == [0.0, 0.0, 0.0]

    with pytest.raises(SystemExit) as stopped:
        cli.main(["train", "mnist_cnn", "data.name=shards", f"data.root={tmp_path / 'shards'}",
                  f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}", *TRAINING])

    line = one_line(capsys, stopped, 3)
    assert f"shards: cannot read {tmp_path / 'shards'}/train/shard-000000.tar (sample 0, .npy): Object arrays cannot " \
        "be loaded when allow_pickle=False; write the shards again" in line, line
    assert not (tmp_path / "run").exists()
