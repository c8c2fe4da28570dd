"""The shard format: WebDataset tar shards (`KEY.png` or `KEY.jpg` or `KEY.npy`, with `KEY.cls` or `KEY.json`, per
sample) and one index per split (`SPLIT/index.json`).

The index lists each shard's name, size, sample count and sha256, each sample's byte offset inside its tar (so one
sample is read without the bytes before it), and the shard's blocks: runs of whole samples of about `block_bytes`,
each with its own sha256, the unit a node downloads, verifies and caches. It also records what a model needs to
know of the data (classes, normalisation, channels, native image size) and which transforms its samples take.
Tars written by `webdataset` are indexed by `accel-train shard index` and train the same way.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import re
import tarfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

FORMAT = "accel-train shards 1"
INDEX_FILE = "index.json"
SOURCES_FILE = "sources.json"  # beside a split's index: each sample's source file (relative to data.root), if any
SPLITS = ("train", "test", "val")
BLOCK_BYTES = 4 * 2**20
IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp", "bmp", "ppm", "pgm", "tif", "tiff")
# How samples become model inputs: like the in-memory datasets' per-sample path (native size, padded random crop),
# like ImageFolder (random resized crop, 224 px unless data.image_size), or as written (a dataset by import path
# applied its own transforms: tensors as they are, images as [0, 1] tensors).
TRANSFORMS = ("in_memory", "imagefolder", "as_written")
# How `accel-train shard` stored the images: the source's own bytes (its files, or PNG for the registry's datasets),
# raw uint8 pixels (KEY.pixels.npy, (C, H, W): nothing to decode), or re-encoded as JPEG; both of the latter may be
# shrunk first to a short side of `shrink_to` px (recorded in the index).
IMAGE_STORAGE = ("as_given", "raw", "jpeg")
RAW_PIXELS = "pixels.npy"  # numpy's .npy, which webdataset's decoders read as an array too
_KEY_AND_EXTENSION = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # webdataset's own rule: key up to the first dot


@dataclass
class Shard:
    name: str
    bytes: int
    sha256: str
    offsets: list[int]  # each sample's first tar header
    end: int  # where the last sample's bytes end (the end-of-archive blocks follow)
    blocks: list[tuple[int, str]]  # (first sample, sha256 of the block's bytes)

    @classmethod
    def from_dict(cls, entry: dict) -> Shard:
        """A shard's entry as JSON gives it back (its blocks as lists)."""
        return cls(**{**entry, "blocks": [tuple(block) for block in entry["blocks"]]})

    @property
    def samples(self) -> int:
        return len(self.offsets)

    def sample_span(self, position: int) -> tuple[int, int]:
        end = self.offsets[position + 1] if position + 1 < len(self.offsets) else self.end
        return self.offsets[position], end

    def block_of(self, position):
        """The block holding the sample at `position` (or, for an array of positions, each one's)."""
        found = np.searchsorted(self._block_starts, position, side="right") - 1
        return int(found) if np.ndim(found) == 0 else found

    def block_span(self, block: int) -> tuple[int, int]:
        """The bytes [start, end) of a block."""
        first = self.blocks[block][0]
        start = self.offsets[first]
        end = self.offsets[self.blocks[block + 1][0]] if block + 1 < len(self.blocks) else self.end
        return start, end

    @property
    def _block_starts(self) -> np.ndarray:
        starts = self.__dict__.get("_starts")
        if starts is None:
            starts = self.__dict__["_starts"] = np.array([first for first, _ in self.blocks])
        return starts


@dataclass
class SplitIndex:
    split: str
    shards: list[Shard]
    classes: list[str] | None
    num_classes: int | None
    channels: int
    image_size: int | None  # the images' side when all are square and alike, else None
    mean: list[float] | None
    std: list[float] | None
    transforms: str
    source: str  # what the shards were written from, for people
    block_bytes: int = BLOCK_BYTES
    settings: dict | None = None  # what `accel-train shard` wrote them with: a rerun compares
    images: str = "as_given"  # one of IMAGE_STORAGE
    shrink_to: int | None = None  # images with a longer short side were resized to this one before storing
    format: str = FORMAT
    hash: str = field(default="", compare=False)  # sha256 of the index file's bytes (not stored in it)

    @property
    def samples(self) -> int:
        return sum(shard.samples for shard in self.shards)

    @property
    def bytes(self) -> int:
        return sum(shard.bytes for shard in self.shards)

    def shard_starts(self) -> np.ndarray:
        """The id of each shard's first sample, and the total at the end: sample ids count through the shards in
        the index's order."""
        return np.concatenate([[0], np.cumsum([shard.samples for shard in self.shards])]).astype(np.int64)

    def to_json(self) -> bytes:
        body = {key: value for key, value in asdict(self).items() if key != "hash"}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> SplitIndex:
        body = json.loads(data)
        if body.get("format") != FORMAT:
            raise ValueError(f"format {body.get('format')!r}, not {FORMAT!r}")
        shards = [Shard.from_dict(shard) for shard in body.pop("shards")]
        return cls(**body, shards=shards, hash=hashlib.sha256(data).hexdigest())


def square_side(sizes: set[tuple[int, int]]) -> int | None:
    """The side of images whose (width, height) `sizes` are all one square, else None."""
    if len(sizes) != 1:
        return None
    width, height = next(iter(sizes))
    return width if width == height else None


def padded(size: int) -> int:
    """The bytes a member's contents of `size` take in a tar: whole 512-byte blocks."""
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def split_key(name: str) -> tuple[str, str] | None:
    """(key, extension) of a tar member the way webdataset groups them, or None for a name without an extension."""
    found = _KEY_AND_EXTENSION.match(name)
    return (found.group(1), found.group(2).lower()) if found else None


def tar_of(samples: Iterable[tuple[str, dict[str, bytes]]]) -> bytes:
    """A tar of the samples, each as KEY.EXT members in extension order (as webdataset's TarWriter writes them),
    with fixed metadata so that the same samples always make the same bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples:
            for extension in sorted(members):
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size, info.mode, info.mtime = len(members[extension]), 0o444, 0
                tar.addfile(info, io.BytesIO(members[extension]))
    return buffer.getvalue()


def index_tar(name: str, data: bytes, block_bytes: int = BLOCK_BYTES) -> tuple[Shard, list]:
    """The shard's entry in the index, and each sample's label (from KEY.cls, or a JSON's "cls"/"label"), read from
    the tar's own headers: any tar webdataset reads (members of a sample next to each other)."""
    offsets, labels, key, end = [], [], None, 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            parts = split_key(member.name)
            if parts is None:
                continue
            if parts[0] != key:
                key = parts[0]
                offsets.append(member.offset)
                labels.append(None)
            if parts[1] in ("cls", "json"):
                labels[-1] = label_of(parts[1], data[member.offset_data:member.offset_data + member.size])
            end = member.offset_data + padded(member.size)
    if end + 2 * tarfile.BLOCKSIZE > len(data):  # tarfile stops quietly at a tar cut short: samples would go missing
        raise ValueError(f"cut short: its members end at byte {end:,} of {len(data):,}, without the tar's end blocks")
    firsts = []  # each block's first sample: a block closes once it holds block_bytes
    for position, offset in enumerate(offsets):
        if not firsts or offset - offsets[firsts[-1]] >= block_bytes:
            firsts.append(position)
    bounds = [offsets[first] for first in firsts] + [end]
    blocks = [(first, hashlib.sha256(data[bounds[number]:bounds[number + 1]]).hexdigest())
              for number, first in enumerate(firsts)]
    shard = Shard(name, len(data), hashlib.sha256(data).hexdigest(), offsets, end, blocks)
    return shard, labels


def raw_pixels(image) -> bytes:
    """A uint8 (C, H, W) image tensor as the bytes of KEY.pixels.npy."""
    buffer = io.BytesIO()
    np.save(buffer, image.contiguous().numpy(), allow_pickle=False)
    return buffer.getvalue()


def pixels_of(payload: bytes) -> np.ndarray:
    """KEY.pixels.npy's bytes as a uint8 (C, H, W) array (a read-only view of them).

    np.load parses each header with Python's literal_eval (about 100 us, ten times the rest of a 28 px sample's
    way): a header is parsed once here, and samples of one shape share it."""
    version = payload[6:7]
    size = 2 if version == b"\x01" else 4
    start = 8 + size + int.from_bytes(payload[8:8 + size], "little")
    return np.frombuffer(payload, np.uint8, offset=start).reshape(_uint8_shape(payload[:start]))


@functools.lru_cache(maxsize=256)
def _uint8_shape(header: bytes) -> tuple[int, ...]:
    """The shape a .npy header gives, by numpy's own reader; refused unless it holds uint8 in C order."""
    with io.BytesIO(header) as file:
        major, _ = np.lib.format.read_magic(file)
        read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, fortran_order, dtype = read(file)
    if dtype != np.uint8 or fortran_order and len(shape) > 1:
        raise ValueError(f"pixels of {dtype} ({'Fortran' if fortran_order else 'C'} order), not uint8 in C order")
    return shape


def label_of(extension: str, payload: bytes):
    if extension == "cls":
        return int(payload.decode().strip())
    value = json.loads(payload)
    if isinstance(value, dict):
        value = value.get("cls", value.get("label"))
    return value


def sample_members(blob: bytes) -> dict[str, bytes]:
    """The members of one sample's bytes (its tar headers and contents), by extension.

    Plain ustar headers are read directly (a quarter of a sample's decoding time through tarfile); a header of
    another kind (pax, GNU long names) goes through tarfile."""
    members, offset, view = {}, 0, memoryview(blob)
    while offset + tarfile.BLOCKSIZE <= len(blob):
        header = blob[offset:offset + tarfile.BLOCKSIZE]
        kind = header[156:157]
        if not header.strip(b"\0"):
            break
        if kind not in (b"0", b"\0") or header[257:262] != b"ustar":
            return _members_through_tarfile(blob)
        name = header[:100].rstrip(b"\0").decode()
        prefix = header[345:500].rstrip(b"\0").decode()
        size = int(header[124:136].rstrip(b"\0 ") or b"0", 8)
        start = offset + tarfile.BLOCKSIZE
        parts = split_key(f"{prefix}/{name}" if prefix else name)
        if parts is not None:
            members[parts[1]] = bytes(view[start:start + size])
        offset = start + padded(size)
    return members


def _members_through_tarfile(blob: bytes) -> dict[str, bytes]:
    members = {}
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
        for member in tar:
            parts = split_key(member.name) if member.isfile() else None
            if parts is not None:
                members[parts[1]] = tar.extractfile(member).read()
    return members
