"""Contracts of `accel-train photos OUT`: it deletes only what it wrote. A folder of the same recipe is kept as it is
(one line says so); in a folder of another recipe only the files it recorded are made again; a folder holding
anything it did not write is refused in one line naming one such file, and so is a place that cannot be a folder (a
file, a link to one or to nothing, a path below a file); a read-only place is one line, exit 74."""

import hashlib
import json

import pytest

from accel_train import cli
from support.locations import needs_photos

pytestmark = needs_photos


def photos(capsys, folder, *options: str) -> tuple[int, str, str]:
    """`accel-train photos FOLDER OPTIONS`: (exit code, stdout, stderr)."""
    try:
        cli.main(["photos", str(folder), *options])
        code = 0
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def files_of(folder) -> dict[str, tuple[int, str]]:
    """{file: (mtime_ns, sha256)} of every file under `folder`."""
    return {path.relative_to(folder).as_posix(): (path.stat().st_mtime_ns,
                                                  hashlib.sha256(path.read_bytes()).hexdigest())
            for path in sorted(folder.rglob("*")) if path.is_file()}


def test_photos_again_with_the_same_recipe_keeps_the_folder_as_it_is_and_says_so(tmp_path, capsys):
    assert photos(capsys, tmp_path / "p", "--train", "4", "--test", "2")[0] == 0
    (tmp_path / "p" / "NOTES.txt").write_text("mine")
    made = files_of(tmp_path / "p")

    code, out, err = photos(capsys, tmp_path / "p", "--train", "4", "--test", "2")

    assert code == 0 and err == ""
    assert out.splitlines()[0] == (f"photos: {tmp_path / 'p'} already holds these photographs (the same counts and "
                                   "seed): kept as it is")
    assert files_of(tmp_path / "p") == made  # not one file written again, the user's left


def test_photos_with_another_recipe_makes_again_only_the_files_it_recorded(tmp_path, capsys):
    """6 and 3 photographs (three classes), then 4 and 2 (two): the third class's files and folders go, and the
    folder is the one a first run of 4 and 2 makes; one the old version recorded (its recipe alone) is taken too."""
    photos(capsys, tmp_path / "p", "--train", "6", "--test", "3")
    photos(capsys, tmp_path / "fresh", "--train", "4", "--test", "2")

    code, out, _ = photos(capsys, tmp_path / "p", "--train", "4", "--test", "2")

    assert code == 0 and "making them again (only the files this command wrote there)" in out
    digests = {name: digest for name, (_, digest) in files_of(tmp_path / "p").items() if name != "photos.json"}
    assert digests == {name: digest for name, (_, digest) in files_of(tmp_path / "fresh").items()
                       if name != "photos.json"}
    assert sorted(path.name for path in (tmp_path / "p" / "train").iterdir()) == \
        sorted(path.name for path in (tmp_path / "fresh" / "train").iterdir())  # the third class's folder went too
    recorded = tmp_path / "p" / "photos.json"
    recorded.write_text(json.dumps(json.loads(recorded.read_text())["recipe"]))  # as photos.json was before files
    assert photos(capsys, tmp_path / "p", "--train", "6", "--test", "3")[0] == 0
    assert len(list((tmp_path / "p").rglob("*.jpg"))) == 9


def test_a_folder_photos_made_that_holds_a_users_file_is_refused_in_one_line_naming_it_and_left_as_it_is(
        tmp_path, capsys):
    photos(capsys, tmp_path / "p", "--train", "4", "--test", "2")
    (tmp_path / "p" / "train" / "mine.txt").write_text("mine")
    before = files_of(tmp_path / "p")

    code, out, err = photos(capsys, tmp_path / "p", "--train", "6", "--test", "2")

    assert code == 2 and out == ""
    assert err == (f"accel-train: error: photos: {tmp_path / 'p'} holds train/mine.txt, which this command did not "
                   "write; move it away, or give a new folder\n")
    assert files_of(tmp_path / "p") == before


@pytest.mark.parametrize("place, line", [
    ("file", "photos: {tmp}/file is a file, not a folder; give a new folder"),
    ("link_to_file", "photos: {tmp}/link_to_file is a link to a file, not a folder; give a new folder"),
    ("link_to_nothing", "photos: {tmp}/link_to_nothing is a link to {tmp}/gone, which is not there; give a folder"),
    ("file/sub", "photos: {tmp}/file/sub: {tmp}/file is a file, so no folder can be made below it; give another "
                 "folder"),
])
def test_photos_where_no_folder_can_be_is_one_line_and_makes_nothing(tmp_path, capsys, place, line):
    (tmp_path / "file").write_text("mine")
    (tmp_path / "link_to_file").symlink_to(tmp_path / "file")
    (tmp_path / "link_to_nothing").symlink_to(tmp_path / "gone")
    before = sorted(tmp_path.rglob("*"))

    code, out, err = photos(capsys, tmp_path / place, "--train", "2", "--test", "1")

    assert (code, out, err) == (2, "", f"accel-train: error: {line.format(tmp=tmp_path)}\n")
    assert sorted(tmp_path.rglob("*")) == before and (tmp_path / "file").read_text() == "mine"


def test_photos_into_a_read_only_place_is_one_line_exit_74(small_disk, capsys):
    disk = small_disk("1m", readonly=True)

    code, out, err = photos(capsys, disk / "p", "--train", "2", "--test", "1")

    assert (code, out) == (74, "")
    assert err == (f"accel-train: error: cannot write {disk / 'p'} while making a folder of photographs (read-only "
                   "file system); give a folder you can write to\n")


def test_a_record_naming_a_file_outside_the_folder_deletes_nothing_and_is_one_line(tmp_path, capsys):
    """photos.json is a file in the user's folder: one that names ../x (edited, or not this command's) is no record
    of photos' own files, and x outlives it."""
    photos(capsys, tmp_path / "p", "--train", "2", "--test", "1")
    (tmp_path / "x.jpg").write_text("mine")
    record = json.loads((tmp_path / "p" / "photos.json").read_text())
    (tmp_path / "p" / "photos.json").write_text(json.dumps({**record, "files": [*record["files"], "../x.jpg"]}))

    code, out, err = photos(capsys, tmp_path / "p", "--train", "4", "--test", "2")

    assert (code, out) == (2, "") and (tmp_path / "x.jpg").read_text() == "mine"
    assert err == (f"accel-train: error: photos: {tmp_path / 'p'} holds photos.json and is not a folder of photographs "
                   "this command made; give a new folder\n")
