"""The run folder is the unit: eval, predict and resume read the config a run recorded, refuse a setting that would
change what its weights mean, and the config.yaml a run writes is itself a recipe that reproduces the run."""

from __future__ import annotations

import json
import shutil
import socket
from datetime import datetime

import pytest
import yaml

from accel_train.cli import main
from support.commands import run_cli, train_in_process
from support.locations import FASHION_MNIST, needs_fashion_mnist
from support.runs import metrics_without_timing, read_metrics

pytestmark = needs_fashion_mnist

# The quickstart recipe on 640 real Fashion-MNIST images: 10 steps of 64, a checkpoint every 5; 300 test images.
RUN = ["fashion_mnist_cnn", f"data.root={FASHION_MNIST}", "data.train_subset=640", "data.eval_subset=300",
       "train.epochs=1", "checkpoint.every_steps=5", "train.plot=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run trained by the command line, so config.yaml records its command."""
    out = tmp_path_factory.mktemp("run") / "fm"
    run_cli("train", *RUN, f"output_dir={out}")
    return out


def refusal(capsys, *args: str) -> str:
    """The one error line of `accel-train ARGS`, which must exit 2 before torch loads."""
    with pytest.raises(SystemExit) as stop:
        main(list(args))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err, err
    (line,) = err.splitlines()
    return line


def test_eval_of_a_run_folder_alone_reproduces_the_runs_final_metrics(run):
    """No recipe and no override: the run's own config builds the model and the data (its data.root too)."""
    result = run_cli("eval", str(run))
    metrics = json.loads(result.stdout)
    final = read_metrics(run, "test")[-1]
    assert metrics["num_samples"] == final["num_samples"] == 300 and metrics["num_processes"] == 1
    for name in ("loss", "accuracy", "top5"):
        assert metrics[name] == pytest.approx(final[name], abs=1e-6), name
    said = result.stderr.splitlines()
    assert said[0].startswith(f"accel-train eval: evaluating {run} (mnist_cnn on fashion_mnist test)"), said


def test_eval_takes_overrides_that_keep_the_meaning_of_the_weights(run):
    from accel_train import evaluate

    metrics = evaluate(run, overrides=["data.eval_subset=100", "train.eval_batch_size=30"])
    on_the_first_100 = evaluate("fashion_mnist_cnn", run, [f"data.root={FASHION_MNIST}", "data.eval_subset=100"])
    assert metrics["num_samples"] == on_the_first_100["num_samples"] == 100
    assert metrics["accuracy"] == on_the_first_100["accuracy"]


@pytest.mark.parametrize("form, words", [
    (["eval", "{run}", "model.name=bn_cnn"], ["model.name=bn_cnn (trained with mnist_cnn)"]),
    (["eval", "{run}", "data.normalize=false", "data.image_size=32"],
     ["data.normalize=false (trained with true)", "data.image_size=32 (trained with null)"]),
    (["eval", "mnist_cnn", "checkpoint={run}"], ["data.name=mnist (trained with fashion_mnist)"]),
    (["eval", "checkpoint={run}/model.safetensors", "task=vae"], ["task=vae (trained with classification)"]),
    (["predict", "{run}", "input=photos/", "model.dropout=false"], ["model.dropout=false (trained with true)"]),
])
def test_a_setting_that_contradicts_the_run_is_refused_naming_the_key_and_both_values(run, capsys, form, words):
    error = refusal(capsys, *(arg.format(run=run) for arg in form))
    assert f"was trained with other settings: {words[0]}" in error and all(word in error for word in words), error
    assert "leave them out" in error


def test_resume_refuses_a_setting_that_contradicts_the_checkpoint(run, tmp_path, capsys):
    resumed = shutil.copytree(run, tmp_path / "resumed")  # resume continues a checkpoint of its own folder
    error = refusal(capsys, "train", str(resumed), "model.dropout=false",
                    f"resume={next((resumed / 'checkpoints').iterdir())}")
    assert "is from another run: model.dropout=false (trained with true)" in error, error


def test_a_runs_config_yaml_is_a_recipe_that_reproduces_the_run(run, tmp_path):
    again = tmp_path / "again"
    train_in_process(str(run / "config.yaml"), f"output_dir={again}")
    assert metrics_without_timing(again) == metrics_without_timing(run)
    first, second = (yaml.safe_load((folder / "config.yaml").read_text()) for folder in (run, again))
    assert first.pop("output_dir") != second.pop("output_dir")
    recorded_first, recorded_second = first.pop("run"), second.pop("run")
    assert first == second and recorded_second["recipe"] == str(run / "config.yaml")
    assert recorded_first["world_size"] == recorded_second["world_size"] == 1


def test_the_run_records_when_where_and_how_it_started_and_when_each_line_was_written(run):
    recorded = yaml.safe_load((run / "config.yaml").read_text())["run"]
    started = datetime.fromisoformat(recorded["started"])
    assert started.tzinfo is not None and recorded["host"] == socket.gethostname()
    assert recorded["command"].startswith("python -m accel_train train fashion_mnist_cnn data.root="), recorded
    assert f"output_dir={run}" in recorded["command"] and recorded["world_size"] == 1
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = [datetime.fromisoformat(line["time"]) for line in lines]
    assert times == sorted(times) and times[0] >= started.replace(microsecond=0)
    elapsed = [line["elapsed_s"] for line in lines]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0


# README's exit codes: 2 a usage or config mistake, 3 a file or folder that is not there
@pytest.mark.parametrize("args, code, says", [
    (["eval"], 2, "eval needs a run: accel-train eval RUN"),
    (["eval", "mnist_cnn"], 2, "eval mnist_cnn needs checkpoint=PATH"),
    (["eval", "{tmp}/runs/typo"], 3, "runs/typo: no such run folder (nor a shipped recipe)"),
    (["predict", "{run}"], 2, "predict needs input=PATH"),
    (["eval", "checkpoint={tmp}"], 2, "has no config.yaml in its run folder to say how it was trained: pass the"),
    (["eval", "checkpoint={tmp}/nothing"], 3, "no such file or folder"),
    (["eval", "{run}", "split=train"], 2, "split=train: choose test or val"),
    (["eval", "{run}", "split=val"], 2, "was trained without a validation split"),
    (["eval", "{run}/checkpoints/step-00000007"], 3, "{run}/checkpoints/step-00000007: no such checkpoint; "
     "{run}/checkpoints holds step-00000005, step-00000010 (the newest: {run}/checkpoints/step-00000010)"),
    (["eval", "fashion_mnist_cnn", "checkpoint={run}/checkpoints/step-00000007"], 3, "no such checkpoint; "
     "{run}/checkpoints holds step-00000005, step-00000010"),
    (["eval", "{run}/model_best.safetensors"], 3, "{run}/model_best.safetensors: the run kept no best model: it was "
     "trained without checkpoint.best_metric (set it, e.g. checkpoint.best_metric=accuracy, for a run to keep one); "
     "evaluate the run's final model (accel-train eval {run}) or one of its checkpoints"),
])
def test_eval_and_predict_say_what_is_missing(run, tmp_path, capsys, args, code, says):
    with pytest.raises(SystemExit) as stop:
        main([arg.format(run=run, tmp=tmp_path) for arg in args])
    err = capsys.readouterr().err
    (error,) = [line for line in err.splitlines() if line.startswith("accel-train: error: ")]
    assert stop.value.code == code and says.format(run=run) in error and "Traceback" not in err, (stop.value.code, err)


def test_predict_without_output_never_replaces_a_predictions_csv_that_is_there(run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "predictions.csv").write_text("path,label,score\nmine.png,cat,0.9\n")

    line = refusal(capsys, "predict", str(run), f"input={tmp_path}")

    assert line == ("accel-train: error: predict: predictions.csv is already here (an earlier predict's?); give "
                    "output=FILE (a file given is written over), or move that one away")
    assert (tmp_path / "predictions.csv").read_text() == "path,label,score\nmine.png,cat,0.9\n"
