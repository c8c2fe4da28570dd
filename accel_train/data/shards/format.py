"""The shard format: WebDataset tar shards (`KEY.png` or `KEY.jpg` or `KEY.npy`, with `KEY.cls` or `KEY.json`, per
sample) and one index per split (`SPLIT/index.json`).

The index lists each shard's name, size, sample count and sha256, each sample's byte offset inside its tar (so one
sample is read without the bytes before it), and the shard's blocks: runs of whole samples of about `block_bytes`,
each with its own sha256, the unit a node downloads, verifies and caches. It also records what a model needs to
know of the data (classes, normalisation, channels, native image size) and which transforms its samples take.
Tars written by `webdataset` are indexed by `accel-train shard index` and train the same way.

An index is data from a store others may write to, so it is checked where it is read (Shard.check) and its offsets
again against the tar's own headers where a sample is read (sample_members): a damaged or forged index is one line,
never a file outside the cache, a traceback, or another sample's bytes.
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
_SHA256 = re.compile(r"[0-9a-f]{64}")  # as hashlib's hexdigest writes it
_SHARD_NAME = re.compile(r"[^/\\\0]+")  # a file of the split's folder, not a path (".." apart, checked too)


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
        """A shard's entry as JSON gives it back (its blocks as lists), checked."""
        shard = cls(**{**entry, "blocks": [tuple(block) for block in entry["blocks"]]})
        shard.check()
        return shard

    def check(self) -> None:
        """A ValueError naming the shard (and the sample or block) where this entry cannot describe a tar: its name
        is a file of the split's folder; its hashes are sha256 hex digits (a block's names its file in the cache);
        its offsets, each a tar header's place, rise a sample at a time within the samples' bytes, which end before
        the tar's two end blocks; its blocks start at samples, the first at the first. What only the tar's bytes
        can show (a header at each offset, members of one sample between two) is checked as a sample is read."""
        where = f"shard {self.name!r}"
        if not isinstance(self.name, str) or not _SHARD_NAME.fullmatch(self.name) or self.name in (".", ".."):
            raise ValueError(f"{where}: not the name of a file in its split's folder")
        if not is_sha256(self.sha256):
            raise ValueError(f"{where}: its sha256 {self.sha256!r} is not 64 lowercase hex digits")
        if not (_at_block(self.end) and _whole(self.bytes)) or self.end + 2 * tarfile.BLOCKSIZE > self.bytes:
            raise ValueError(f"{where}: its samples end at byte {self.end!r}, which is not a tar block's start two "
                             f"blocks or more before the end of its {self.bytes!r} bytes")
        previous = None
        for position, offset in enumerate(self.offsets):
            if not _at_block(offset) or previous is not None and offset <= previous or offset >= self.end:
                after = f"after sample {position - 1}'s {previous} and " if previous is not None else ""
                raise ValueError(f"{where}, sample {position}: its offset {offset!r} is not a tar block's start "
                                 f"{after}before the samples' end at {self.end}")
            previous = offset
        previous = None
        for number, block in enumerate(self.blocks):
            first, sha256 = block if len(block) == 2 else (None, None)
            in_order = _whole(first) and (first == 0 if previous is None else first > previous)
            if not (in_order and first < self.samples):
                after = "0" if previous is None else f"after block {number - 1}'s {previous}"
                raise ValueError(f"{where}, block {number}: its first sample {first!r} is not {after} and below the "
                                 f"shard's {self.samples} samples")
            if not is_sha256(sha256):
                raise ValueError(f"{where}, block {number}: its sha256 {sha256!r} is not 64 lowercase hex digits")
            previous = first
        if self.offsets and not self.blocks:
            raise ValueError(f"{where}: its {self.samples} samples lie in no block")

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


def is_sha256(value) -> bool:
    """Whether `value` is a sha256 as an index holds it: 64 lowercase hex digits (so a plain file name as well)."""
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def _whole(value) -> bool:
    return type(value) is int and value >= 0  # JSON's true is an int to Python, and 512.0 slices nothing


def _at_block(value) -> bool:
    """A byte offset where a tar header may start: whole 512-byte blocks from the tar's start."""
    return _whole(value) and value % tarfile.BLOCKSIZE == 0


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
    """The members of one sample's bytes (its tar headers and contents), by extension. A ValueError where they are not
    one sample's members laid end to end, as the index's offsets say they are: no tar header at the sample's offset,
    a member running past the next sample's, members of two keys (an offset missing from the index), or bytes left
    over; so an index that does not match its tar never gives a sample another one's bytes.

    Plain ustar headers are read directly (a quarter of a sample's decoding time through tarfile); a header of
    another kind (pax, GNU long names), or none, goes through tarfile."""
    members, offset, view, key = {}, 0, memoryview(blob), None
    while offset < len(blob):
        header = blob[offset:offset + tarfile.BLOCKSIZE]
        if header[156:157] not in (b"0", b"\0") or header[257:262] != b"ustar":
            return _members_through_tarfile(blob)
        name = header[:100].rstrip(b"\0").decode()
        prefix = header[345:500].rstrip(b"\0").decode()
        size = int(header[124:136].rstrip(b"\0 ") or b"0", 8)
        start = offset + tarfile.BLOCKSIZE
        parts = _of_the_sample(key, f"{prefix}/{name}" if prefix else name, start + size, len(blob))
        if parts is not None:
            key, extension = parts
            members[extension] = bytes(view[start:start + size])
        offset = start + padded(size)
    return members


def _of_the_sample(key: str | None, name: str, end: int, length: int) -> tuple[str, str] | None:
    """(key, extension) of member `name` (webdataset's split_key), whose contents end at byte `end` of a sample's
    `length` bytes, once it is found to be of the sample of `key` (None: its first member)."""
    if end > length:
        raise ValueError(f"its member {name} runs to byte {end:,} of the {length:,} up to the next sample's offset")
    parts = split_key(name)
    if parts is not None and key is not None and parts[0] != key:
        raise ValueError(f"its bytes hold members of two samples, {key} and {parts[0]} (an offset missing from the "
                         "index)")
    return parts


def _members_through_tarfile(blob: bytes) -> dict[str, bytes]:
    members, key, end = {}, None, 0
    try:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
            for member in tar:
                end = member.offset_data + padded(member.size)
                parts = _of_the_sample(key, member.name, member.offset_data + member.size, len(blob)) \
                    if member.isfile() else None
                if parts is not None:
                    key, extension = parts
                    members[extension] = tar.extractfile(member).read()
    except tarfile.TarError as err:
        raise ValueError(f"no tar member at its offset ({err})") from None
    if end != len(blob):  # tarfile stops quietly at an end block, or at the end of the bytes
        raise ValueError(f"{len(blob) - end:,} of its {len(blob):,} bytes hold no member of it (the index's offsets "
                         "do not match its tar)")
    return members
