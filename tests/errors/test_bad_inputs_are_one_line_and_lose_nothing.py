"""Contracts for bad inputs (a folder that holds a run, an output_dir that is a file or cannot be written, a recipe
that is no text, a damaged image or weights file, a full disk): one line naming the problem, the exit code of
README's table, no traceback, and nothing of an earlier run overwritten."""

import shutil
import subprocess
import sys

import pytest
from PIL import Image

from accel_train import cli
from support.commands import run_cli, train_in_process
from support.locations import REPO, needs_fashion_mnist
from support.runs import read_metrics

TINY = ["data.synthetic=true", "data.train_subset=24", "data.eval_subset=10", "train.batch_size=12",
        "train.max_steps=2", "train.log_every_steps=1", "train.plot=false"]


def one_error(result, exit_code: int) -> str:
    """The run failed with `exit_code` and said why in exactly one line, without a traceback."""
    assert result.returncode == exit_code, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("accel-train: error:")]
    return line


def test_training_into_a_folder_that_holds_a_run_is_refused_and_leaves_it_untouched(tmp_path):
    train_in_process("mnist_cnn", f"output_dir={tmp_path}", *TINY)
    before = {name: (tmp_path / name).read_bytes() for name in ("metrics.jsonl", "config.yaml", "model.safetensors")}
    error = one_error(run_cli("train", "mnist_cnn", f"output_dir={tmp_path}", *TINY, "train.lr=0.5", check=False), 2)
    assert f"output_dir={tmp_path} already holds a run" in error and "resume=auto" in error
    assert all((tmp_path / name).read_bytes() == content for name, content in before.items())
    # resume=PATH of a checkpoint from another folder would overwrite it as well: refused, naming model.init_from
    other = tmp_path.parent / "other_run"
    train_in_process("mnist_cnn", f"output_dir={other}", *TINY)
    foreign = next((other / "checkpoints").iterdir())
    error = one_error(run_cli("train", "mnist_cnn", f"output_dir={tmp_path}", *TINY, f"resume={foreign}",
                              check=False), 2)
    assert f"is a checkpoint of another folder than output_dir={tmp_path}" in error
    assert f"model.init_from={foreign}" in error
    assert all((tmp_path / name).read_bytes() == content for name, content in before.items())


def test_resume_auto_is_the_one_command_for_the_first_start_and_every_restart(tmp_path, capsys):
    out = tmp_path / "run"
    train_in_process("mnist_cnn", f"output_dir={out}", *TINY, "resume=auto")
    assert "no checkpoint" in capsys.readouterr().out
    assert [line["step"] for line in read_metrics(out, "train")] == [1, 2]
    train_in_process("mnist_cnn", f"output_dir={out}", *TINY, "resume=auto")
    assert "nothing left to train" in capsys.readouterr().out
    assert [line["step"] for line in read_metrics(out, "train")] == [1, 2]


@pytest.mark.parametrize("where", ["the folder itself", "a parent"])
def test_an_output_dir_that_is_a_file_is_refused_before_any_work(tmp_path, where):
    file = tmp_path / "results.txt"
    file.write_text("not a folder")
    output_dir = file if where == "the folder itself" else file / "run"
    error = one_error(run_cli("train", "mnist_cnn", f"output_dir={output_dir}", *TINY, check=False), 2)
    assert str(output_dir) in error and "a file" in error
    assert file.read_text() == "not a folder"


def test_a_recipe_that_is_a_folder_or_not_text_is_named_in_one_line(tmp_path):
    error = one_error(run_cli("train", str(tmp_path), check=False), 2)
    assert f"recipe {tmp_path} is a folder" in error
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(bytes(range(256)) * 4)
    error = one_error(run_cli("train", str(binary), check=False), 2)
    assert str(binary) in error


def image_folder(root, per_class=4):
    for split in ("train", "val"):
        for index, name in enumerate(("cat", "dog")):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (48, 40), (index * 90, i * 50, 100)).save(folder / f"{i}.jpg", quality=95)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_truncated_jpeg_in_an_image_folder_is_named_in_one_line(tmp_path, workers):
    image_folder(tmp_path / "images")
    broken = tmp_path / "images" / "train" / "dog" / "2.jpg"
    broken.write_bytes(broken.read_bytes()[:300])
    result = run_cli("train", "imagefolder", f"data.root={tmp_path / 'images'}", "model.name=resnet18",
                     "data.image_size=32", f"data.num_workers={workers}", f"output_dir={tmp_path / 'run'}",
                     "train.batch_size=8", "train.eval_batch_size=8", "train.epochs=1", check=False)
    error = one_error(result, 3)
    assert f"cannot read {broken}" in error and "delete or replace that file" in error


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    train_in_process("mnist_cnn", f"output_dir={out}", *TINY)
    return out


MISTYPED_URLS = {  # (the command, what its one line says) of a location the user meant as a URL
    "output_dir with one slash": (["train", "mnist_cnn", "output_dir=s3:/bucket/run", *TINY],
                                  "output_dir=s3:/bucket/run: not a URL"),
    "output_dir with no bucket": (["train", "mnist_cnn", "output_dir=s3://", *TINY],
                                  "output_dir=s3://: the URL names no bucket"),
    "output_dir with three slashes": (["train", "mnist_cnn", "output_dir=gs:///bucket/run", *TINY],
                                      "write gs://bucket/run"),
    "data.root of shards": (["train", "mnist_cnn", "data.name=shards", "data.root=s3:bucket/shards", *TINY[1:]],
                            "data.root=s3:bucket/shards: not a URL"),
    "model.init_from": (["train", "mnist_cnn", "model.init_from=s3:/bucket/run", *TINY],
                        "model.init_from=s3:/bucket/run: not a URL"),
    "shard output": (["shard", "mnist_cnn", "data.synthetic=true", "output=s3:/bucket/shards"],
                     "output=s3:/bucket/shards: not a URL"),
    "eval of a run": (["eval", "s3:/bucket/run"], "run=s3:/bucket/run: not a URL"),
    "runs": (["runs", "s3://"], "runs=s3://: the URL names no bucket"),
    "sweep output_dir": (["sweep", "mnist_cnn", "--trials", "1", "--metric", "accuracy",
                          "train.lr=loguniform(1e-3,1e-1)", "output_dir=s3:/bucket/sweep"],
                         "output_dir=s3:/bucket/sweep: not a URL"),
    "bench --saves-into": (["bench", "--saves", "--saves-into", "s3:/bucket/saves", "mnist_cnn", "data.synthetic=true"],
                           "bench --saves-into=s3:/bucket/saves: not a URL"),
    "bench --shards": (["bench", "--shards", "s3://", "mnist_cnn", "data.synthetic=true"],
                       "bench --shards=s3://: the URL names no bucket"),
}


@pytest.mark.parametrize("case", list(MISTYPED_URLS))
def test_a_mistyped_url_is_one_line_and_never_becomes_a_local_folder(case, tmp_path, monkeypatch, capsys):
    """s3:/bucket/x, s3://, gs:///x: as paths they would be local folders named `s3:` (a run trained there, a
    sweep, shards): refused in one line naming what was typed, exit 2, before anything is made."""
    arguments, says = MISTYPED_URLS[case]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        cli.main(arguments)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert stopped.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("accel-train: error: ") and says in lines[0], lines[0]
    assert not list(tmp_path.iterdir()), f"left behind: {sorted(path.name for path in tmp_path.iterdir())}"


@pytest.mark.parametrize("where", ["the cache folder itself", "a parent"])
def test_a_shard_cache_dir_that_is_a_file_is_one_line_before_training_and_leaves_no_run_folder(where, tmp_path,
                                                                                                  capsys):
    # Else the first read of a block, in a DataLoader worker, ended the run with a traceback, its folder started.
    cli.main(["shard", "mnist_cnn", "data.synthetic=true", "data.train_subset=24", "data.eval_subset=10",
              f"output={tmp_path / 'shards'}"])
    (tmp_path / "file").write_text("not a folder")
    cache = tmp_path / "file" if where == "the cache folder itself" else tmp_path / "file" / "cache"
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        cli.main(["train", "mnist_cnn", "data.name=shards", f"data.root={tmp_path / 'shards'}",
                  f"data.cache_dir={cache}", f"output_dir={tmp_path / 'run'}", *TINY[1:]])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert stopped.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"accel-train: error: data.cache_dir={cache} is ") and "not a folder" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("output", ["s3:/bucket/predictions.csv", "s3://bucket/curves.png"])
def test_predict_and_plot_outputs_that_are_mistyped_urls_are_one_line_before_any_work(output, trained, tmp_path,
                                                                                          monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    command = ["predict", str(trained), f"input={tmp_path}", f"output={output}"] if output.endswith(".csv") else \
        ["plot", str(trained), f"output={output}"]
    with pytest.raises(SystemExit) as stopped:
        cli.main(command)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert stopped.value.code == 2 and len(lines) == 1 and f"output={output}" in lines[0], lines
    assert not list(tmp_path.iterdir())


def test_a_run_refused_after_its_folder_was_made_leaves_no_folder_behind(trained, tmp_path, capsys):
    """Weights of another model are refused once the model is built, after output_dir was made for the run: the
    folders made for it (a parent too) go again, as a refusal before them would have left nothing."""
    output_dir = tmp_path / "new" / "run"
    with pytest.raises(SystemExit) as stopped:
        cli.main(["train", "mnist_cnn", "model.name=resnet18", f"model.init_from={trained}", f"output_dir={output_dir}",
                  *TINY])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"model.init_from={trained} does not fit" in err
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()  # a folder that was there before is kept, empty as it was
    with pytest.raises(SystemExit):
        cli.main(["train", "mnist_cnn", "model.name=resnet18", f"model.init_from={trained}",
                  f"output_dir={tmp_path / 'kept'}", *TINY])
    assert (tmp_path / "kept").is_dir()


@pytest.mark.parametrize("damage", ["truncated", "not safetensors"])
def test_eval_of_damaged_weights_says_which_file_in_one_line(trained, tmp_path, damage):
    weights = tmp_path / "model.safetensors"
    shutil.copy(trained / "model.safetensors", weights)
    weights.write_bytes(weights.read_bytes()[:1000] if damage == "truncated" else b"PK\x03\x04 a zip, not weights")
    error = one_error(run_cli("eval", "mnist_cnn", f"checkpoint={tmp_path}", *TINY, check=False), 3)
    assert str(weights) in error and "not a readable safetensors file" in error


def test_eval_refuses_weights_of_another_model_in_one_line(trained, tmp_path):
    """Weights without their run folder (no config.yaml to compare with): their tensors do not fit."""
    shutil.copy(trained / "model.safetensors", tmp_path / "model.safetensors")
    result = run_cli("eval", "cifar10_resnet50", f"checkpoint={tmp_path}", "data.synthetic=true", "data.eval_subset=4",
                     check=False)
    error = one_error(result, 2)
    assert "does not fit model.name=resnet50" in error


def test_a_refused_run_folder_answers_before_torch_loads(trained):
    code = ("import sys\nfrom accel_train.cli import main\ntry:\n"
            f"    main(['train', 'mnist_cnn', 'output_dir={trained}'])\nexcept SystemExit as stop:\n"
            "    print('exit', stop.code, 'torch loaded' if 'torch' in sys.modules else 'torch not loaded')")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "exit 2 torch not loaded", result.stdout + result.stderr


def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_earlier_checkpoint_survives(small_disk):
    from accel_train.run.checkpoint_files import list_checkpoints

    disk = small_disk("20m")  # room for one checkpoint of mnist_cnn + AdamW (13.8 MiB), not two
    result = run_cli("train", "mnist_cnn", f"output_dir={disk}", *TINY, "train.max_steps=4",
                     "checkpoint.every_steps=2", check=False)
    error = one_error(result, 74)
    assert "no space left on the device" in error and "resume=auto" in error
    assert [meta["step"] for _, meta in list_checkpoints(disk / "checkpoints")] == [2]


def test_an_unwritable_output_dir_is_refused_before_any_work(small_disk):
    disk = small_disk("1m", readonly=True)
    error = one_error(run_cli("train", "mnist_cnn", f"output_dir={disk / 'run'}", *TINY, check=False), 74)
    assert str(disk / "run") in error and "read-only file system" in error


def test_an_unwritable_hugging_face_cache_is_named_before_training(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    result = run_cli("train", "mnist_cnn", f"output_dir={tmp_path / 'run'}", *TINY, check=False,
                     env={"HF_HOME": str(not_a_folder / "hf")})
    error = one_error(result, 74)
    assert str(not_a_folder / "hf") in error and "set HF_HOME" in error
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # before any training


@needs_fashion_mnist
def test_a_data_root_that_cannot_receive_the_local_dataset_copy_is_named(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    result = run_cli("train", "fashion_mnist_cnn", f"data.root={not_a_folder}", f"output_dir={tmp_path / 'run'}",
                     "train.max_steps=1", check=False)
    error = one_error(result, 74)
    assert str(not_a_folder) in error and "set data.root to a folder you can write" in error
