"""The node-local cache of shard blocks: each block downloaded once per node, verified against the sha256 its index
lists, renamed into place whole, and kept under a size bound (least recently used evicted).

Blocks are stored by their sha256, so a shard rewritten at the same URL (a new index) is never served from an old
copy, and every process of a node (DataLoader workers too) shares one copy: a lock per block makes the others wait
for the download under way instead of starting their own.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import uuid
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

from accel_train.data.shards.format import INDEX_FILE, Shard, is_sha256
from accel_train.errors import DataNotFoundError
from accel_train.storage import Store

_LOCK_STRIPES = 4096  # lock files by the sha's first three hex digits: a bounded set, shared by all blocks
_EVICT_EVERY = 0.05  # a process looks for blocks to evict after adding this share of the bound
# The bytes of blocks a process keeps mapped: a block evicted from the folder while mapped keeps its disk space until
# its map is dropped, so this bounds what a process holds beyond the cache's bound (and a share of that bound)
MAPPED_BYTES, MAPPED_SHARE = 512 * 2**20, 1 / 16


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "accel-train" / "shards"


class BlockCache:
    """Blocks of one store's shards in `folder` on this node, at most `max_bytes` of them."""

    def __init__(self, store: Store, folder: Path, max_bytes: int) -> None:
        self.store, self.folder, self.max_bytes = store, Path(folder), max_bytes
        self.downloaded = 0  # bytes this process fetched from the store (the bench's and the tests' count)
        self._added_since_eviction = 0
        self._mapped: OrderedDict[str, mmap.mmap] = OrderedDict()  # this process's recently read blocks, by sha256
        self._mapped_bytes = 0

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_mapped": OrderedDict(), "_mapped_bytes": 0}  # a worker maps blocks of its own

    def block_path(self, sha256: str) -> Path:
        """Where the block of `sha256` lives in the cache: built only from a checked hash (64 lowercase hex digits name
        a block here), and held inside the folder anyway. read_index checks an index's hashes already, where its line
        can name the shard; the cache checks again to keep its own promise (nothing outside its folder read, touched
        or written) for whoever made the Shard, and the inside check states that promise itself rather than leaving
        it to follow from the rule for names."""
        if not is_sha256(sha256):
            raise DataNotFoundError(f"data.cache_dir: a shard block's sha256 {sha256!r} is not 64 lowercase hex "
                                    "digits; its index is damaged: write the shards again with accel-train shard")
        path = self.folder / "blocks" / sha256[:2] / sha256
        if not Path(os.path.normpath(path)).is_relative_to(os.path.normpath(self.folder)):
            raise DataNotFoundError(f"data.cache_dir: a block's path {path} lies outside the cache {self.folder}")
        return path

    def read_sample(self, shard: Shard, folder: str, position: int) -> bytes:
        """The bytes of sample `position` of `shard` (stored under `folder` of the store), from its cached block."""
        block = shard.block_of(position)
        block_start, _ = shard.block_span(block)
        start, end = shard.sample_span(position)
        return self._mapped_block(shard, folder, block)[start - block_start:end - block_start]

    def _mapped_block(self, shard: Shard, folder: str, block: int) -> mmap.mmap:
        """The block's bytes, memory-mapped: an open and a touch for its first sample in this process, none for the
        rest (a sample's own open, seek and touch cost more than decoding a 28 px image). A block evicted by another
        process while mapped here stays readable (POSIX); the least recently read maps are dropped past MAPPED_BYTES."""
        sha256 = shard.blocks[block][1]
        mapped = self._mapped.get(sha256)
        if mapped is not None:
            self._mapped.move_to_end(sha256)
            return mapped
        for _ in range(3):  # another process may evict the block between its download and this read
            path = self.fetch(shard, folder, block)
            try:
                with open(path, "rb") as file:
                    mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
                break
            except FileNotFoundError:
                continue
        else:
            raise RuntimeError(f"block {block} of {shard.name} keeps being evicted: data.cache_gb is too small for "
                               "one window of shards")
        self._mapped[sha256] = mapped
        self._mapped_bytes += len(mapped)
        while self._mapped_bytes > min(MAPPED_BYTES, self.max_bytes * MAPPED_SHARE) and len(self._mapped) > 1:
            dropped = self._mapped.popitem(last=False)[1]
            self._mapped_bytes -= len(dropped)
            dropped.close()
        return mapped

    def fetch(self, shard: Shard, folder: str, block: int) -> Path:
        """The block's path in the cache, downloading it first unless this node has it (or is getting it)."""
        sha256 = shard.blocks[block][1]
        path = self.block_path(sha256)
        if self._touch(path):
            return path
        with self._locked(sha256):
            if self._touch(path):  # another process of this node fetched it while we waited
                return path
            start, end = shard.block_span(block)

            def wrong(data: bytes) -> str | None:
                if len(data) != end - start:
                    return f"a body of {len(data)} bytes, not {end - start} (bytes {start} to {end})"
                found = hashlib.sha256(data).hexdigest()
                return None if found == sha256 else (f"block {block} has sha256 {found[:12]}..., not the index's "
                                                     f"{sha256[:12]}...: the shard changed after its index was made")
            try:
                data = self.store.read(f"{folder}/{shard.name}", start, end, check=wrong, size=shard.bytes)
            except FileNotFoundError:
                raise DataNotFoundError(
                    f"cannot read {self.store.url(f'{folder}/{shard.name}')}: its index ({folder}/{INDEX_FILE}) lists "
                    "it, but it is not there (deleted or moved after the index was written); put it back, or write "
                    "the shards again with accel-train shard, then run again with resume=auto") from None
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
            partial.write_bytes(data)
            partial.replace(path)
            self.downloaded += len(data)
            self._added_since_eviction += len(data)
        if self._added_since_eviction > self.max_bytes * _EVICT_EVERY:
            self._added_since_eviction = 0
            self.evict()
        return path

    def evict(self) -> None:
        """Remove the least recently used blocks until the cache holds at most 90% of its bound."""
        with self._locked("evict"):
            blocks = []
            for sub in (self.folder / "blocks").glob("*"):
                for entry in os.scandir(sub):
                    if not entry.name.startswith("."):
                        stat = entry.stat()
                        blocks.append((stat.st_mtime, stat.st_size, entry.path))
            total = sum(size for _, size, _ in blocks)
            if total <= self.max_bytes:
                return
            for _, size, path in sorted(blocks):
                if total <= self.max_bytes * 0.9:
                    break
                Path(path).unlink(missing_ok=True)  # a reader that opened it keeps reading it (POSIX)
                total -= size

    @staticmethod
    def _touch(path: Path) -> bool:
        """Whether the block is here; if so it becomes the most recently used (its mtime, which LRU reads)."""
        try:
            os.utime(path)
            return True
        except FileNotFoundError:
            return False

    @contextmanager
    def _locked(self, name: str):
        locks = self.folder / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        stripe = name if name == "evict" else f"{int(name[:3], 16) % _LOCK_STRIPES:03x}"
        with open(locks / stripe, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

