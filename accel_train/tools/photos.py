"""An ImageNet-shaped folder of JPEG photographs made offline (`accel-train photos OUT`), for trying the imagefolder
recipe, for the input-pipeline bench and for tests.

Debian's `mate-backgrounds` (and `ukui-wallpapers`) put photographs under /usr/share/backgrounds (`make data`
installs the first). Each image of the folder is a seeded random crop of one of them, at a random scale, 400 to
600 px wide and 0.6 to 1 times as high (ImageNet's typical 500x375, and its spread), saved at JPEG quality 90;
its class is the photograph it was cut from. The same seed and counts make the same files.

The folder's photos.json records the recipe it was made with and every file written: a folder of the same recipe is
kept as it is, in one of another recipe only those files are made again, and a folder holding anything else is
refused: nothing this command did not write is ever deleted.
"""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path

from accel_train.errors import DataNotFoundError, UserError, writing
from accel_train.storage import refuse_no_folder

logger = logging.getLogger(__name__)

PHOTO_FOLDERS = (Path("/usr/share/backgrounds/mate/nature"), Path("/usr/share/backgrounds/ukui"))
WIDTHS, HEIGHT_RATIOS, QUALITY = (400, 600), (0.6, 1.0), 90
RECORD = "photos.json"
OUR_NAME = re.compile(r"(train|test)/[^/]+/(train|test)_\d{6}\.jpg")
WRITABLE = "give a folder you can write to"


def source_photos(folders: tuple[Path, ...] = PHOTO_FOLDERS) -> list[Path]:
    """The photographs to cut from: the JPEGs of those folders, sorted (the same list on every machine with them)."""
    return sorted(path for folder in folders if folder.is_dir() for path in folder.iterdir()
                  if path.suffix.lower() in (".jpg", ".jpeg"))


def make_photo_folder(root: Path, train: int, test: int, seed: int = 0) -> Path:
    """root/train/<photo>/*.jpg and root/test/<photo>/*.jpg; kept as it is when a folder of the same recipe is there,
    its own files made again when one of another recipe is."""
    root = Path(root).expanduser()
    photos = source_photos()
    # as JSON reads it back (lists, not tuples), so that the recipe photos.json records compares equal to it
    recipe = json.loads(json.dumps({"train": train, "test": test, "seed": seed, "widths": WIDTHS,
                                    "height_ratios": HEIGHT_RATIOS, "quality": QUALITY,
                                    "photos": [path.name for path in photos]}))
    recorded = recorded_files(root)
    if recorded is not None and recorded[0] == recipe and all((root / name).is_file() for name in recorded[1]):
        logger.info(f"photos: {root} already holds these photographs (the same counts and seed): kept as it is")
        return root
    if not photos:
        raise DataNotFoundError(f"no photographs in {' or '.join(map(str, PHOTO_FOLDERS))} to make an image folder "
                                "of: apt-get install mate-backgrounds (make data does), or give data.root=FOLDER")
    from PIL import Image

    planned = planned_files(recipe)
    old = recorded[1] if recorded is not None else []
    if recorded is not None:
        refuse_others_files(root, old)
    with writing(root, "making a folder of photographs", WRITABLE):
        record(root, None, sorted({*old, *planned}))  # a crash from here on leaves a folder whose files are all known
        for name in sorted(set(old) - set(planned)):
            remove_with_empty_folders(root, name)
    if recorded is not None:
        logger.info(f"photos: {root} holds photographs of other counts or another seed: making them again (only the "
                    "files this command wrote there)")
    rng = random.Random(seed)
    opened: dict[Path, Image.Image] = {}
    for name, index in planned.items():
        photo = photos[index]
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
        with writing(root / name, "making a folder of photographs", WRITABLE):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            image.save(root / name, quality=QUALITY)
    with writing(root, "making a folder of photographs", WRITABLE):
        record(root, recipe, list(planned))
    return root


def planned_files(recipe: dict) -> dict[str, int]:
    """{file under the folder: the index in recipe["photos"] of the photograph it is cut from}, in the order they are
    drawn: as many classes as the smaller split can hold one image of each, so that every class is evaluated."""
    photos = recipe["photos"]
    classes = max(1, min(len(photos), recipe["train"], recipe["test"] or recipe["train"]))
    return {f"{split}/{Path(photos[number % classes]).stem.lower()}/{split}_{number:06d}.jpg": number % classes
            for split in ("train", "test") for number in range(recipe[split])}


def recorded_files(root: Path) -> tuple[dict | None, list[str]] | None:
    """(the recipe, the files) photos.json records of a folder this command made; None for a new or empty folder.
    A place that is not a folder, or a folder this command did not make, is refused in one line."""
    refuse_no_folder(root, f"photos: {root}")
    if not root.is_dir():
        return None
    try:
        written = json.loads((root / RECORD).read_text())
    except (OSError, ValueError):
        written = None
    if isinstance(written, dict) and "files" not in written:  # recorded before files were: its recipe names them
        try:
            written = {"recipe": written, "files": list(planned_files(written))}
        except (KeyError, TypeError, IndexError):
            written = None
    # only names of the form this command writes: a record naming ../x must not make it delete x
    if not (isinstance(written, dict) and isinstance(written.get("files"), list)
            and all(isinstance(name, str) and OUR_NAME.fullmatch(name) for name in written["files"])):
        entry = min(root.iterdir(), default=None)
        if entry is None:
            return None
        raise UserError(f"photos: {root} holds {entry.name}{'/' if entry.is_dir() else ''} and is not a folder of "
                        "photographs this command made; give a new folder")
    return written.get("recipe"), written["files"]


def refuse_others_files(root: Path, files: list[str]) -> None:
    """Before a folder this command made is written again: one line naming a file in it that it did not write."""
    ours = {RECORD, *files}
    foreign = next((path for path in sorted(root.rglob("*")) if (not path.is_dir() or path.is_symlink())
                    and path.relative_to(root).as_posix() not in ours), None)
    if foreign is not None:
        raise UserError(f"photos: {root} holds {foreign.relative_to(root)}, which this command did not write; move it "
                        "away, or give a new folder")


def record(root: Path, recipe: dict | None, files: list[str]) -> None:
    """photos.json: the recipe (None while files are being written) and every file this command wrote there."""
    root.mkdir(parents=True, exist_ok=True)
    (root / RECORD).write_text(json.dumps({"recipe": recipe, "files": files}, indent=1) + "\n")


def remove_with_empty_folders(root: Path, name: str) -> None:
    """A file this command wrote, and the folders above it (below root) that it leaves empty."""
    (root / name).unlink(missing_ok=True)
    folder = (root / name).parent
    while folder != root and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent
