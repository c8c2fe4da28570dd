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
