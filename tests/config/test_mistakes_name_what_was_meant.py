"""Contracts of the first hour: a mistyped key, metric or command, an argument that would be ignored, and an input
out of range are each one line with exit 2, naming what was probably meant; a help page is the command's own."""

import json

import pytest

from accel_train.cli import main


@pytest.mark.parametrize("argv, words", [
    (["train", "mnist_cnn", "train.epoch=3"],
     ["unknown config key 'train.epoch' (did you mean train.epochs?); accel-train keys lists every key"]),
    (["trian", "mnist_cnn"], ["unknown command 'trian' (did you mean train?)"]),
    (["train", "mnist_cnn", "--train.lr=0.01"], ["--train.lr=0.01", "takes no dashes: train.lr=0.01"]),
    (["train", "missing.yaml"], ["recipe missing.yaml: no such file"]),
    (["train", "fashion_mnist_cnn", "model.args.width=64"],
     ["model.args={width: 64}", "a model given by import path", "model.name=mnist_cnn takes none", "ignored"]),
    (["train", "fashion_mnist_cnn", "data.args.size=3"],
     ["data.args={size: 3}", "a dataset given by import path", "data.name=fashion_mnist takes none"]),
    (["train", "fashion_mnist_cnn", "data.image_transform=my_images:to_input"],
     ["data.image_transform=my_images:to_input", "data.name=fashion_mnist"]),
    (["train", "fashion_mnist_cnn", "checkpoint.best_metric=acuracy"],
     ["checkpoint.best_metric=acuracy is not an evaluation metric of task=classification (did you mean accuracy?)",
      "it reports accuracy, top5, loss"]),
    (["train", "fashion_mnist_cnn", "train.early_stop_patience=2", "train.early_stop_metric=los"],
     ["train.early_stop_metric=los is not an evaluation metric", "(did you mean loss?)"]),
    (["train", "fashion_mnist_vae", "checkpoint.best_metric=kl_loss"],
     ["checkpoint.best_metric=kl_loss", "it reports loss, reconstruction_loss, kl"]),
    (["launch", "--num_machines", "0", "--num_processes", "2", "-m", "accel_train", "train", "mnist_cnn"],
     ["--num_machines 0: the number of machines, 1 or more"]),
    (["train", "fashion_mnist_cnn", "data.cache_gb=5"],
     ["data.cache_gb: the block cache of data.name=shards", "data.name=fashion_mnist reads no shards", "ignored"]),
    (["bench", "--input", "--demand", "5k"],
     ["accel-train: error: bench: argument --demand: invalid float value: '5k'; accel-train bench --help shows its "
      "usage"]),
    (["sweep", "mnist_cnn", "--trials", "two", "--metric", "accuracy"],
     ["sweep: argument --trials: invalid int value: 'two'; accel-train sweep --help"]),
    (["doctor", "--machine_rank", "first"], ["doctor: argument --machine_rank: invalid int value: 'first'"]),
    (["runs"], ["runs: the following arguments are required: DIR; accel-train runs --help shows its usage"]),
], ids=["key", "command", "dashed override", "missing recipe file", "model.args", "data.args", "image_transform",
        "best_metric", "early_stop_metric", "a task's own metrics", "num_machines 0", "cache beside other data",
        "an option's type", "a sweep option's type", "a doctor option's type", "a command's argument"])
def test_a_mistake_is_one_line_exit_2_naming_what_was_probably_meant(argv, words, tmp_path, capsys):
    argv = [*argv, f"output_dir={tmp_path / 'run'}"] if argv[0] == "train" else argv
    with pytest.raises(SystemExit) as stop:
        main(argv)
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert stop.value.code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("accel-train: error: ") and all(word in lines[0] for word in words), lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained


@pytest.mark.parametrize("command", ["plot", "runs", "bench", "doctor", "recipes", "profile"])
def test_a_commands_help_is_its_own_usage_not_the_whole_command_lines(command, capsys):
    with pytest.raises(SystemExit) as stop:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and out.startswith(f"usage: accel-train {command} "), out[:300]
    assert "accel-train train RECIPE" not in out


def test_a_sweep_whose_study_journal_is_damaged_is_named_in_one_line(tmp_path, capsys):
    pytest.importorskip("optuna")  # the sweep extra: without it the line names the extra to install instead
    (tmp_path / "sweep.yaml").write_text("recipe: mnist_cnn\nmetric: accuracy\ndirection: max\n")
    (tmp_path / "study.journal").write_text(json.dumps({"op_code": 5, "worker_id": "w", "trial_id": 3}) + "\n")
    for command in (["runs", str(tmp_path)], ["plot", str(tmp_path)]):
        with pytest.raises(SystemExit) as stop:
            main(command)
        stderr = capsys.readouterr().err
        assert stop.value.code == 3 and "Traceback" not in stderr, stderr  # README's code for a damaged file
        assert stderr.strip() == (f"accel-train: error: {tmp_path / 'study.journal'} cannot be read as the sweep's "
                                  "study (KeyError: 'Record does not exist.'); it is damaged or not a study: restore "
                                  "it, or start the sweep again in a new output_dir")


def test_an_output_dir_at_a_file_url_is_refused_in_one_line_instead_of_training_into_a_local_folder_named_file(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["train", "mnist_cnn", "data.synthetic=true", "output_dir=file:///tmp/runs/a"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert stop.value.code == 2 and len(lines) == 1, lines
    assert lines[0] == ("accel-train: error: output_dir=file:///tmp/runs/a: give a local folder as a path, without "
                        "file:// (output_dir=/tmp/runs/a)"), lines[0]
    assert list(tmp_path.iterdir()) == [], "a folder was made"
