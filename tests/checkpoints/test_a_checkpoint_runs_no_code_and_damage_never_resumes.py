"""Contracts of reading a checkpoint (run/resume.py): nothing in it runs code when it is read, whoever wrote its files,
and damage is never resumed silently. Every file is checked against the manifest (checkpoint.json: size and sha256)
before any is read; every part is read from safetensors or with weights_only (the EMA is accel-train's own
safetensors file, not Accelerate's custom-object pickle, which Accelerate loads with weights_only=False); a part that
does not load (random states included, which Accelerate would skip with a line at info level) is damage: the previous
checkpoint resumes, with one warning naming it.

A small run with an EMA in this process: checkpoints of steps 2 and 4. A file of step 4 is replaced by a pickle that
would create a marker file when unpickled, padded to the file's own size (the size check alone would pass it); then
also with the manifest rewritten to match it, as anyone who can write the run folder could."""

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from accel_train.errors import UserError
from accel_train.run.checkpoint_files import list_checkpoints
from support.commands import train_in_process
from support.runs import read_metrics

SMALL = ["mnist_cnn", "data.synthetic=true", "data.train_subset=36", "data.eval_subset=10", "train.batch_size=12",
         "train.max_steps=4", "train.log_every_steps=1", "checkpoint.every_steps=2", "checkpoint.at_epoch_end=false",
         "checkpoint.keep_last=5", "train.ema_decay=0.9", "train.plot=false"]
FILES = ["model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "ema.safetensors",
         "loop_state_0.json"]


class RunsCode:
    """Unpickled, it runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("small") / "run"
    train_in_process(*SMALL, f"output_dir={out}")
    return out


def newest_two(out: Path) -> tuple[Path, Path]:
    (previous, _), (newest, _) = list_checkpoints(out / "checkpoints")[-2:]
    return previous, newest


def replace_by_code(path: Path, marker: Path) -> None:
    """`path` becomes a pickle that runs code, padded to the file's own size (pickle stops reading at its end)."""
    payload = pickle.dumps({"state": RunsCode(marker)}, protocol=2)  # torch.save's protocol
    size = path.stat().st_size
    assert len(payload) <= size, (path.name, len(payload), size)
    path.write_bytes(payload + b"\0" * (size - len(payload)))


def rewrite_manifest(checkpoint: Path, name: str) -> None:
    """checkpoint.json's size and sha256 of `name` made those of the file now there."""
    meta_path = checkpoint / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    data = (checkpoint / name).read_bytes()
    meta["files"][name], meta["sha256"][name] = len(data), hashlib.sha256(data).hexdigest()
    meta_path.write_text(json.dumps(meta))


def test_the_manifest_records_the_size_and_sha256_of_every_file_and_the_ema_is_safetensors(small_run):
    _, newest = newest_two(small_run)
    meta = json.loads((newest / "checkpoint.json").read_text())
    assert set(FILES) <= set(meta["files"]) and set(meta["sha256"]) == set(meta["files"])
    assert not [name for name in meta["files"] if name.startswith("custom_checkpoint")]
    for name, digest in meta["sha256"].items():
        assert hashlib.sha256((newest / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("name", FILES)
def test_a_file_replaced_by_a_pickle_that_runs_code_is_damage_and_the_previous_checkpoint_resumes(
        small_run, tmp_path, capsys, name):
    out = shutil.copytree(small_run, tmp_path / "run")
    previous, newest = newest_two(out)
    marker = tmp_path / "code-ran"
    replace_by_code(newest / name, marker)

    train_in_process(*SMALL, f"output_dir={out}", "resume=auto")

    captured = capsys.readouterr()
    assert not marker.exists()
    (warning,) = [line for line in captured.err.splitlines() if "unusable" in line]
    assert str(newest) in warning and f"{name} is not the file that was written" in warning, warning
    assert f"resuming from {previous}: step 2" in captured.out


@pytest.mark.floors  # what Accelerate's load_state unpickles, and how, is its version's
@pytest.mark.parametrize("name", FILES)
def test_a_file_replaced_by_a_pickle_that_runs_code_with_the_manifest_rewritten_to_match_runs_no_code(
        small_run, tmp_path, capsys, name):
    """Whoever can write the run folder can rewrite checkpoint.json too: the hash then passes, and what stands
    between the file and the shell is how each part is read (safetensors, JSON, weights_only). The checkpoint is
    refused in one line or passed over as damaged; either way nothing ran."""
    out = shutil.copytree(small_run, tmp_path / "run")
    previous, newest = newest_two(out)
    marker = tmp_path / "code-ran"
    replace_by_code(newest / name, marker)
    rewrite_manifest(newest, name)

    try:
        train_in_process(*SMALL, f"output_dir={out}", "resume=auto")
    except UserError as refused:
        assert f"resume: cannot load {newest}" in str(refused) and "\n" not in str(refused), str(refused)
        assert "a file holds a call to posix.system" in str(refused) and "nothing in it was run" in str(refused)
    else:
        captured = capsys.readouterr()
        assert [line for line in captured.err.splitlines() if "unusable" in line and str(newest) in line]
        assert f"resuming from {previous}: step 2" in captured.out
    assert not marker.exists()


@pytest.mark.floors
def test_a_checkpoint_written_before_the_ema_was_safetensors_resumes_and_runs_no_code(small_run, tmp_path, capsys):
    """Checkpoints before kept the EMA as Accelerate's custom_checkpoint_0.pkl: it is read with weights_only=True,
    where Accelerate's own load_state would unpickle it with weights_only=False."""
    import torch
    from safetensors.torch import load_file

    out = shutil.copytree(small_run, tmp_path / "run")
    _, newest = newest_two(out)
    for checkpoint, _ in list_checkpoints(out / "checkpoints"):  # as the earlier version wrote them
        torch.save(load_file(checkpoint / "ema.safetensors"), checkpoint / "custom_checkpoint_0.pkl")
        (checkpoint / "ema.safetensors").unlink()
        meta = json.loads((checkpoint / "checkpoint.json").read_text())
        for table in (meta["files"], meta["sha256"]):
            table["custom_checkpoint_0.pkl"] = table.pop("ema.safetensors")
        meta_path = checkpoint / "checkpoint.json"
        meta_path.write_text(json.dumps(meta))
        rewrite_manifest(checkpoint, "custom_checkpoint_0.pkl")
    legacy = shutil.copytree(out, tmp_path / "legacy")

    train_in_process(*SMALL, f"output_dir={legacy}", "resume=auto", "train.max_steps=6")
    assert f"resuming from {legacy / 'checkpoints' / newest.name}: step 4" in capsys.readouterr().out
    assert [line["step"] for line in read_metrics(legacy, "train")][-1] == 6

    marker = tmp_path / "code-ran"
    replace_by_code(newest / "custom_checkpoint_0.pkl", marker)
    rewrite_manifest(newest, "custom_checkpoint_0.pkl")
    with pytest.raises(UserError, match="a file holds a call to posix.system"):
        train_in_process(*SMALL, f"output_dir={out}", "resume=auto")
    assert not marker.exists()


@pytest.mark.parametrize("manifest", ["as written", "rewritten to match"])
def test_a_random_state_file_garbled_at_its_own_size_is_damage_not_a_resume_that_is_no_longer_exact(
        small_run, tmp_path, capsys, manifest):
    """Accelerate's load_state swallows a random-state file that does not load (a line at info level) and goes on."""
    out = shutil.copytree(small_run, tmp_path / "run")
    previous, newest = newest_two(out)
    states = newest / "random_states_0.pkl"
    states.write_bytes(os.urandom(states.stat().st_size))
    if manifest == "rewritten to match":
        rewrite_manifest(newest, states.name)

    train_in_process(*SMALL, f"output_dir={out}", "resume=auto")

    captured = capsys.readouterr()
    (warning,) = [line for line in captured.err.splitlines() if "unusable" in line]
    assert str(newest) in warning, warning
    if manifest == "as written":
        assert "random_states_0.pkl is not the file that was written" in warning, warning
    assert f"resuming from {previous}: step 2" in captured.out


DAMAGED_MANIFESTS = {  # checkpoint.json of the newest checkpoint, damaged: its text, and what the warning says of it
    "cut short": (lambda text: text[:len(text) // 2], "its checkpoint.json does not read: JSONDecodeError: "),
    "not UTF-8": (lambda text: "\udcff" + text, "its checkpoint.json does not read: UnicodeDecodeError: "),
    "without its step": (lambda text: json.dumps({key: value for key, value in json.loads(text).items()
                                                 if key != "step"}), "its checkpoint.json has no int step"),
    "removed": (None, "it has no checkpoint.json"),
}


def damage_manifest(checkpoint: Path, how: str) -> None:
    change = DAMAGED_MANIFESTS[how][0]
    manifest = checkpoint / "checkpoint.json"
    if change is None:
        manifest.unlink()
    else:
        manifest.write_bytes(change(manifest.read_text()).encode("utf-8", "surrogateescape"))


@pytest.mark.parametrize("how", DAMAGED_MANIFESTS)
def test_a_damaged_checkpoint_json_of_the_newest_checkpoint_is_one_warning_and_the_previous_checkpoint_resumes(
        small_run, tmp_path, capsys, how):
    out = shutil.copytree(small_run, tmp_path / "run")
    previous, newest = newest_two(out)
    damage_manifest(newest, how)

    train_in_process(*SMALL, f"output_dir={out}", "resume=auto")

    captured = capsys.readouterr()
    (warning,) = [line for line in captured.err.splitlines() if "unusable" in line]
    assert warning.startswith(f"accel-train: warning: checkpoint {newest} is unusable ({DAMAGED_MANIFESTS[how][1]}")
    assert warning.endswith("; passed over"), warning
    assert f"resuming from {previous}: step 2" in captured.out
    assert read_metrics(out, "train")[-1]["step"] == 4  # trained on to the end, beside the damaged folder


def test_resume_auto_whose_every_checkpoint_json_is_damaged_stops_in_one_line_rather_than_start_over(
        small_run, tmp_path, capsys):
    out = shutil.copytree(small_run, tmp_path / "run")
    for folder in newest_two(out):
        damage_manifest(folder, "cut short")
    metrics = (out / "metrics.jsonl").read_text()

    with pytest.raises(UserError) as refused:
        train_in_process(*SMALL, f"output_dir={out}", "resume=auto")

    assert str(refused.value) == (f"resume=auto: no loadable checkpoint in {out / 'checkpoints'}; set resume=null to "
                                  "start from step 0")
    assert len([line for line in capsys.readouterr().err.splitlines() if "unusable" in line]) == 2
    assert (out / "metrics.jsonl").read_text() == metrics


def test_eval_and_init_from_of_a_checkpoint_whose_checkpoint_json_is_damaged_refuse_its_weights_in_one_line(
        small_run, tmp_path):
    """Its model.safetensors is whole, but nothing vouches for it: the manifest that records its sha256 does not
    read."""
    from accel_train import api
    from accel_train.errors import UnreadableFileError

    out = shutil.copytree(small_run, tmp_path / "run")
    _, newest = newest_two(out)
    damage_manifest(newest, "cut short")

    line = (f"checkpoint={newest}: {newest} is a checkpoint whose model.safetensors cannot be checked: its "
            "checkpoint.json does not read: JSONDecodeError: ")
    with pytest.raises(UnreadableFileError) as refused:
        api.evaluate(str(newest))
    assert str(refused.value).startswith(line) and str(refused.value).endswith("; use another checkpoint of the run")
    with pytest.raises(UnreadableFileError, match="cannot be checked: its checkpoint.json does not read"):
        train_in_process(*SMALL, f"model.init_from={newest}", f"output_dir={tmp_path / 'new'}")
    assert api.evaluate(str(out))["num_samples"] == 10  # the run's own model: no checkpoint, nothing to vouch


def test_eval_and_init_from_of_a_checkpoint_whose_weights_were_swapped_refuse_them_in_one_line(small_run, tmp_path):
    """Step 2's weights put in step 4's place: a whole safetensors file of the same size, which only the manifest's
    sha256 tells apart."""
    from accel_train import api
    from accel_train.errors import UnreadableFileError

    out = shutil.copytree(small_run, tmp_path / "run")
    previous, newest = newest_two(out)
    shutil.copyfile(previous / "model.safetensors", newest / "model.safetensors")

    with pytest.raises(UnreadableFileError) as refused:
        api.evaluate(str(newest))
    assert str(refused.value) == (f"checkpoint={newest}: model.safetensors is not the file that was written (its "
                                  f"sha256 differs from {newest / 'checkpoint.json'}): damaged or replaced; use "
                                  "another checkpoint of the run")
    with pytest.raises(UnreadableFileError, match="model.safetensors is not the file that was written"):
        train_in_process(*SMALL, f"model.init_from={newest}", f"output_dir={tmp_path / 'new'}")
    assert api.evaluate(str(previous))["num_samples"] == 10
