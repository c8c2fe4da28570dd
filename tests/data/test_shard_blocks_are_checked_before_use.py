"""A shard block reaches the cache only as the bytes its index lists: a body cut short, even one whose length says
it is whole, is read again, and bytes that stay wrong stop the read in one line naming the URL (exit 3)."""

import pytest

from accel_train.data.shards.cache import BlockCache
from accel_train.data.shards.format import index_tar, sample_members, tar_of
from accel_train.storage import Store, StoreUnavailable


def shard_in_store(object_store, samples: int = 40):
    members = [(f"{index:06d}", {"png": bytes([index]) * (900 + index), "cls": str(index % 10).encode()})
               for index in range(samples)]
    data = tar_of(members)
    shard, _ = index_tar("shard-000000.tar", data, block_bytes=16 * 1024)
    object_store.fs().pipe_file(f"{object_store.bucket}/set/train/shard-000000.tar", data)
    return shard, members


def test_a_block_whose_body_arrives_short_with_a_length_to_match_is_read_again_and_served_whole(object_store,
                                                                                                  tmp_path):
    shard, members = shard_in_store(object_store)
    assert len(shard.blocks) >= 3
    cache = BlockCache(Store(object_store.url("set"), patience_s=10), tmp_path / "cache", 10**9)
    object_store.proxy.inject("short", times=2, match=lambda method, path: method == "GET")
    for position, (_, expected) in enumerate(members):
        assert sample_members(cache.read_sample(shard, "train", position)) == expected
    assert object_store.proxy.faults_applied("short") == 2
    gets = [request for request in object_store.proxy.requests if request.method == "GET"]
    assert len(gets) == len(shard.blocks) + 2  # each short answer read once more


def test_a_block_that_keeps_differing_from_its_index_stops_the_read_naming_the_url(object_store, tmp_path):
    shard, _ = shard_in_store(object_store)
    changed = bytearray(object_store.fs().cat_file(f"{object_store.bucket}/set/train/shard-000000.tar"))
    changed[shard.offsets[1] + 600] ^= 0xFF  # one byte of sample 1's image: the first block's hash no longer matches
    object_store.fs().pipe_file(f"{object_store.bucket}/set/train/shard-000000.tar", bytes(changed))
    cache = BlockCache(Store(object_store.url("set"), patience_s=1), tmp_path / "cache", 10**9)
    with pytest.raises(StoreUnavailable) as raised:
        cache.read_sample(shard, "train", 1)
    line = str(raised.value)
    assert line.startswith(f"cannot read {object_store.url('set')}/train/shard-000000.tar: block 0 has sha256 ")
    assert "the shard changed after its index was made" in line and "\n" not in line
    assert raised.value.exit_code == 3
    assert not list((tmp_path / "cache").rglob("blocks/*/*")), "nothing unverified is kept"
