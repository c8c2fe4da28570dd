"""Contracts of dropout keyed by sample (training/dropout.py): with dropout on, a run trains the same at 1, 2 and 3
processes, with its global batch in one micro-batch or split into two, and across a resume at another world size
(a checkpoint of 2 processes continued at 3), within the N x B tolerance: a sample's mask is a function of (seed,
step, its index, the layer) alone. On a model of ours (mnist_cnn: two nn.Dropout), a torchvision model with dropout
(squeezenet1_1, no BatchNorm, whose statistics are per process) and a user's model by import path with Dropout2d,
AlphaDropout and Dropout. With train.keyed_dropout=false (torch's masks, per process) the same runs differ: the test
that the keying is what makes them alike."""

import pytest
from safetensors.torch import load_file

from support.commands import launch
from support.locations import USER_RECIPE
from support.runs import read_metrics

# 48 samples, global batch 12: 4 steps, one epoch; a checkpoint at step 2 (mid-epoch)
COMMON = ["data.train_subset=48", "data.eval_subset=10", "train.batch_size=12", "train.max_steps=4",
          "train.log_every_steps=1", "checkpoint.at_epoch_end=false", "train.plot=false", "data.num_workers=0"]
MODELS = {
    "ours:mnist_cnn": ["mnist_cnn", "data.synthetic=true"],
    "torchvision:squeezenet1_1": ["mnist_cnn", "data.name=cifar10", "data.synthetic=true",
                                    "model.name=squeezenet1_1"],
    "users:user_models.DropoutNet": [USER_RECIPE, "model.name=user_models:DropoutNet"],
}


def weights(run) -> dict:
    return load_file(str(run / "model.safetensors"))


def assert_alike(one: dict, other: dict, tolerance: float = 1e-5) -> None:
    assert one.keys() == other.keys()
    for name, reference in one.items():
        difference = (other[name] - reference).norm()
        assert difference <= tolerance * reference.norm() + 1e-7, f"{name}: {difference:.2e} apart"


def runs_of(root, args: list[str]) -> dict:
    """The same run at 1, 2 and 3 processes, at 1 with two micro-batches a step, and at 2 stopped at step 2 then
    continued at 3."""
    found = {}
    for processes in (1, 2, 3):
        found[processes] = root / f"p{processes}"
        launch(processes, "train", *args, f"output_dir={found[processes]}", timeout=300)
    found["split"] = root / "split"
    launch(1, "train", *args, "train.accumulation_steps=2", f"output_dir={found['split']}", timeout=300)
    found["2 then 3"] = root / "resumed"
    launch(2, "train", *args, "train.max_steps=2", "checkpoint.every_steps=2", f"output_dir={found['2 then 3']}",
           timeout=300)
    (found["2 then 3"] / "model.safetensors").unlink()
    launch(3, "train", *args, "checkpoint.every_steps=2", "resume=auto", f"output_dir={found['2 then 3']}",
           timeout=300)
    return found


@pytest.fixture(scope="module", params=list(MODELS))
def keyed_runs(request, tmp_path_factory):
    return request.param, runs_of(tmp_path_factory.mktemp("keyed"), [*MODELS[request.param], *COMMON])


def test_dropout_trains_alike_at_any_world_size_micro_batch_and_across_a_resume(keyed_runs):
    model, runs = keyed_runs
    reference = weights(runs[1])
    for name in (2, 3, "split", "2 then 3"):
        assert_alike(reference, weights(runs[name]))
        lines = [line["loss"] for line in read_metrics(runs[name], "train")]
        assert lines == pytest.approx([line["loss"] for line in read_metrics(runs[1], "train")], rel=1e-5), \
            (model, name)


def test_with_torchs_own_masks_the_same_runs_differ_between_world_sizes(tmp_path):
    """train.keyed_dropout=false: each process draws its masks from its own stream (the switch, and what the
    keying changes)."""
    args = [*MODELS["ours:mnist_cnn"], *COMMON, "train.keyed_dropout=false"]
    for processes in (1, 2):
        launch(processes, "train", *args, f"output_dir={tmp_path / str(processes)}", timeout=300)
    one, two = weights(tmp_path / "1"), weights(tmp_path / "2")
    assert any((two[name] - one[name]).norm() > 1e-3 * one[name].norm() for name in one)
