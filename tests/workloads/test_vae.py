"""Contracts of the VAE workload: its loss terms, pictures, evaluation at any world size and prior samples.

The non-finite guard, which every recipe shares, is in training/test_nonfinite_guard.py."""

import math

import pytest
import torch
from PIL import Image

from support.commands import last_json_line, launch, train_in_process
from support.locations import needs_fashion_mnist
from support.runs import read_metrics

TERMS = {"loss", "reconstruction_loss", "kl"}
# 97 samples in batches of 20: a ragged last batch that splits evenly across neither 2 nor 3 processes
SYNTHETIC = ["data.synthetic=true", "data.train_subset=48", "data.eval_subset=97", "train.eval_batch_size=20",
             "model.hidden_size=32", "model.latent_size=4", "train.plot=false"]
TINY_RUN = [*SYNTHETIC, "train.batch_size=12", "train.log_every_steps=1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("vae")
    train_in_process("mnist_vae", f"output_dir={out}", *TINY_RUN, "train.max_steps=3")
    return out


def test_vae_logs_its_loss_terms_and_draws_pictures_after_each_evaluation(trained):
    train_lines, (eval_line,) = read_metrics(trained, "train"), read_metrics(trained, "test")
    assert [line["step"] for line in train_lines] == [1, 2, 3]
    for line in [*train_lines, eval_line]:
        assert TERMS <= set(line) and all(math.isfinite(line[name]) for name in TERMS)
        assert line["loss"] == pytest.approx(line["reconstruction_loss"] + line["kl"], rel=1e-5)  # beta = 1
    assert eval_line["num_samples"] == 97
    pairs = trained / "images" / "reconstructions_step000003.png"
    samples = trained / "images" / "samples_step000003.png"
    with Image.open(pairs) as image:
        image.load()
        # 16 of the first 20 eval images (whole rows of 8) above their reconstructions: 4 rows of 28 px + padding
        assert image.size == (8 * 30 + 2, 4 * 30 + 2)
    with Image.open(samples) as image:
        image.load()
        assert image.size == (8 * 30 + 2, 8 * 30 + 2)  # 64 draws from the prior


# 97 samples do not split evenly across 2 processes; 3 processes are evaluated in
# distributed/test_exact_eval_at_any_world_size_and_world_size_checks.py (the same gather_for_metrics)
@pytest.mark.parametrize("processes", [2])  # against the plain process's evaluation of the same weights
def test_vae_eval_terms_are_identical_at_any_world_size(trained, processes):
    reference = read_metrics(trained, "test")[-1]  # the same weights, evaluated by the plain 1-process run
    result = last_json_line(launch(processes, "eval", "mnist_vae", f"checkpoint={trained}", *SYNTHETIC).stdout)
    assert (result["num_samples"], result["num_processes"]) == (97, processes)
    for name in TERMS:
        assert result[name] == pytest.approx(reference[name], rel=1e-6), name


def test_prior_samples_decode_the_same_draws_at_every_evaluation_whatever_the_global_rng():
    from accel_train.config import load_config
    from accel_train.workloads.tasks.vae import VAE_MODELS, VAETask

    task, config = VAETask(), load_config("mnist_vae", ["seed=7"])
    task.setup(config, None)
    model = VAE_MODELS.get(config.model.name)((1, 28, 28), config.model.latent_size, config.model.hidden_size).eval()
    images = torch.rand(4, 1, 28, 28)
    grids = []
    for global_seed in (0, 1):  # training draws from the global RNG between evaluations
        torch.manual_seed(global_seed)
        with torch.no_grad():
            grids.append(task._pictures(model, images, model(images, sample=False)[0])["samples"])
    assert grids[0].shape == (64, 1, 28, 28) and torch.equal(grids[0], grids[1])


def test_vae_refuses_standardised_pixels_before_any_work():
    from accel_train.config import load_config
    from accel_train.errors import UserError
    from accel_train.workloads.tasks import TASKS

    with pytest.raises(UserError, match="data.normalize=false"):
        TASKS.get("vae")().check_config(load_config("mnist_vae", ["data.normalize=true"]))


@needs_fashion_mnist
def test_fashion_mnist_vae_beats_a_model_that_predicts_grey_for_every_pixel(tmp_path):
    out = tmp_path / "run"
    train_in_process("fashion_mnist_vae", f"output_dir={out}", f"data.root={tmp_path / 'data'}",
                     "data.train_subset=1280", "data.eval_subset=500", "train.batch_size=64", "train.epochs=1",
                     "train.plot=false")
    (eval_line,) = read_metrics(out, "test")
    grey = 28 * 28 * math.log(2)  # -log p(x) of any image under p = 0.5 per pixel, with kl = 0: 543 nats
    assert eval_line["loss"] < 0.85 * grey, eval_line  # 417 nats after these 20 steps; 526 untrained
