"""Contracts of regularisation and model selection: weight decay groups, label smoothing, an EMA of the weights."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from accel_train.config import load_config
from accel_train.models import BatchNormCNN, MnistCNN
from accel_train.optim import build_optimizer
from conftest import read_metrics, train_in_process

# 48 samples: 2 optimizer steps of 24 per epoch; 101 eval samples.
RUN = ["mnist_cnn", "data.synthetic=true", "data.train_subset=48", "data.eval_subset=101", "model.dropout=false",
       "train.batch_size=24", "train.eval_batch_size=50", "train.log_every_steps=1"]


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
    from accel_train.tasks import task_named

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
    (line,) = read_metrics(tmp_path, "eval")
    assert {"accuracy", "loss", "raw_accuracy", "raw_loss", "num_samples"} <= line.keys()
    assert "raw_num_samples" not in line and line["num_samples"] == 101


def test_resume_with_the_ema_on_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    from accel_train.checkpoint import Checkpoints

    run = [*RUN, "train.epochs=2", "train.ema_decay=0.8", "checkpoint.every_steps=1"]
    train_in_process(*run, f"output_dir={tmp_path / 'reference'}")

    class Crash(Exception):
        pass

    save = Checkpoints.save

    def save_then_crash(self, progress, *args, **kwargs):
        saved = save(self, progress, *args, **kwargs)
        if progress.step == 3:
            raise Crash
        return saved

    monkeypatch.setattr(Checkpoints, "save", save_then_crash)
    with pytest.raises(Crash):
        train_in_process(*run, f"output_dir={tmp_path / 'resumed'}")
    monkeypatch.setattr(Checkpoints, "save", save)
    train_in_process(*run, f"output_dir={tmp_path / 'resumed'}", "resume=auto")

    def lines(folder):
        return [{k: v for k, v in json.loads(line).items() if k != "samples_per_s"}
                for line in (tmp_path / folder / "metrics.jsonl").read_text().splitlines()]

    assert lines("resumed") == lines("reference")
    for file in ("model.safetensors", "model_ema.safetensors"):
        ours, theirs = (load_file(str(tmp_path / folder / file)) for folder in ("resumed", "reference"))
        assert all(torch.equal(ours[key], theirs[key]) for key in theirs), file
