"""Contracts of regularisation and model selection: weight decay groups, label smoothing, an EMA of the weights,
MixUp/CutMix, file-backed augmentation, the validation split, model_best and early stopping.

The world-size contracts of MixUp/CutMix and of the validation split are in
contracts/test_same_training_at_any_world_size.py, exact resume with the EMA and MixUp/CutMix on at 2 processes in
checkpoints/test_checkpoints_stops_and_exact_resume.py.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file

from accel_train.config import load_config
from accel_train.errors import UserError
from accel_train.training.optim import build_optimizer
from accel_train.workloads.models import BatchNormCNN, MnistCNN
from support.commands import launch, train_in_process
from support.locations import PROBE
from support.runs import assert_same_run, crash_after_checkpoint_then_resume, read_metrics

# 48 samples: 2 optimizer steps of 24 per epoch; 101 eval samples.
RUN = ["mnist_cnn", "data.synthetic=true", "data.train_subset=48", "data.eval_subset=101", "model.dropout=false",
       "train.batch_size=24", "train.eval_batch_size=50", "train.log_every_steps=1", "train.plot=false"]


def test_biases_and_normalisation_weights_get_no_weight_decay_unless_asked():
    model = BatchNormCNN(10, (1, 28, 28))
    groups = build_optimizer(load_config("fashion_mnist_fast", []).train, model).param_groups
    decayed, kept = groups
    assert decayed["weight_decay"] > 0 and kept["weight_decay"] == 0
    assert all(p.ndim >= 2 for p in decayed["params"]) and all(p.ndim == 1 for p in kept["params"])
    assert len(decayed["params"]) + len(kept["params"]) == len(list(model.parameters()))
    (every,) = build_optimizer(load_config("fashion_mnist_fast", ["train.decay_norm_and_bias=true"]).train,
                               model).param_groups
    assert every["weight_decay"] > 0 and len(every["params"]) == len(list(model.parameters()))


def test_label_smoothing_is_cross_entropys_own_and_leaves_the_eval_loss_plain():
    from accel_train.data import Data
    from accel_train.workloads.tasks import task_named

    task = task_named("classification")
    task.setup(load_config("mnist_cnn", ["train.label_smoothing=0.1"]), Data(None, 10, (1, 28, 28)))
    images, labels = torch.randn(4, 1, 28, 28), torch.tensor([1, 2, 3, 4])
    logits = 8.0 * F.one_hot(labels, 10).float()  # a confident, right model: smoothing costs it most

    def model(inputs):
        return logits

    loss = float(task.training_step(model, (images, labels))["loss"])
    assert loss == pytest.approx(float(F.cross_entropy(logits, labels, label_smoothing=0.1)), rel=1e-6)
    assert loss != pytest.approx(float(F.cross_entropy(logits, labels)), rel=1e-3)
    with torch.no_grad():
        losses = task.eval_step(model, (images, labels))["losses"]
    assert torch.allclose(losses, F.cross_entropy(logits, labels, reduction="none"))


def test_the_ema_is_the_decayed_average_of_the_weights_and_loads_into_the_plain_model(tmp_path):
    train_in_process(*RUN, "train.epochs=1", "train.ema_decay=0.9", "checkpoint.every_steps=1",
                     f"output_dir={tmp_path}")
    first = load_file(str(tmp_path / "checkpoints" / "step-00000001" / "model.safetensors"))  # after step 1
    last, ema = load_file(str(tmp_path / "model.safetensors")), load_file(str(tmp_path / "model_ema.safetensors"))
    MnistCNN(10, (1, 28, 28)).load_state_dict(ema)  # strict: the plain model's names and shapes
    for name, weights in last.items():  # step 1 copies the weights; step 2 moves 10% of the way to them
        assert torch.allclose(ema[name], 0.9 * first[name] + 0.1 * weights, rtol=1e-5, atol=1e-7), name
    (line,) = read_metrics(tmp_path, "test")
    assert {"accuracy", "loss", "raw_accuracy", "raw_loss", "num_samples"} <= line.keys()
    assert "raw_num_samples" not in line and line["num_samples"] == 101


def test_resume_with_the_ema_on_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    # evaluating 20 samples, not RUN's 101: the evaluations (model and EMA) took most of the three runs' time
    run = [*RUN, "data.eval_subset=20", "train.epochs=2", "train.ema_decay=0.8", "checkpoint.every_steps=1"]
    train_in_process(*run, f"output_dir={tmp_path / 'reference'}")
    crash_after_checkpoint_then_resume(3, *run, f"output_dir={tmp_path / 'resumed'}")
    assert_same_run(tmp_path / "resumed", tmp_path / "reference", ("model.safetensors", "model_ema.safetensors"))


def test_mixing_is_a_function_of_seed_epoch_and_batch_number_and_pairs_neighbouring_samples():
    from accel_train.workloads.mixing import BatchMixer

    images, labels = torch.rand(6, 1, 8, 8), torch.tensor([0, 1, 2, 3, 4, 5])
    mixup = BatchMixer(6, seed=0, mixup_alpha=0.4, cutmix_alpha=0.0)
    mixed, targets = mixup((images, labels), epoch=0, number=3)
    again, _ = BatchMixer(6, seed=0, mixup_alpha=0.4, cutmix_alpha=0.0)((images, labels), epoch=0, number=3)
    assert torch.equal(mixed, again)
    weight = float(targets[0, 0])
    assert 0 < weight < 1 and torch.allclose(targets.sum(1), torch.ones(6))
    partner = [1, 0, 3, 2, 5, 4]  # sample 2k with 2k+1: a pair never straddles two processes' shares
    assert torch.allclose(mixed, weight * images + (1 - weight) * images[partner])
    assert torch.allclose(targets, weight * F.one_hot(labels, 6) + (1 - weight) * F.one_hot(labels[partner], 6))
    draws = {mixup.draw(epoch, number, 8, 8) for epoch in (0, 1) for number in range(4)}
    assert len(draws) == 8, "another epoch or batch draws another mix"
    assert BatchMixer(6, 1, 0.4, 0.0).draw(0, 3, 8, 8) != mixup.draw(0, 3, 8, 8), "another seed too"

    cutmix = BatchMixer(6, seed=0, mixup_alpha=0.0, cutmix_alpha=1.0)
    number = next(n for n in range(20) if cutmix.draw(0, n, 8, 8).weight < 1)  # a box of 0 pixels mixes nothing
    cut, targets = cutmix((images, labels), epoch=0, number=number)
    y1, y2, x1, x2 = cutmix.draw(0, number, 8, 8).box
    pasted = torch.zeros(8, 8, dtype=torch.bool)
    pasted[y1:y2, x1:x2] = True
    assert torch.equal(cut[..., pasted], images[partner][..., pasted])
    assert torch.equal(cut[..., ~pasted], images[..., ~pasted])
    assert float(targets[0, 0]) == pytest.approx(1 - pasted.float().mean().item())  # the label weight is the area

    never = BatchMixer(6, seed=0, mixup_alpha=0.4, cutmix_alpha=1.0, mix_prob=0.0)
    assert never((images, labels), 0, 0)[1] is labels
    both = BatchMixer(6, seed=0, mixup_alpha=0.4, cutmix_alpha=1.0, switch_prob=0.5)
    kinds = {both.draw(0, number, 8, 8).box is None for number in range(40)}
    assert kinds == {True, False}, "with both on, some batches get MixUp and some CutMix"


def test_mixing_needs_class_labels_and_file_backed_augmentation_needs_per_sample_transforms():
    from accel_train.workloads.tasks import task_named
    from accel_train.workloads.tasks.base import check_mixing

    with pytest.raises(UserError, match="task=vae does not mix"):
        check_mixing(task_named("vae"), load_config("mnist_vae", ["train.mixup_alpha=0.2"]))
    with pytest.raises(UserError, match="data.on_device=false"):
        task_named("classification").check_config(load_config("mnist_cnn", ["data.trivial_augment=true"]))
    task_named("classification").check_config(load_config("mnist_cnn", ["data.trivial_augment=true",
                                                                         "data.on_device=false"]))
    task_named("classification").check_config(load_config("mnist_cnn", ["data.trivial_augment=true",
                                                                         "data.random_erasing=0.25",
                                                                         "data.name=shards", "data.root=shards"]))
    with pytest.raises(UserError, match="early_stop_metric"):
        load_config("mnist_cnn", ["train.early_stop_patience=3"])
    with pytest.raises(UserError, match="data.val_fraction"):
        load_config("mnist_cnn", ["data.val_fraction=1"])
    with pytest.raises(UserError, match="train.mix_prob: a probability"):
        load_config("mnist_cnn", ["train.mix_prob=1.5"])


def test_trivial_augment_and_random_erasing_run_on_file_backed_training_images_only(tmp_path):
    from torchvision.transforms import v2

    from accel_train.data.imagefolder import imagefolder_transform
    from accel_train.data.in_memory import InMemoryImages, PerSampleImages

    config = load_config("imagefolder", ["data.trivial_augment=true", "data.random_erasing=0.25"])
    train, evaluation = (imagefolder_transform(config.data, train) for train in (True, False))
    assert {type(step) for step in train.transforms} >= {v2.TrivialAugmentWide, v2.RandomErasing}
    assert not {type(step) for step in evaluation.transforms} & {v2.TrivialAugmentWide, v2.RandomErasing}
    images = torch.randint(0, 256, (4, 1, 28, 28), dtype=torch.uint8)
    source = InMemoryImages(images, torch.arange(4), (0.5,), (0.5,), augment=True)
    steps = [type(step).__name__ for step in PerSampleImages(source, True, 0.25).transform.transforms]
    assert steps[0] == "TrivialAugmentWide" and steps[-1] == "RandomErasing"


def test_trivial_augment_on_shards_of_a_dataset_by_import_path_is_refused_in_one_line(tmp_path):
    """Its samples were written as its own transforms made them (tensors): there is no image to augment."""
    from accel_train.data.shards.writer import write_shards
    from support.locations import USER_RECIPE

    write_shards(load_config(USER_RECIPE, ["data.name=user_models:points"]).data, str(tmp_path / "shards"))
    with pytest.raises(UserError) as refused:
        train_in_process(USER_RECIPE, "data.name=shards", f"data.root={tmp_path / 'shards'}",
                         f"data.cache_dir={tmp_path / 'cache'}", "data.trivial_augment=true",
                         f"output_dir={tmp_path / 'run'}")
    assert str(refused.value) == ("data.trivial_augment / data.random_erasing: the shards at "
                                  f"data.root={tmp_path / 'shards'} hold the samples of data.name=user_models:points, "
                                  "a dataset by import path, as its own transforms made them; augment them in that "
                                  "dataset, or leave both keys out")


def test_the_validation_split_is_drawn_by_seed_disjoint_from_training_and_evaluated_unaugmented():
    from accel_train.data import Data, InMemoryImages, hold_out_validation

    images = torch.arange(50, dtype=torch.uint8).view(50, 1, 1, 1).expand(50, 1, 4, 4)
    data = Data(InMemoryImages(images, torch.arange(50) % 10, (0.5,), (0.5,), augment=True), 10, (1, 4, 4))
    cfg = load_config("mnist_cnn", ["data.val_fraction=0.2"]).data

    def split(seed, cfg=cfg):
        train, val = hold_out_validation(cfg, seed, data)
        return train.dataset.images[:, 0, 0, 0].tolist(), val.dataset.images[:, 0, 0, 0].tolist(), train, val

    kept, held, train, val = split(0)
    assert len(held) == 10 and sorted(kept + held) == list(range(50))
    assert train.dataset.augment and not val.dataset.augment
    assert split(0)[:2] == (kept, held) and split(1)[1] != held
    assert split(0, load_config("mnist_cnn", ["data.val_fraction=0.2", "data.eval_subset=4"]).data)[1] == held[:4]
    assert hold_out_validation(load_config("mnist_cnn", []).data, 0, data)[1] is None
    with pytest.raises(UserError, match="holds out 0 of the 50"):
        hold_out_validation(load_config("mnist_cnn", ["data.val_fraction=0.001"]).data, 0, data)


def _image_folder(root, splits, classes=("cat", "dog"), per_class=3):
    for split in splits:
        for index, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            for i in range(per_class + (split == "val")):
                Image.new("RGB", (20, 20), (index * 80, i * 40, 100)).save(root / split / name / f"{i}.png")


def test_an_imagefolder_val_folder_beside_test_is_the_validation_split(tmp_path):
    from accel_train.data import build_dataset, hold_out_validation

    _image_folder(tmp_path, ("train", "val", "test"))
    cfg = load_config("imagefolder", [f"data.root={tmp_path}"]).data
    train, val = hold_out_validation(cfg, 0, build_dataset(cfg, train=True))
    assert (len(train.dataset), len(val.dataset), len(build_dataset(cfg, train=False).dataset)) == (6, 8, 6)
    assert val.dataset.root.endswith("val") and not any("Random" in repr(t) for t in val.dataset.transform.transforms)
    with pytest.raises(UserError, match="has a validation split of its own"):
        hold_out_validation(load_config("imagefolder", [f"data.root={tmp_path}", "data.val_fraction=0.1"]).data, 0,
                            train)


def test_model_best_holds_the_weights_of_the_best_validation_step_and_loads_into_the_plain_model(tmp_path):
    # 64 samples, 16 held out: 2 steps per epoch, evaluated on validation after every step.
    train_in_process(*RUN, "data.train_subset=64", "train.epochs=2", "data.val_fraction=0.25",
                     "train.eval_every_steps=1", "checkpoint.every_steps=1", "checkpoint.keep_last=10",
                     "checkpoint.best_metric=loss", "checkpoint.best_mode=min", "train.lr=0.01",
                     f"output_dir={tmp_path}")
    val = read_metrics(tmp_path, "val")
    assert [line["step"] for line in val] == [1, 2, 3, 4] and {line["num_samples"] for line in val} == {16}
    (test,) = read_metrics(tmp_path, "test")
    assert test["num_samples"] == 101 and test["step"] == 4
    best = min(val, key=lambda line: line["loss"])["step"]
    model_best = load_file(str(tmp_path / "model_best.safetensors"))
    MnistCNN(10, (1, 28, 28)).load_state_dict(model_best)  # strict: the plain model's names and shapes
    at_best = load_file(str(tmp_path / "checkpoints" / f"step-{best:08d}" / "model.safetensors"))
    assert all(torch.equal(model_best[key], at_best[key]) for key in at_best)


def test_the_selection_state_counts_evaluations_without_improvement_and_survives_a_checkpoint():
    from accel_train.training.selection import ModelSelection, Watched

    watched = Watched("loss", "min", min_delta=0.1)
    assert [watched.improves(value) for value in (1.0, 0.95, 0.8, 0.85)] == [True, False, True, False]
    assert (watched.best, watched.evaluations_without_improvement) == (0.8, 1)
    accuracy = Watched("accuracy", "max")
    assert [accuracy.improves(value) for value in (0.5, 0.5, 0.6)] == [True, False, True]

    config = load_config("mnist_cnn", ["checkpoint.best_metric=accuracy", "train.early_stop_patience=2"])
    saved = ModelSelection(config, accelerator=None, folder=Path("unused"))
    saved.best.improves(0.7), saved.early_stop.improves(0.7), saved.early_stop.improves(0.6)
    saved.stopped = True
    restored = ModelSelection(config, accelerator=None, folder=Path("unused"))
    restored.load_state_dict(json.loads(json.dumps(saved.state_dict())))  # as the loop state file holds it
    assert (restored.best, restored.early_stop, restored.stopped) == (saved.best, saved.early_stop, True)
    other = ModelSelection(load_config("mnist_cnn", ["checkpoint.best_metric=loss", "checkpoint.best_mode=min",
                                                     "train.early_stop_patience=2"]), accelerator=None,
                           folder=Path("unused"))
    other.load_state_dict(saved.state_dict())  # another metric since the save: its history does not apply
    assert other.best.best is None and other.early_stop.evaluations_without_improvement == 0


def test_early_stopping_stops_every_process_at_the_same_step_and_saves_the_final_checkpoint(tmp_path):
    # 3 steps per epoch, evaluations at steps 2 (mid-epoch), 3 (epoch end), 4 (mid-epoch), ...; an improvement must
    # beat the best loss by 100, so only the first evaluation counts as one and the patience of 2 ends it at 4.
    out, probes = tmp_path / "run", tmp_path / "probes"
    run = ["mnist_cnn", "data.synthetic=true", "data.train_subset=96", "data.val_fraction=0.25",
           "data.eval_subset=40", "train.batch_size=24", "train.epochs=3", "train.eval_every_steps=2",
           "train.early_stop_patience=2", "train.early_stop_metric=loss", "train.early_stop_mode=min",
           "train.early_stop_min_delta=100", "train.log_every_steps=1", "checkpoint.at_epoch_end=false",
           "checkpoint.every_steps=100", "train.plot=false"]
    result = launch(2, "train", *run, f"output_dir={out}", script=PROBE, env={"PROBE_DIR": str(probes)})
    assert "early stopping: loss has not improved" in result.stdout and "stopped at step 4" in result.stdout
    saves = [json.loads((probes / f"rank{rank}.json").read_text())["saves"] for rank in (0, 1)]
    assert saves == [[4], [4]], "every process saved the final checkpoint at the stop, and nothing else"
    assert [line["step"] for line in read_metrics(out, "val")] == [2, 3, 4]
    assert [line["step"] for line in read_metrics(out, "test")] == [4]
    assert max(line["step"] for line in read_metrics(out, "train")) == 4
    # Resumed, the run stays stopped: nothing more is trained.
    launch(2, "train", *run, f"output_dir={out}", "resume=auto")
    assert max(line["step"] for line in read_metrics(out, "train")) == 4


def test_a_selection_metric_a_task_did_not_name_beforehand_is_checked_at_the_first_evaluation(tmp_path):
    """A user's Task without `metrics` cannot be checked before training: its first evaluation is, in one line on
    every process alike, before anything is exported or saved under a metric that is not there."""
    from types import SimpleNamespace

    from accel_train.config import load_config
    from accel_train.errors import UserError
    from accel_train.training.selection import ModelSelection

    config = load_config("mnist_cnn", ["checkpoint.best_metric=msee", f"output_dir={tmp_path}"])
    selection = ModelSelection(config, SimpleNamespace(num_processes=1), tmp_path)
    with pytest.raises(UserError, match=r"checkpoint.best_metric=msee is not an eval metric \(did you mean mse\?\); "
                                        r"eval reports mae, mse, num_samples"):
        selection.update({"num_samples": 4, "mse": 0.5, "mae": 0.4}, model=None)
    assert not (tmp_path / "model_best.safetensors").exists()


@pytest.mark.parametrize("keys, split, warned", [
    (["checkpoint.best_metric=accuracy"], "test", True),
    (["train.early_stop_patience=2", "train.early_stop_metric=loss"], "test", True),
    (["checkpoint.best_metric=accuracy"], "val", False),
    ([], "test", False),
])
def test_choosing_the_best_model_or_stopping_early_on_the_test_set_is_warned_of(keys, split, warned, tmp_path, capsys):
    from types import SimpleNamespace

    from accel_train.training.selection import ModelSelection

    selection = ModelSelection(load_config("mnist_cnn", keys), SimpleNamespace(is_main_process=True), tmp_path)
    selection.warn_if_choosing_on(split)
    said = capsys.readouterr().err
    assert ("accel-train: warning: checkpoint.best_metric / train.early_stop_patience choose on the test set" in said) \
        == warned, said
