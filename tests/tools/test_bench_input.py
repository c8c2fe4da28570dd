"""Contracts of `accel-train bench --input` and of the folder of photographs it (and tests) make offline: every way
of feeding a step from image files measured on the same files, at one core and at all, with the cores a GPU needs.

The numbers are not judged: timings belong to the bench, not to tests."""

import hashlib
import json
import shutil

import pytest
from PIL import Image

from support.commands import run_cli
from support.locations import needs_photos


def digest(root) -> dict[str, str]:
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*.jpg"))}


@needs_photos
def test_a_folder_of_photographs_is_imagenet_shaped_the_same_for_the_same_seed_and_has_every_class_in_both_splits(
        tmp_path):
    from accel_train.tools.photos import make_photo_folder

    first = make_photo_folder(tmp_path / "a", train=10, test=5, seed=3)
    again = make_photo_folder(tmp_path / "b", train=10, test=5, seed=3)
    other = make_photo_folder(tmp_path / "c", train=10, test=5, seed=4)
    assert digest(first) == digest(again) and digest(first) != digest(other)
    train, test = (sorted(path.name for path in (first / split).iterdir()) for split in ("train", "test"))
    assert train == test and len(train) == 5  # as many classes as the test split holds an image of each
    sizes = [Image.open(path).size for path in first.rglob("*.jpg")]
    assert len(sizes) == 15 and all(400 <= width <= 600 and 0.6 * width - 1 <= height <= width + 1
                                    for width, height in sizes), sizes
    assert all(Image.open(path).format == "JPEG" for path in first.rglob("*.jpg"))


@needs_photos
def test_bench_input_measures_every_way_on_the_same_files_at_one_core_and_at_all(tmp_path):
    """On a folder with a training split alone, among whose images lie files that are none (a README, macOS's
    .DS_Store): the files training reads, and no others."""
    from accel_train.tools.photos import make_photo_folder

    photos = make_photo_folder(tmp_path / "photos", train=12, test=4)
    shutil.rmtree(photos / "test")
    (photos / "train" / "README.txt").write_text("photographs from Debian's mate-backgrounds\n")
    next((photos / "train").iterdir()).joinpath(".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    result = run_cli("bench", "--input", "--steps", "2", "--demand", "1000", "train.batch_size=4",
                     f"data.root={photos}", f"output_dir={tmp_path}", timeout=600)
    bench = json.loads((tmp_path / "bench_input.json").read_text())
    measured = [row for row in bench["rows"] if "all_cores" in row]
    starts = ["decoding alone", "torchvision's recipe", "accel-train ImageFolder, JPEGs decoded at full size (data."
              "decode=full)", "accel-train ImageFolder, JPEGs decoded at the scale the crop needs (data.decode=scaled)",
              "accel-train shards of that folder",
              "accel-train shards, JPEG shrunk to a short side of 256 px", "accel-train shards, raw pixels at a short "
              "side of 256 px", "webdataset's loader"]
    assert len(measured) == len(starts) and all(row["path"].startswith(start) for row, start in zip(measured, starts))
    assert all(row["one_core"] > 0 and row["all_cores"] > 0 for row in measured), measured
    for row in measured:  # images per core at all cores, and the cores that feed the stated demand
        assert row["per_core"] == pytest.approx(row["all_cores"] / bench["cores"])
        assert row["cores_per_gpu"] == pytest.approx(1000 / row["per_core"])
    named = {row["path"]: row["note"] for row in bench["rows"] if "all_cores" not in row}
    assert set(named) == {"litdata's loader", "NVIDIA DALI's CPU pipeline"} and all(named.values())
    assert bench["files"] == 12 and bench["root"] == str(photos)
    markdown = (tmp_path / "bench_input.md").read_text()
    assert markdown in result.stdout and "cores per GPU at 1,000 img/s" in markdown


def test_demand_without_input_is_refused_in_one_line(capsys):
    from accel_train import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "--demand", "2000"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == ("accel-train: error: bench: --demand 2000 goes with --input (the input "
                                               "bench); add --input, or leave it out")


def test_a_demand_of_zero_or_less_is_refused_in_one_line(capsys):
    from accel_train import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "--input", "--demand", "0"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == ("accel-train: error: bench: --demand 0: give the images per second a "
                                               "GPU takes, above 0 (ResNet-50 at 224 px on one A100: about 2470)")


@needs_photos
def test_accel_train_photos_makes_the_folder_and_never_writes_over_one_it_did_not_make(tmp_path, capsys):
    from accel_train import cli

    cli.main(["photos", str(tmp_path / "photos"), "--train", "12", "--test", "4", "--seed", "3"])

    assert capsys.readouterr().out == (f"{tmp_path / 'photos'}: 12 training and 4 test photographs; train on them "
                                       f"with: accel-train train imagefolder data.root={tmp_path / 'photos'}\n")
    assert len(list((tmp_path / "photos").rglob("*.jpg"))) == 16
    (tmp_path / "mine" / "cat").mkdir(parents=True)
    with pytest.raises(SystemExit) as refused:
        cli.main(["photos", str(tmp_path / "mine")])
    assert refused.value.code == 2 and (tmp_path / "mine" / "cat").is_dir()
    assert capsys.readouterr().err == (f"accel-train: error: photos: {tmp_path / 'mine'} holds cat/ and is not a "
                                       "folder of photographs this command made; give a new folder\n")
