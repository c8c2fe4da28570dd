"""Contracts of a training run: it learns, it leaves a self-describing run folder, every recipe runs."""


import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from support.commands import evaluate_in_process, run_cli, train_in_process
from support.locations import needs_fashion_mnist
from support.runs import read_metrics

# 24 samples, 2 steps (the validation split takes 6), a checkpoint after each
TINY_RUN = ["data.synthetic=true", "data.train_subset=24", "data.eval_subset=10", "train.batch_size=6",
            "train.max_steps=2", "train.log_every_steps=1", "train.plot=false"]
TINY = ["train.max_steps=1", "train.batch_size=4", "train.eval_batch_size=4", "data.train_subset=8",
        "data.eval_subset=6", "train.log_every_steps=1", "train.plot=false"]


@needs_fashion_mnist
def test_fashion_mnist_loss_falls_and_the_run_folder_describes_itself(tmp_path):
    out = tmp_path / "run"
    run_cli("train", "fashion_mnist_cnn", f"output_dir={out}", "data.train_subset=3000", "data.eval_subset=1000",
            "train.epochs=2", "train.log_every_steps=10", f"data.root={tmp_path / 'data'}")
    train_lines, eval_lines = read_metrics(out, "train"), read_metrics(out, "test")
    assert [line["epoch"] for line in eval_lines] == [0, 1]
    first, last = train_lines[0]["loss"], train_lines[-1]["loss"]
    assert last < 0.6 * first, (first, last)
    assert eval_lines[-1]["accuracy"] > 0.7 and eval_lines[-1]["num_samples"] == 1000
    assert eval_lines[-1]["loss"] < eval_lines[0]["loss"] * 1.1
    for line in train_lines:
        assert {"split", "epoch", "step", "loss", "lr", "samples_per_s"} <= set(line) and line["samples_per_s"] > 0
    assert {"split", "epoch", "step", "num_samples", "loss", "accuracy", "top5"} <= set(eval_lines[0])
    assert (out / "curves.png").is_file()
    # step decay with gamma 0.7 per epoch: the LR logged in epoch 1 is 0.7x that of epoch 0
    lrs = {line["epoch"]: line["lr"] for line in train_lines}
    assert lrs[1] == pytest.approx(0.7 * lrs[0])

    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["data"]["train_subset"] == 3000 and config["train"]["epochs"] == 2
    assert config["run"]["world_size"] == 1 and config["run"]["mixed_precision"] == "no"
    assert {"torch", "accelerate", "accel_train"} <= set(config["run"]["versions"])

    weights = load_file(str(out / "model.safetensors"))
    assert "features.0.weight" in weights
    evaluated = evaluate_in_process("fashion_mnist_cnn", out, "data.eval_subset=1000", f"data.root={tmp_path / 'data'}")
    assert evaluated["num_samples"] == 1000
    assert evaluated["correct"] == eval_lines[-1]["correct"]
    assert evaluated["loss"] == pytest.approx(eval_lines[-1]["loss"], rel=1e-5)


def test_every_file_of_a_run_folder_has_the_permissions_of_the_others(tmp_path):
    # safetensors writes owner-only files: exported weights would be the one thing a group cannot read
    import os
    import stat

    out = tmp_path / "run"
    train_in_process("mnist_cnn", f"output_dir={out}", *TINY_RUN, "train.ema_decay=0.9", "data.val_fraction=0.25",
                     "checkpoint.best_metric=accuracy", "checkpoint.every_steps=1")
    umask = os.umask(0)
    os.umask(umask)
    modes = {path.relative_to(out): stat.S_IMODE(path.stat().st_mode) for path in out.rglob("*") if path.is_file()}
    assert {"model.safetensors", "model_ema.safetensors", "model_best.safetensors", "config.yaml"} <= {
        str(path) for path in modes}
    assert any(path.name == "model.safetensors" and path.parent.name.startswith("step-") for path in modes)
    assert {path: mode for path, mode in modes.items() if mode != 0o666 & ~umask} == {}


@pytest.mark.parametrize("recipe, data_name, extra", [
    ("cifar10_resnet50", "synthetic CIFAR-10-shaped FakeData 3x32x32",
     ["data.synthetic=true", "model.sync_batchnorm=true"]),
    ("stl10_resnet18", "synthetic STL-10-shaped FakeData 3x96x96 resized to 224", ["data.synthetic=true"]),
])
def test_recipe_runs_one_step_on_fakedata_of_its_shape(recipe, data_name, extra, tmp_path):
    train_in_process(recipe, f"output_dir={tmp_path}", *TINY, *extra)
    (train_line,) = read_metrics(tmp_path, "train")
    (eval_line,) = read_metrics(tmp_path, "test")
    assert torch.isfinite(torch.tensor(train_line["loss"])), data_name
    assert eval_line["num_samples"] == 6 and "top5" in eval_line


def test_stl10_recipe_feeds_the_model_224_pixel_images():
    from accel_train.config import load_config
    from accel_train.data import build_dataset

    data = build_dataset(load_config("stl10_resnet18", ["data.synthetic=true", "data.train_subset=4"]).data, True)
    images, _ = data.dataset.__getitems__([0, 1])
    assert data.image_shape == (3, 224, 224) and tuple(images.shape) == (2, 3, 224, 224)


def _image_folder(root, classes=("cat", "dog", "owl"), per_class=4):
    for split in ("train", "val"):
        for index, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                color = (index * 80, i * 40, 200 - index * 60)
                Image.new("RGB", (40 + i, 36), color).save(folder / f"{i}.png")


@pytest.mark.parametrize("model_name", ["resnet18", "mobilenet_v3_small"])
def test_imagefolder_recipe_takes_classes_from_the_folder_and_any_torchvision_model(model_name, tmp_path):
    _image_folder(tmp_path / "images")
    out = tmp_path / "run"
    run_cli("train", "imagefolder", f"data.root={tmp_path / 'images'}", f"model.name={model_name}",
            "data.image_size=64", "data.num_workers=1", f"output_dir={out}", "train.max_steps=2",
            "train.batch_size=4", "train.eval_batch_size=5", "train.log_every_steps=1")
    (eval_line,) = read_metrics(out, "test")
    assert eval_line["num_samples"] == 12 and "top5" not in eval_line  # 3 classes: top-5 is meaningless
    head = [v for k, v in load_file(str(out / "model.safetensors")).items() if v.ndim == 2][-1]
    assert head.shape[0] == 3


def test_missing_dataset_gives_one_clear_error_naming_the_ways_to_provide_it(tmp_path):
    result = run_cli("train", "cifar10_resnet50", f"data.root={tmp_path}", "data.download=false",
                     f"output_dir={tmp_path / 'run'}", check=False)
    assert result.returncode == 3 and "Traceback" not in result.stderr, result.stderr  # README: exit 3
    message = result.stderr.strip().splitlines()[-1]
    assert "cifar10" in message and str(tmp_path) in message and "data.download" in message


def test_imagefolder_without_val_folder_says_what_layout_is_expected(tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    result = run_cli("train", "imagefolder", f"data.root={tmp_path}", f"output_dir={tmp_path / 'run'}", check=False)
    assert result.returncode != 0 and "val" in result.stderr and "<class>" in result.stderr


def test_a_short_run_gets_ten_train_lines_and_one_warning_for_a_warmup_longer_than_itself(tmp_path, capfd):
    """Unset train.log_every_steps: every 50 steps, or every tenth of a shorter run. A warmup the run never gets
    past (the imagefolder recipe's 100 steps on a small folder) is said once, at the start."""
    out = tmp_path / "run"
    train_in_process("mnist_cnn", "data.synthetic=true", "data.train_subset=640", "data.eval_subset=32",
                     "train.epochs=1", "train.batch_size=32", "train.warmup_steps=30", "checkpoint.at_epoch_end=false",
                     "train.plot=false", f"output_dir={out}")
    assert [line["step"] for line in read_metrics(out, "train")] == list(range(2, 21, 2))
    warnings = [line for line in capfd.readouterr().err.splitlines() if "warning" in line]
    assert warnings == ["accel-train: warning: train.warmup_steps=30 is longer than the run (20 optimizer steps): "
                        "the LR never reaches train.lr=0.001; lower train.warmup_steps (e.g. to 2)"], warnings


def test_a_warmup_longer_than_a_two_step_run_suggests_a_warmup_it_can_reach():
    from accel_train.config import TrainConfig
    from accel_train.training.optim import schedule_overruns

    said = schedule_overruns(TrainConfig(warmup_steps=100000, max_steps=2), steps_per_epoch=10)
    assert said.endswith("lower train.warmup_steps (e.g. to 1)"), said
