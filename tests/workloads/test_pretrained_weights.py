"""Contracts of model.pretrained: torchvision's weights from TORCH_HOME's cache (no network here: the weights file
is made locally in torchvision's cache layout), a new head for the data's classes, the weights' normalisation,
and a one-line error naming the file and the folder when the weights are neither cached nor downloadable."""

import pytest
import torch
import torchvision
import yaml
from safetensors.torch import load_file

from accel_train.errors import UserError
from support.commands import run_cli, train_in_process

RESNET18_FILE = "resnet18-f37072fd.pth"  # the name torchvision's ResNet18_Weights.DEFAULT downloads to
# The imagefolder recipe on FakeData of 10 classes (no image folder needed), small images for speed.
RUN = ["imagefolder", "data.synthetic=true", "data.image_size=32", "data.train_subset=16", "data.eval_subset=8",
       "data.num_workers=0", "train.batch_size=8", "train.eval_batch_size=8", "train.max_steps=2",
       "model.name=resnet18", "model.pretrained=true", "train.plot=false"]


@pytest.fixture
def torch_home(tmp_path, monkeypatch):
    """A TORCH_HOME whose cache holds 'pretrained' resnet18 weights: a seeded random model's."""
    torch.manual_seed(123)
    weights = torchvision.models.resnet18().state_dict()
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(weights, tmp_path / "hub" / "checkpoints" / RESNET18_FILE)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    return weights


def test_pretrained_weights_load_from_the_cache_with_a_new_head_and_their_normalisation(torch_home, tmp_path):
    out = tmp_path / "run"
    train_in_process(*RUN, "model.freeze_backbone=true", f"output_dir={out}")
    trained = load_file(str(out / "model.safetensors"))
    parameters = {name for name, _ in torchvision.models.resnet18().named_parameters()}
    for name in parameters - {"fc.weight", "fc.bias"}:  # frozen: exactly the cached weights after training
        assert torch.equal(trained[name], torch_home[name]), name
    assert trained["fc.weight"].shape == (10, 512)  # the new head, for FakeData's 10 classes, trained
    data = yaml.safe_load((out / "config.yaml").read_text())["data"]
    assert data["mean"] == pytest.approx([0.485, 0.456, 0.406]) and data["std"] == pytest.approx([0.229, 0.224, 0.225])


def test_fine_tuning_trains_the_backbone_too(torch_home, tmp_path):
    train_in_process(*RUN, f"output_dir={tmp_path}")
    trained = load_file(str(tmp_path / "model.safetensors"))
    assert not torch.equal(trained["conv1.weight"], torch_home["conv1.weight"])
    assert (trained["conv1.weight"] - torch_home["conv1.weight"]).norm() < 0.1 * torch_home["conv1.weight"].norm()


def test_offline_without_cached_weights_exits_3_naming_the_file_and_the_folder(tmp_path):
    # A proxy that refuses every connection stands for a machine without network.
    env = {"TORCH_HOME": str(tmp_path / "torch"), "https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY":
           "http://127.0.0.1:9", "no_proxy": "", "NO_PROXY": ""}
    result = run_cli("train", *RUN, f"output_dir={tmp_path / 'run'}", check=False, env=env)
    assert result.returncode == 3, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and RESNET18_FILE in lines[0] and str(tmp_path / "torch" / "hub" / "checkpoints") in lines[0]


@pytest.mark.parametrize("overrides, words", [
    (["model.name=mnist_cnn"], ["mnist_cnn is not a torchvision, hf: or timm: model"]),
    (["model.pretrained=false", "model.freeze_backbone=true"], ["model.freeze_backbone=true needs model.pretrained"]),
    (["data.mean=[0.5]", "data.std=[0.5]"], ["one value per channel"]),
])
def test_pretrained_mistakes_are_named_in_one_line(tmp_path, overrides, words):
    with pytest.raises(UserError) as error:
        train_in_process(*RUN, *overrides, f"output_dir={tmp_path}")
    assert all(word in str(error.value) for word in words), str(error.value)
