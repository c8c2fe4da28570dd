"""Contracts of models and data from the Hugging Face Hub by name, offline: `model.name=hf:REPO` (transformers'
AutoModelForImageClassification), `model.name=timm:NAME` and `data.name=hf:WHERE` (datasets), each from a local
folder or a Hub name resolved from the Hugging Face cache (support/hub.py makes them: tiny ViT and ResNet configs saved
by save_pretrained, datasets of one-colour images as parquet repositories and save_to_disk folders).

What holds: the model's image processor (timm: its pretrained_cfg) gives the data keys the user left unset; a new head
wherever the run's classes differ from the checkpoint's; a repository's own code runs only with
model.trust_remote_code, and its weights load from safetensors only unless model.allow_pickled_weights; a dataset's
columns are found by type, its classes are its ClassLabel's names, its evaluation split labelled by name; what is
neither cached nor reachable is one line, exit 3, leaving nothing behind."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from accel_train.config import load_config
from accel_train.data import build_dataset
from accel_train.errors import DataNotFoundError, UserError
from accel_train.workloads.models import build_model
from accel_train.workloads.tasks import task_named
from support.commands import run_cli, train_in_process
from support.hub import (
    COLOURS,
    as_arrow_repository,
    as_image_files,
    as_parquet_repository,
    colour_dataset,
    into_cache,
    tiny_resnet,
    tiny_vit,
)
from support.runs import read_metrics

TRAINING = ("data.augment=false", "data.num_workers=0", "train.batch_size=8", "train.epochs=20", "train.max_steps=20",
            "train.warmup_steps=0", "train.lr=0.05", "train.plot=false", "checkpoint.at_epoch_end=false")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Folders: a tiny ViT of the three colours, a tiny ResNet; the colour dataset (train: 8 a colour, its ClassLabel
    blue, green, red; validation: 3 of blue and red, its ClassLabel red, green, blue, as a split written apart lists
    them) as a parquet repository and as save_to_disk wrote it; the validation images as files under their classes'
    names."""
    import datasets

    root = tmp_path_factory.mktemp("hub")
    validation = colour_dataset({"validation": (("blue", "red"), 3)}, class_names=("red", "green", "blue"))
    colours = datasets.DatasetDict(train=colour_dataset({"train": (tuple(COLOURS), 8)})["train"], **validation)
    colours.save_to_disk(str(root / "saved"))
    return {"vit": tiny_vit(root / "vit", list(COLOURS)), "resnet": tiny_resnet(root / "resnet"),
            "parquet": as_parquet_repository(colours, root / "parquet"), "saved": root / "saved",
            "files": as_image_files(validation["validation"], root / "files")}


def checked(*overrides: str):
    """The imagefolder recipe with `overrides`, through the task's checks (which take the model's input defaults)."""
    config = load_config("imagefolder", list(overrides))
    task_named(config.task).check_config(config)
    return config


@pytest.mark.floors
def test_an_hf_model_on_an_hf_dataset_trains_evaluates_and_predicts_by_its_classes_names(hub, tmp_path):
    run = tmp_path / "run"
    train_in_process("imagefolder", f"data.name=hf:{hub['parquet']}", f"model.name=hf:{hub['vit']}",
                     "model.pretrained=true", *TRAINING, f"output_dir={run}")

    from accel_train import api

    metrics = api.evaluate(str(run))
    rows = api.predict(str(run), inputs=str(hub["files"]))
    assert json.loads((run / "classes.json").read_text()) == list(COLOURS)
    predicted = sum(row["labels"][0] == row["path"].split("/")[-2] for row in rows) / len(rows)
    assert metrics["num_samples"] == len(rows) == 6  # validation lists red first: read by position, accuracy 0
    assert metrics["accuracy"] == read_metrics(run, "test")[-1]["accuracy"] == predicted == 1.0


@pytest.mark.floors
def test_the_models_image_processor_gives_the_data_keys_the_user_left_unset(hub):
    vit = checked(f"model.name=hf:{hub['vit']}").data
    assert (vit.image_size, vit.mean, vit.std, vit.crop_fraction, vit.interpolation) == \
        (16, [0.5] * 3, [0.25] * 3, 1.0, "bicubic")
    resnet = checked(f"model.name=hf:{hub['resnet']}").data  # ConvNeXt's processor: crop_pct, ImageNet's mean
    assert (resnet.image_size, resnet.crop_fraction, resnet.mean) == (16, 0.8, [0.485, 0.456, 0.406])
    mine = checked(f"model.name=hf:{hub['vit']}", "data.image_size=24", "data.mean=[0.4,0.4,0.4]",
                   "data.std=[0.2,0.2,0.2]", "data.interpolation=bilinear").data
    assert (mine.image_size, mine.mean, mine.std, mine.interpolation, mine.crop_fraction) == \
        (24, [0.4] * 3, [0.2] * 3, "bilinear", 1.0)


@pytest.mark.floors
def test_a_pretrained_hf_model_keeps_its_head_only_for_the_same_classes(hub):
    saved = load_file(str(hub["vit"] / "model.safetensors"))
    config = load_config("imagefolder", [f"model.name=hf:{hub['vit']}", "model.pretrained=true"]).model

    def head_and_body(classes):
        model = build_model(config, len(classes), (3, 16, 16), classes)
        return model.classifier.weight.detach(), model.vit.embeddings.patch_embeddings.projection.weight.detach()

    same = head_and_body(list(COLOURS))
    assert torch.equal(same[0], saved["classifier.weight"])
    others = head_and_body(["owl", "ant", "bee"])  # as many classes, other names: a head of their own
    assert not torch.equal(others[0], saved["classifier.weight"])
    more = head_and_body(["a", "b", "c", "d", "e"])
    assert more[0].shape == (5, 16)
    for _, body in (same, others, more):  # the pretrained body each time
        assert torch.equal(body, saved["vit.embeddings.patch_embeddings.projection.weight"])


@pytest.mark.floors
def test_a_repository_with_code_of_its_own_runs_it_only_with_trust_remote_code(hub, tmp_path):
    repo = shutil.copytree(hub["vit"], tmp_path / "with_code")
    marker = tmp_path / "code-ran"
    (repo / "configuration_tiny.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import ViTConfig\nclass TinyConfig(ViTConfig):\n    model_type = 'tiny-vit'\n")
    config = json.loads((repo / "config.json").read_text())
    config["auto_map"], config["model_type"] = {"AutoConfig": "configuration_tiny.TinyConfig"}, "tiny-vit"
    (repo / "config.json").write_text(json.dumps(config))

    with pytest.raises(UserError) as refused:
        checked(f"model.name=hf:{repo}")

    assert str(refused.value) == (f"model.name=hf:{repo}: the repository ships Python code of its own (auto_map), "
                                  "which runs only with model.trust_remote_code=true: set it only for a repository you "
                                  "trust")
    assert not marker.exists()


def only_pickled(model, folder):
    """A copy of the saved `model` whose weights are only a pytorch_model.bin, as older uploads are."""
    pickled = shutil.copytree(model, folder)
    torch.save(load_file(str(pickled / "model.safetensors")), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    return pickled


@pytest.mark.floors
def test_weights_only_in_a_pickle_load_only_when_allowed(hub, tmp_path):
    pickled = only_pickled(hub["vit"], tmp_path / "pickled")
    config = load_config("imagefolder", [f"model.name=hf:{pickled}", "model.pretrained=true"]).model

    with pytest.raises(UserError, match=r"the repository has no safetensors weights, only a pickled file "
                                        r"\(pytorch_model.bin\); set model.allow_pickled_weights=true"):
        build_model(config, 3, (3, 16, 16), list(COLOURS))
    config.allow_pickled_weights = True
    loaded = build_model(config, 3, (3, 16, 16), list(COLOURS))
    assert torch.equal(loaded.classifier.weight, load_file(str(hub["vit"] / "model.safetensors"))["classifier.weight"])


class RunsCode:
    """Unpickled, it runs a shell command that creates `marker`."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.floors  # transformers before 4.47 raises OSError from the refusal
@pytest.mark.parametrize("content, words", [
    ("a call", "holds a call to posix.system, which torch.load(weights_only=True) refuses; nothing in it was run"),
    ("garbage", "does not load with torch.load(weights_only=True) ("),
])
def test_allowed_pickled_weights_that_weights_only_refuses_are_one_line_naming_the_file_and_nothing_runs(
        hub, tmp_path, content, words):
    pickled = only_pickled(hub["vit"], tmp_path / "pickled")
    marker = tmp_path / "code-ran"
    weights = pickled / "pytorch_model.bin"
    if content == "a call":
        torch.save({**torch.load(weights), "extra": RunsCode(marker)}, weights)
    else:
        weights.write_bytes(b"\x80\x02garbage" * 64)
    config = load_config("imagefolder", [f"model.name=hf:{pickled}", "model.pretrained=true",
                                         "model.allow_pickled_weights=true"]).model

    with pytest.raises(DataNotFoundError) as refused:
        build_model(config, 3, (3, 16, 16), list(COLOURS))

    assert str(refused.value).startswith(f"model.name=hf:{pickled}: {weights} {words}")
    assert str(refused.value).endswith("; use a repository with safetensors weights, or convert these to safetensors "
                                       "where you trust their source") and "\n" not in str(refused.value)
    assert not marker.exists()


@pytest.mark.floors  # datasets before 4 runs a loading script (with trust_remote_code)
@pytest.mark.parametrize("given, exit_type, words", [
    ("folder", DataNotFoundError, "data.name=hf:{data}: {data}/scripted.py is a dataset loading script, which "
                                  "accel-train never runs"),
    ("script", DataNotFoundError, "data.name=hf:{data}/scripted.py: {data}/scripted.py is a dataset loading script"),
    ("trust_remote_code", UserError, "data.args.trust_remote_code: a dataset's loading script never runs in "
                                     "accel-train"),
])
def test_a_dataset_loading_script_never_runs_and_is_one_line(hub, tmp_path, given, exit_type, words):
    """A folder of parquet files beside a script named as the folder, which datasets takes for the dataset's."""
    data = shutil.copytree(hub["parquet"], tmp_path / "scripted")
    marker = tmp_path / "code-ran"
    (data / "scripted.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    name = {"folder": f"data.name=hf:{data}", "script": f"data.name=hf:{data / 'scripted.py'}",
            "trust_remote_code": f"data.name=hf:{data}"}[given]
    extra = ["data.args.trust_remote_code=true"] if given == "trust_remote_code" else []

    with pytest.raises(UserError) as refused:
        build_dataset(load_config("imagefolder", [name, *extra]).data, train=True)

    assert type(refused.value) is exit_type and str(refused.value).startswith(words.format(data=data)), \
        str(refused.value)
    assert "\n" not in str(refused.value) and not marker.exists()


@pytest.mark.floors
def test_hub_names_resolve_from_the_cache_offline_and_a_name_it_lacks_is_one_line_exit_3(hub, tmp_path):
    """As a user's machine holds them after `hf download`: the model and the dataset by Hub name, HF_HUB_OFFLINE=1;
    the dataset's validation split labelled by its own file's class names (it lists red first)."""
    home = tmp_path / "hf_home"
    into_cache(home, "models", "tiny/vit", hub["vit"])
    into_cache(home, "datasets", "tiny/colours", hub["parquet"])
    into_cache(home, "models", "tiny/pickled", only_pickled(hub["vit"], tmp_path / "pickled"))
    env = {"HF_HOME": str(home)}
    run_cli("train", "imagefolder", "data.name=hf:tiny/colours", "model.name=hf:tiny/vit", "model.pretrained=true",
            *TRAINING, f"output_dir={tmp_path / 'run'}", env=env)
    final = read_metrics(tmp_path / "run", "test")[-1]
    assert (final["num_samples"], final["accuracy"]) == (6, 1.0)

    cases = {"model.name=hf:tiny/missing": ["model.name=hf:tiny/missing: reading its config failed (",
                                            f"a Hub repository must be in the Hugging Face cache ({home / 'hub'}; "
                                            "HF_HOME sets it) or downloadable"],
             "data.name=hf:tiny/missing": ["data.name=hf:tiny/missing: cannot load it"]}
    for missing, named in cases.items():
        result = run_cli("train", "imagefolder", "data.name=hf:tiny/colours", "model.name=hf:tiny/vit", missing,
                         f"output_dir={tmp_path / 'refused'}", env=env, check=False)
        errors = [line for line in result.stderr.splitlines() if line.startswith("accel-train: error:")]
        assert result.returncode == 3 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
        assert all(words in errors[0] for words in named), errors[0]
        assert not (tmp_path / "refused").exists()
    # a cached repository whose weights are only a pickle: the cache says so, offline, without loading it
    result = run_cli("train", "imagefolder", "data.name=hf:tiny/colours", "model.name=hf:tiny/pickled",
                     "model.pretrained=true", f"output_dir={tmp_path / 'pickled_run'}", env=env, check=False)
    assert result.returncode == 2 and "the repository has no safetensors weights, only a pickled file " \
        "(pytorch_model.bin); set model.allow_pickled_weights=true" in result.stderr, result.stderr


@pytest.mark.floors
def test_a_timm_model_takes_its_pretrained_cfg_as_the_data_defaults_and_trains(hub, tmp_path):
    import timm

    data = checked("model.name=timm:test_resnet").data
    expected = timm.data.resolve_data_config({}, model=timm.create_model("test_resnet"))  # timm's own reading
    assert (data.image_size, data.crop_fraction, data.interpolation, data.mean, data.std) == \
        (expected["input_size"][-1], expected["crop_pct"], expected["interpolation"], list(expected["mean"]),
         list(expected["std"]))
    train_in_process("imagefolder", f"data.name=hf:{hub['parquet']}", "model.name=timm:test_resnet",
                     "data.image_size=32", *TRAINING, "train.max_steps=2", f"output_dir={tmp_path / 'run'}")
    assert read_metrics(tmp_path / "run", "test")[-1]["num_samples"] == 6


def test_timm_pretrained_weights_from_a_local_file_give_the_body_and_a_new_head(tmp_path):
    import timm
    from safetensors.torch import save_file

    pretrained = timm.create_model("test_resnet")  # 1000 classes, as timm's own weights
    save_file(pretrained.state_dict(), str(tmp_path / "weights.safetensors"))
    overlay = f"model.args.pretrained_cfg_overlay={{file: {tmp_path / 'weights.safetensors'}}}"
    config = load_config("imagefolder", ["model.name=timm:test_resnet", "model.pretrained=true", overlay]).model
    model = build_model(config, 3, (3, 32, 32), list(COLOURS))
    assert torch.equal(model.stem[0].weight if hasattr(model, "stem") else next(model.parameters()),
                       pretrained.stem[0].weight if hasattr(pretrained, "stem") else next(pretrained.parameters()))
    assert model.get_classifier().out_features == 3


def test_timm_pretrained_weights_neither_cached_nor_reachable_are_one_line_exit_3():
    config = load_config("imagefolder", ["model.name=timm:test_resnet", "model.pretrained=true"]).model
    with pytest.raises(DataNotFoundError) as refused:
        build_model(config, 3, (3, 32, 32), list(COLOURS))
    assert str(refused.value).startswith("model.name=timm:test_resnet: its pretrained weights (timm/test_resnet."), \
        str(refused.value)
    assert "model.args.pretrained_cfg_overlay.file=PATH" in str(refused.value)


def test_an_unknown_timm_model_is_one_line_naming_the_closest():
    with pytest.raises(UserError, match=r"timm has no model resnet181 \(did you mean resnet18\?\)"):
        checked("model.name=timm:resnet181")


@pytest.mark.floors
@pytest.mark.parametrize("written", ["save_to_disk", "parquet", "arrow"])
def test_an_hf_dataset_finds_its_columns_by_type_and_labels_each_split_by_the_names_it_was_written_with(tmp_path,
                                                                                                       written):
    """Columns named img and tag; the validation split's ClassLabel lists the colours in another order. load_dataset
    gives every split of a folder of parquet or arrow files the features of the first file it reads: each file's
    integers are read by the names written into it."""
    import datasets

    train = colour_dataset({"train": (tuple(COLOURS), 2)}, image_column="img", label_column="tag")
    reordered = colour_dataset({"validation": (("red", "blue"), 1)}, class_names=("red", "green", "blue"),
                               image_column="img", label_column="tag")
    both = datasets.DatasetDict(train=train["train"], validation=reordered["validation"])
    folder = {"save_to_disk": saved, "parquet": as_parquet_repository, "arrow": as_arrow_repository}[written](
        both, tmp_path / "d")
    cfg = load_config("imagefolder", [f"data.name=hf:{folder}", "data.image_size=8"]).data

    training, evaluation = build_dataset(cfg, train=True), build_dataset(cfg, train=False)  # by the train split's

    assert training.classes == evaluation.classes == list(COLOURS) and training.num_classes == 3
    assert [int(evaluation.dataset[index][1]) for index in range(2)] == [2, 0]  # red, blue by name
    image = training.dataset[0][0]
    assert image.dtype == torch.uint8 and image.shape == (3, 8, 8)  # normalised on the device, as ImageFolder's


def saved(dataset, folder):
    dataset.save_to_disk(str(folder))
    return folder


@pytest.mark.parametrize("written", ["parquet", "image folder"])
def test_an_hf_evaluation_class_the_run_never_trained_on_is_one_line_exit_3_before_anything_trains(tmp_path,
                                                                                                   written):
    """The test split has green, which the training split lacks: in a parquet file, its own ClassLabel names it; in an
    image folder, datasets names the classes of every split's folders, and the training split's are its samples'."""
    import datasets

    train = colour_dataset({"train": (("blue", "red"), 2)}, class_names=("blue", "red"))["train"]
    test = colour_dataset({"test": (tuple(COLOURS), 1)})["test"]
    if written == "parquet":
        folder = as_parquet_repository(datasets.DatasetDict(train=train, test=test), tmp_path / "d")
    else:
        folder = as_image_files(test, as_image_files(train, tmp_path / "d" / "train").parent / "test").parent

    with pytest.raises(DataNotFoundError) as refused:
        train_in_process("imagefolder", f"data.name=hf:{folder}", "model.name=mnist_cnn", "data.image_size=8",
                         *TRAINING, "train.batch_size=4", "train.max_steps=2", f"output_dir={tmp_path / 'run'}")

    message = str(refused.value)
    assert refused.value.exit_code == 3 and "\n" not in message
    assert message.startswith(f"data.name=hf:{folder}: the test split has class 'green', which the run never trained "
                              "on (its 2 classes: blue, red)"), message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.floors
def test_a_dataset_without_an_evaluation_split_holds_out_val_fraction_of_its_training_split(tmp_path):
    from accel_train.data.validation import hold_out_validation

    colour_dataset({"train": (tuple(COLOURS), 4)}).save_to_disk(str(tmp_path / "d"))
    name = f"data.name=hf:{tmp_path / 'd'}"
    with pytest.raises(UserError, match="has no evaluation split .its splits: train.; set data.val_fraction"):
        build_dataset(load_config("imagefolder", [name]).data, train=False)

    cfg = load_config("imagefolder", [name, "data.val_fraction=0.25", "data.image_size=8"]).data
    training, evaluation = build_dataset(cfg, train=True), build_dataset(cfg, train=False)

    assert (len(training.dataset), len(evaluation.dataset)) == (9, 3)
    assert not set(training.dataset.indices) & set(evaluation.dataset.indices)
    assert build_dataset(cfg, train=False).dataset.indices == evaluation.dataset.indices  # the same every run
    assert hold_out_validation(cfg, 0, training, evaluation)[1] is None  # the fraction made the evaluation split


def test_a_parquet_repository_and_a_save_to_disk_folder_give_the_same_samples(hub):
    samples = {}
    for kind in ("parquet", "saved"):
        data = build_dataset(load_config("imagefolder", [f"data.name=hf:{hub[kind]}", "data.image_size=8"]).data,
                             train=False)
        samples[kind] = [(data.dataset[index][0], data.dataset[index][1]) for index in range(len(data.dataset))]
    assert len(samples["parquet"]) == 6
    assert all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(samples["parquet"], samples["saved"]))


@pytest.mark.parametrize("overrides, words", [
    (["data.image_column=picture"], "data.image_column=picture: data.name=hf:{saved} has the columns image, label"),
    (["data.eval_split=dev"], "data.eval_split=dev: data.name=hf:{saved} has the splits train, validation"),
    (["data.train_split=all"], "data.train_split=all: data.name=hf:{saved} has the splits train, validation"),
])
def test_a_column_or_split_that_is_not_there_is_one_line_naming_those_there_are(hub, overrides, words):
    with pytest.raises(UserError) as refused:
        build_dataset(load_config("imagefolder", [f"data.name=hf:{hub['saved']}", *overrides]).data, train=True)
    assert str(refused.value) == words.format(saved=hub["saved"])


def test_without_the_hub_extra_hf_and_timm_models_are_one_line_naming_it(monkeypatch):
    for module, name in (("transformers", "hf:google/vit-base-patch16-224"), ("timm", "timm:resnet18")):
        monkeypatch.setitem(__import__("sys").modules, module, None)  # not installed
        with pytest.raises(UserError) as refused:
            checked(f"model.name={name}")
        assert str(refused.value) == f"model.name={name}: {module} is not installed: pip install 'accel-train[hub]'"


def test_the_hf_image_classification_recipe_runs_with_its_names_given_as_local_folders(hub, tmp_path):
    """The recipe names Hub repositories (ViT-B/16, beans) that need the network; every key stays overridable."""
    config = load_config("hf_image_classification", [])
    assert (config.model.name, config.data.name, config.model.pretrained) == \
        ("hf:google/vit-base-patch16-224-in21k", "hf:AI-Lab-Makerere/beans", True)
    train_in_process("hf_image_classification", f"model.name=hf:{hub['vit']}", f"data.name=hf:{hub['saved']}",
                     "train.batch_size=8", "train.max_steps=1", "train.warmup_steps=0", "data.num_workers=0",
                     "train.plot=false", f"output_dir={tmp_path / 'run'}")
    assert read_metrics(tmp_path / "run", "test")[-1]["num_samples"] == 6


@pytest.mark.parametrize("images", ["as_given", "raw"])
def test_shards_of_an_hf_dataset_train_as_the_dataset_does(hub, tmp_path, images):
    """accel-train shard data.name=hf:...: each image's own bytes (or raw pixels), labels by the training split's
    names, ImageFolder's transforms: the evaluation split's model inputs and labels are the dataset's own."""
    from accel_train.config import DataConfig
    from accel_train.data.shards.writer import write_shards

    source = load_config("imagefolder", [f"data.name=hf:{hub['saved']}", "data.image_size=8"]).data
    write_shards(source, str(tmp_path / "shards"), images=images, **({"shrink_to": 12} if images == "raw" else {}))
    shards = DataConfig(name="shards", root=str(tmp_path / "shards"), cache_dir=str(tmp_path / "cache"), image_size=8)

    direct, stored = (build_dataset(cfg, train=False) for cfg in (source, shards))

    assert stored.classes == direct.classes == list(COLOURS) and len(stored.dataset) == len(direct.dataset) == 6
    for index in range(6):
        (one, label), (other, other_label) = direct.dataset[index], stored.dataset[index]
        assert int(label) == int(other_label) and torch.equal(one, other), index
