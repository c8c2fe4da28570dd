"""Contracts of a run folder, one of its checkpoints or a weights file given as an argument: eval and predict take
any of them; `train RUN` trains the run again elsewhere or, with resume=auto, continues that run itself; a checkpoint
of another folder is not resumed, its weights start a new run through model.init_from; plot draws where it is
asked to, never over a file that is already there."""

import json
import shutil

import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from accel_train import hooks
from accel_train.cli import main
from accel_train.config import load_config
from accel_train.errors import DataNotFoundError, UserError
from support.commands import evaluate_in_process, last_json_line, launch, one_thread, train_in_process
from support.locations import PROBE
from support.recorders import digests
from support.runs import read_metrics

# 48 samples, 4 steps an epoch; evaluations and checkpoints every 2 steps; the recorded resume=auto is the first start's
SMALL = ["mnist_cnn", "data.synthetic=true", "data.train_subset=48", "data.eval_subset=20", "train.batch_size=12",
         "train.max_steps=4", "train.eval_every_steps=2", "checkpoint.every_steps=2", "checkpoint.keep_last=5",
         "checkpoint.best_metric=accuracy", "train.plot=false", "train.log_with=none", "resume=auto"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("small") / "run"
    train_in_process(*SMALL, f"output_dir={out}")
    return out


def step(run, number: int):
    return run / "checkpoints" / f"step-{number:08d}"


def eval_of(argv: list[str], capsys) -> dict:
    """`accel-train eval ARGV` in this process, on one thread as evaluate_in_process: the same kernels, so the same
    bits (at another thread count only within docs/contracts.md's tolerance)."""
    one_thread(main, ["eval", *argv])
    return last_json_line(capsys.readouterr().out)


def test_eval_and_predict_take_a_checkpoint_folder_or_a_weights_file_in_place_of_the_run(run, tmp_path, capsys):
    for weights in (step(run, 2), run / "model_best.safetensors", step(run, 2) / "model.safetensors"):
        assert eval_of([str(weights)], capsys) == {**evaluate_in_process(str(run), weights), "num_processes": 1}
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    for index in range(3):
        Image.fromarray((torch.rand(28, 28) * 255).byte().numpy()).save(pictures / f"digit{index}.png")
    main(["predict", str(step(run, 2)), f"input={pictures}", f"output={tmp_path / 'a.csv'}"])
    main(["predict", str(run), f"checkpoint={step(run, 2)}", f"input={pictures}", f"output={tmp_path / 'b.csv'}"])
    assert (tmp_path / "a.csv").read_text() == (tmp_path / "b.csv").read_text()
    assert len((tmp_path / "a.csv").read_text().splitlines()) == 4
    loose = tmp_path / "loose.safetensors"
    shutil.copy(run / "model.safetensors", loose)
    with pytest.raises(SystemExit) as stop:
        main(["eval", str(loose)])
    stderr = capsys.readouterr().err
    assert stop.value.code == 2 and "pass the recipe too: accel-train eval RECIPE checkpoint=" in stderr, stderr


def test_train_of_a_run_folder_needs_an_output_dir_and_with_resume_auto_continues_that_run(run, tmp_path, capsys):
    again = shutil.copytree(run, tmp_path / "run")
    assert load_config(str(again)).resume is None  # recorded auto: how that run started, not a setting of a new one
    with pytest.raises(SystemExit) as stop:
        main(["train", str(again)])
    stderr = capsys.readouterr().err
    assert stop.value.code == 2 and "a run folder as the recipe trains that run again, into a folder of its own: " \
        f"add output_dir=NEW (to continue {again} itself: accel-train train {again} resume=auto)" in stderr, stderr
    train_in_process(str(again), "resume=auto", "train.max_steps=6")
    starts = [json.loads(line) for line in (again / "starts.jsonl").read_text().splitlines()]
    assert [start["step"] for start in starts] == [0, 4] and read_metrics(again, "train")[-1]["step"] == 6


def test_resume_of_another_folders_checkpoint_is_refused_naming_model_init_from(run, tmp_path):
    with pytest.raises(UserError, match=rf"resume={step(run, 2)} is a checkpoint of another folder than "
                                        rf"output_dir={tmp_path / 'new'}: .* give model.init_from={step(run, 2)}"):
        train_in_process(*SMALL, f"output_dir={tmp_path / 'new'}", f"resume={step(run, 2)}")
    assert not (tmp_path / "new").exists()  # refused before the folder is made


class Prepared(hooks.Hooks):
    """The weights of the model as training starts (after prepare), on this process."""

    def model_prepared(self, model):
        self.weights = {name: tensor.detach().clone()
                        for name, tensor in getattr(model, "module", model).state_dict().items()}


@pytest.mark.parametrize("source", ["run", "checkpoint", "file"])
def test_init_from_a_run_a_checkpoint_or_a_weights_file_starts_a_new_run_from_those_weights(run, tmp_path, source):
    given = {"run": run, "checkpoint": step(run, 2), "file": run / "model_best.safetensors"}[source]
    expected = load_file(str(given / "model.safetensors" if given.is_dir() else given))
    prepared = Prepared()
    with hooks.added(prepared):
        train_in_process(*SMALL, "train.max_steps=2", f"model.init_from={given}", f"output_dir={tmp_path / 'new'}")
    assert prepared.weights.keys() == expected.keys()
    assert all(torch.equal(prepared.weights[name], tensor) for name, tensor in expected.items())
    assert load_config(str(tmp_path / "new")).model.init_from == str(given)  # recorded
    assert json.loads((tmp_path / "new" / "starts.jsonl").read_text())["step"] == 0  # a new run, from step 0


@pytest.mark.parametrize("source", ["run", "checkpoint", "file"])
def test_init_from_at_2_processes_starts_every_process_from_those_weights(run, tmp_path, source):
    given = {"run": run, "checkpoint": step(run, 2), "file": run / "model_best.safetensors"}[source]
    expected = digests(load_file(str(given / "model.safetensors" if given.is_dir() else given)))
    new, records = tmp_path / "new", tmp_path / "records"
    launch(2, "train", *SMALL, "train.max_steps=2", f"model.init_from={given}", f"output_dir={new}", script=PROBE,
           env={"PROBE_DIR": str(records)})
    for rank in (0, 1):  # the model each process prepared, before its first step
        assert json.loads((records / f"rank{rank}.json").read_text())["initial_weights"] == expected, rank
    recorded = yaml.safe_load((new / "config.yaml").read_text())
    assert recorded["model"]["init_from"] == str(given) and recorded["run"]["world_size"] == 2
    assert json.loads((new / "starts.jsonl").read_text())["step"] == 0  # a new run, from step 0


def test_init_from_weights_of_another_shape_is_one_line_naming_the_tensor_and_both_shapes(run, tmp_path, capsys):
    # mnist_cnn on CIFAR-10 (3 channels of 32 px, not 1 of 28): the same tensor names, other shapes; the first by name
    with pytest.raises(SystemExit) as stop:
        main(["train", *SMALL, "data.name=cifar10", f"model.init_from={run}", f"output_dir={tmp_path / 'new'}"])
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert stop.value.code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0] == (f"accel-train: error: model.init_from={run} does not fit model.name=mnist_cnn on cifar10: "
                        "classifier.1.weight has shape [128, 9216] there, [128, 12544] here; start from weights of the "
                        "same model.name and data shape"), lines[0]
    assert not (tmp_path / "new" / "metrics.jsonl").exists()


def test_init_from_weights_of_another_model_or_nowhere_is_one_line(run, tmp_path):
    with pytest.raises(UserError, match=rf"model.init_from={run} does not fit model.name=bn_cnn on mnist: it has a "
                                        r"tensor \S+ this model lacks"):
        train_in_process(*SMALL, "model.name=bn_cnn", f"model.init_from={run}", f"output_dir={tmp_path / 'a'}")
    with pytest.raises(DataNotFoundError, match=rf"model.init_from={tmp_path / 'nowhere'}: no model.safetensors"):
        train_in_process(*SMALL, f"model.init_from={tmp_path / 'nowhere'}", f"output_dir={tmp_path / 'b'}")


def test_a_checkpoint_with_an_ema_and_a_run_without_one_is_named_in_one_line(tmp_path):
    out = tmp_path / "ema"
    train_in_process(*SMALL, "train.ema_decay=0.9", f"output_dir={out}")
    with pytest.raises(UserError, match=r"was saved with train.ema_decay=0.9, this run has train.ema_decay=null: "
                                        r"an EMA of the weights is saved and restored with the checkpoint"):
        train_in_process(*SMALL, "train.max_steps=6", f"output_dir={out}")


def test_plot_draws_a_run_into_its_folder_and_several_here_never_over_a_file_that_is_here(run, tmp_path, monkeypatch,
                                                                                         capsys):
    one, two = shutil.copytree(run, tmp_path / "one"), shutil.copytree(run, tmp_path / "two")
    monkeypatch.chdir(tmp_path)
    main(["plot", str(one)])
    assert (one / "curves.png").is_file() and not (tmp_path / "curves.png").exists()
    main(["plot", str(one), str(two)])
    drawn = (tmp_path / "curves.png").stat().st_mtime_ns
    with pytest.raises(SystemExit) as stop:
        main(["plot", str(one), str(two)])
    assert stop.value.code == 2 and "curves.png is already here; give output=FILE" in capsys.readouterr().err
    assert (tmp_path / "curves.png").stat().st_mtime_ns == drawn
    main(["plot", str(one), str(two), "output=curves.png"])  # a file given is written over
