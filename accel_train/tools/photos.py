"""An ImageNet-shaped folder of JPEG photographs made offline (`accel-train photos OUT`), for trying the imagefolder
recipe, for the input-pipeline bench and for tests.

Debian's `mate-backgrounds` (and `ukui-wallpapers`) put photographs under /usr/share/backgrounds (`make data`
installs the first). Each image of the folder is a seeded random crop of one of them, at a random scale, 400 to
600 px wide and 0.6 to 1 times as high (ImageNet's typical 500x375, and its spread), saved at JPEG quality 90;
its class is the photograph it was cut from. The same seed and counts make the same files.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from accel_train.errors import DataNotFoundError, UserError

PHOTO_FOLDERS = (Path("/usr/share/backgrounds/mate/nature"), Path("/usr/share/backgrounds/ukui"))
WIDTHS, HEIGHT_RATIOS, QUALITY = (400, 600), (0.6, 1.0), 90


def source_photos(folders: tuple[Path, ...] = PHOTO_FOLDERS) -> list[Path]:
    """The photographs to cut from: the JPEGs of those folders, sorted (the same list on every machine with them)."""
    return sorted(path for folder in folders if folder.is_dir() for path in folder.iterdir()
                  if path.suffix.lower() in (".jpg", ".jpeg"))


def make_photo_folder(root: Path, train: int, test: int, seed: int = 0) -> Path:
    """root/train/<photo>/*.jpg and root/test/<photo>/*.jpg; kept when a folder of the same recipe is there."""
    root = Path(root)
    photos = source_photos()
    recipe = {"train": train, "test": test, "seed": seed, "photos": [path.name for path in photos],
              "widths": WIDTHS, "height_ratios": HEIGHT_RATIOS, "quality": QUALITY}
    marker = root / "photos.json"
    if marker.is_file() and json.loads(marker.read_text()) == recipe:
        return root
    if root.is_dir() and any(root.iterdir()) and not marker.is_file():  # never written over: it is not ours
        raise UserError(f"photos: {root} holds files already, and is not a folder of photographs this command made; "
                        "give a new folder")
    if not photos:
        raise DataNotFoundError(f"no photographs in {' or '.join(map(str, PHOTO_FOLDERS))} to make an image folder "
                                "of: apt-get install mate-backgrounds (make data does), or give data.root=FOLDER")
    from PIL import Image

    shutil.rmtree(root, ignore_errors=True)
    rng = random.Random(seed)
    opened: dict[Path, Image.Image] = {}
    # as many classes as the smaller split can hold one image of each: every class is evaluated
    classes = photos[:max(1, min(len(photos), train, test or train))]
    for split, count in (("train", train), ("test", test)):
        for number in range(count):
            photo = classes[number % len(classes)]
            source = opened.get(photo) or opened.setdefault(photo, Image.open(photo).convert("RGB"))
            width = rng.randint(*WIDTHS)
            height = round(width * rng.uniform(*HEIGHT_RATIOS))
            # the crop: the output's aspect, from its own size up to the largest that fits, anywhere in the photo
            largest = min(source.width, source.height * width / height)
            crop_width = rng.uniform(min(width, largest), largest)
            crop_height = crop_width * height / width
            left = rng.uniform(0, source.width - crop_width)
            top = rng.uniform(0, source.height - crop_height)
            image = source.resize((width, height), Image.Resampling.BICUBIC,
                                  box=(left, top, left + crop_width, top + crop_height))
            folder = root / split / photo.stem.lower()
            folder.mkdir(parents=True, exist_ok=True)
            image.save(folder / f"{split}_{number:06d}.jpg", quality=QUALITY)
    marker.write_text(json.dumps(recipe, indent=1) + "\n")
    return root
