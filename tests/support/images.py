"""Image folders the data tests build their runs on."""

from __future__ import annotations

from pathlib import Path

import torch


def noise_jpeg_tree(root: Path) -> str:
    """An ImageFolder of 24 noise JPEGs of 20 px, one a class, train/ and test/: an ImageFolder's label is then the
    image's index."""
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    for split in ("train", "test"):
        for index in range(24):
            folder = root / split / f"c{index:02d}"
            folder.mkdir(parents=True)
            pixels = torch.randint(0, 256, (20, 20, 3), dtype=torch.uint8, generator=generator)
            Image.fromarray(pixels.numpy()).save(folder / "image.jpg", quality=90)
    return str(root)


def png_bomb(path: Path, side: int = 20_000) -> Path:
    """A PNG of side x side black pixels of one bit each (grey): about 50 kB on disk at 20,000 px, 1.2 GB as the RGB
    a decoder makes of it. Written a row at a time by zlib: PIL would hold the whole image first, a byte a pixel."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows, row = zlib.compressobj(9), b"\0" * (1 + -(-side // 8))  # each row: filter type 0, then its bits
    pixels = b"".join(rows.compress(row) for _ in range(side)) + rows.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1 bit, grey, deflate, no filter set, no interlace
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))
    return path
