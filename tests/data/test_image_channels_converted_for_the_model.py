"""Contracts of data.channels (data/channels.py): images of one channel count given to a model that takes another are
converted where they are normalised, the same on the device and on the host, in training, eval and predict: one grey
channel repeated (resnet18 on Fashion-MNIST as given), three into one by their luma (RGB images into a 1-channel
model). A model's channels are its own (torchvision's 3, a timm model's in_chans, an hf: model's num_channels) or, for
a model built for the data, the data's; config.yaml records the value taken. What cannot be converted, or a count
the model does not take, is one line, exit 2, before anything is made."""

import json

import pytest
import torch
import torchvision
import yaml
from safetensors.torch import load_file
from torch.utils.data import TensorDataset
from torchvision.transforms.v2 import functional

from accel_train import api
from accel_train.config import DataConfig, load_config
from accel_train.data import build_dataset
from accel_train.errors import UserError
from accel_train.workloads.models import build_model
from accel_train.workloads.tasks import task_named
from support.commands import train_in_process
from support.hub import COLOURS, as_image_files, colour_dataset, tiny_vit
from support.locations import FASHION_MNIST, needs_fashion_mnist
from support.runs import read_metrics

TINY = ("train.warmup_steps=0", "train.plot=false", "train.log_with=none", "data.num_workers=0",
        "checkpoint.at_epoch_end=false")


def checked(recipe: str, *overrides: str):
    """The recipe with `overrides`, through the task's checks (which take the model's input defaults)."""
    config = load_config(recipe, list(overrides))
    task_named(config.task).check_config(config)
    return config


@needs_fashion_mnist
def test_resnet18_trains_on_fashion_mnist_as_given_and_eval_and_predict_of_its_run_agree(tmp_path):
    """torchvision's resnet18 takes RGB: each grey image is repeated into its three channels; predict reads a file as
    the run's evaluation reads its images."""
    run = tmp_path / "run"
    train_in_process("fashion_mnist_cnn", "model.name=resnet18", f"data.root={FASHION_MNIST}", "data.train_subset=64",
                     "data.eval_subset=16", "train.batch_size=16", "train.max_steps=4", *TINY, f"output_dir={run}")
    test = torchvision.datasets.FashionMNIST(str(FASHION_MNIST), train=False)
    (tmp_path / "files").mkdir()
    for index in range(16):
        test[index][0].save(tmp_path / "files" / f"{index:02d}.png")

    metrics = api.evaluate(str(run))
    rows = api.predict(str(run), inputs=str(tmp_path / "files"))

    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["channels"] == 3
    assert load_file(str(run / "model.safetensors"))["conv1.weight"].shape[1] == 3  # the model as torchvision builds it
    classes = json.loads((run / "classes.json").read_text())
    correct = sum(row["labels"][0] == classes[test[index][1]] for index, row in enumerate(rows))
    assert metrics["num_samples"] == len(rows) == 16 and metrics["correct"] == correct
    assert metrics["accuracy"] == read_metrics(run, "test")[-1]["accuracy"]
    with pytest.raises(UserError, match=r"data.channels=1 \(trained with 3\)"):  # what the weights mean
        api.evaluate(str(run), overrides=["data.channels=1"])


@needs_fashion_mnist
def test_a_model_built_for_the_data_records_the_datas_channels_in_config_yaml(tmp_path):
    run = tmp_path / "run"
    train_in_process("fashion_mnist_cnn", f"data.root={FASHION_MNIST}", "data.train_subset=16", "data.eval_subset=4",
                     "train.batch_size=16", *TINY, f"output_dir={run}")

    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["channels"] == 1


@needs_fashion_mnist
@pytest.mark.parametrize("pretrained", [False, True])
def test_a_grey_image_given_to_an_rgb_model_is_its_channel_repeated_alike_on_the_device_and_on_the_host(pretrained):
    """Normalised by the dataset's own mean repeated, or by the pretrained weights' own per channel: the model sees
    a grey image as it saw grey photographs in RGB."""
    overrides = ["model.name=resnet18", f"data.root={FASHION_MNIST}", "data.eval_subset=2",
                 f"model.pretrained={str(pretrained).lower()}"]
    made = {}
    for on_device in (True, False):
        cfg = checked("fashion_mnist_cnn", *overrides, f"data.on_device={str(on_device).lower()}").data
        data = build_dataset(cfg, train=False)
        made[on_device] = torch.stack([data.dataset[index][0] for index in range(2)])
    grey = torchvision.datasets.FashionMNIST(str(FASHION_MNIST), train=False).data[:2, None].float() / 255

    mean, std = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)) if pretrained else ((0.2860,) * 3, (0.3530,) * 3)
    assert (cfg.channels, data.image_shape) == (3, (3, 28, 28))
    assert torch.equal(made[True], made[False])
    assert torch.allclose(made[True], (grey - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1))


def test_rgb_images_given_to_a_one_channel_model_are_their_luma_in_training_eval_and_predict(tmp_path):
    """mnist_cnn built for data.channels=1 on an RGB image folder of blue and green, which their luma tells apart."""
    colours = colour_dataset({"train": (("blue", "green"), 4), "test": (("blue", "green"), 2)})
    for split in ("train", "test"):
        as_image_files(colours[split], tmp_path / "tree" / split)
    run = tmp_path / "run"
    train_in_process("imagefolder", f"data.root={tmp_path / 'tree'}", "model.name=mnist_cnn", "data.channels=1",
                     "data.image_size=8", "data.augment=false", "train.batch_size=8", "train.epochs=30",
                     "train.max_steps=30", "train.lr=0.05", *TINY, f"output_dir={run}")

    metrics = api.evaluate(str(run))
    rows = api.predict(str(run), inputs=str(tmp_path / "tree" / "test"))

    assert load_file(str(run / "model.safetensors"))["features.0.weight"].shape[1] == 1
    assert metrics["num_samples"] == len(rows) == 4
    assert metrics["accuracy"] == sum(row["labels"][0] == row["path"].split("/")[-2] for row in rows) / 4 == 1.0
    cfg = load_config(str(run), []).data
    data = build_dataset(cfg, train=False)
    image = data.finish.images(data.dataset[0][0])  # blue/0.png: one colour, (0, 0, 153)
    pixel = torch.tensor([0.0, 0.0, 153.0]).view(3, 1, 1) / 255
    mean, std = (functional.rgb_to_grayscale(torch.tensor(values).view(3, 1, 1)).item()
                 for values in ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)))  # ImageNet's, as the images' luma
    assert cfg.channels == 1 and image.shape == (1, 8, 8)
    assert torch.allclose(image, (functional.rgb_to_grayscale(pixel) - mean) / std, atol=1e-5)


@needs_fashion_mnist
def test_a_timm_model_takes_grey_images_into_its_stem_built_for_them_by_in_chans_else_repeated():
    """timm's in_chans builds the stem for one channel (timm adapts pretrained weights itself); without it the grey
    channel is repeated into the stem's three."""
    for given, channels in (([], 3), (["model.args.in_chans=1"], 1)):
        config = checked("fashion_mnist_cnn", "model.name=timm:test_resnet", f"data.root={FASHION_MNIST}",
                         "data.eval_subset=3", *given)
        data = build_dataset(config.data, train=False)
        model = build_model(config.model, 10, data.image_shape).eval()
        images = torch.stack([data.dataset[index][0] for index in range(3)])
        assert (config.data.channels, images.shape[1]) == (channels, channels)
        assert model(images).shape == (3, 10)


def test_an_hf_model_takes_its_configs_num_channels_rgb_images_given_a_grey_vit_as_their_luma(tmp_path):
    colours = colour_dataset({"train": (tuple(COLOURS), 1), "validation": (tuple(COLOURS), 1)})
    colours.save_to_disk(str(tmp_path / "saved"))
    vit = tiny_vit(tmp_path / "vit", list(COLOURS), channels=1)

    config = checked("imagefolder", f"model.name=hf:{vit}", f"data.name=hf:{tmp_path / 'saved'}")
    data = build_dataset(config.data, train=False)
    model = build_model(config.model, 3, data.image_shape, list(COLOURS)).eval()

    images = data.finish.images(torch.stack([data.dataset[index][0] for index in range(3)]))
    assert (config.data.channels, config.data.mean, images.shape[1:]) == (1, [0.5], (1, 16, 16))
    assert model(images).logits.shape == (3, 3)


@needs_fashion_mnist
@pytest.mark.parametrize("overrides, words", [
    (["model.name=resnet18", "data.channels=1"],
     "data.channels=1: model.name=resnet18 takes 3-channel images; leave data.channels unset, and images of another "
     "count are converted to 3 where they are normalised"),
    (["model.name=timm:test_resnet", "model.args.in_chans=2", "data.name=cifar10", "data.synthetic=true"],
     "data.channels=2 (the channels the model takes): data.name=cifar10 gives 3-channel images, and only 1 channel "
     "converts into any other count (repeated), 3 into 1 (their luma); choose a model that takes 3 (a timm model: "
     "model.args.in_chans=3) and set data.channels=3"),
])
def test_channels_the_model_does_not_take_or_that_do_not_convert_are_one_line_exit_2_leaving_nothing(tmp_path,
                                                                                                    overrides, words):
    with pytest.raises(UserError) as refused:
        train_in_process("fashion_mnist_cnn", f"data.root={FASHION_MNIST}", *overrides, *TINY,
                         f"output_dir={tmp_path / 'run'}")

    assert refused.value.exit_code == 2 and str(refused.value) == words
    assert not (tmp_path / "run").exists()


def test_a_dataset_of_ones_own_given_other_channels_than_the_model_takes_is_one_line():
    """Its inputs are its own making: accel-train converts none, and says so rather than the model's traceback."""
    grey = TensorDataset(torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))

    with pytest.raises(UserError) as refused:
        build_dataset(DataConfig(name="<given>", channels=3), train=True, given=grey)

    assert str(refused.value) == (
        "data.channels=3 (the channels the model takes): train_dataset gives 1-channel inputs (1, 8, 8), which a "
        "dataset of one's own makes itself (accel-train converts none); give the model 3-channel inputs, or choose "
        "a model that takes 1")
    assert build_dataset(DataConfig(name="<given>", channels=1), train=True, given=grey).image_shape == (1, 8, 8)
    assert build_dataset(DataConfig(name="<given>"), train=True, given=grey).image_shape == (1, 8, 8)
