"""Contracts of labels by name (data/classes.py): an evaluation split's labels index the run's classes (the training
split's names, classes.json) by name, on every path that reads one: an ImageFolder tree's test/ and val/, the shards
written from it (and shards written before, whose test index numbered its own classes), `eval` of a run on another
folder, and a dataset of one's own that carries `classes`. A split that lacks a class scores as predict labels it; a
class the run never trained on is one line, exit 3, before anything trains.

The trees are 8x8 one-colour PNGs (blue, green, red), which a small CNN tells apart within a few steps."""

import shutil

import numpy as np
import pytest
from PIL import Image
from torch.utils.data import Dataset

from accel_train import api
from accel_train.config import DataConfig, load_config
from accel_train.data import build_dataset
from accel_train.data.shards.writer import write_shards
from accel_train.errors import DataNotFoundError
from support.commands import train_in_process
from support.runs import read_metrics

COLOURS = {"blue": (0, 0, 255), "green": (0, 255, 0), "red": (255, 0, 0)}
TRAINING = ("data.image_size=8", "data.augment=false", "data.num_workers=0", "model.name=mnist_cnn",
            "train.batch_size=8", "train.epochs=10", "train.max_steps=30", "train.warmup_steps=0", "train.lr=0.05",
            "train.plot=false", "checkpoint.at_epoch_end=false")


def colour_tree(root, splits: dict[str, tuple[str, ...]], per_class: int = 4):
    """root/SPLIT/CLASS/i.png for each split's classes: one colour a class, a shade a file."""
    for split, names in splits.items():
        for name in names:
            (root / split / name).mkdir(parents=True)
            for number in range(per_class):
                pixel = (np.array(COLOURS[name]) * (0.7 + 0.1 * number)).astype(np.uint8)
                Image.fromarray(np.full((8, 8, 3), pixel, np.uint8)).save(root / split / name / f"{number}.png")
    return root


def labels_of(data) -> list[int]:
    return [int(data.dataset[index][1]) for index in range(len(data.dataset))]


def predicted_accuracy(rows: list[dict]) -> float:
    """The share of files whose top label is their class folder's name."""
    return sum(row["labels"][0] == row["path"].split("/")[-2] for row in rows) / len(rows)


@pytest.fixture(scope="module")
def lacking_green(tmp_path_factory):
    """A tree whose test/ lacks the middle class (green), and a run trained on it."""
    root = tmp_path_factory.mktemp("lacking_green")
    tree = colour_tree(root / "tree", {"train": ("blue", "green", "red"), "test": ("blue", "red")})
    train_in_process("imagefolder", f"data.root={tree}", *TRAINING, f"output_dir={root / 'run'}")
    return tree, root / "run"


def test_an_evaluation_folder_lacking_a_class_scores_as_predict_labels_its_files(lacking_green, tmp_path):
    """Indexed on its own, test/ would label red 1 (green's index): the run's own evaluation would report half the
    accuracy predict shows, and eval would build a head of 2 classes for weights of 3."""
    tree, run = lacking_green

    metrics = api.evaluate(str(run))
    rows = api.predict(str(run), inputs=str(tree / "test"), output=str(tmp_path / "predictions.csv"))

    assert metrics["num_samples"] == 8 and predicted_accuracy(rows) == 1.0, (metrics, rows)  # the run learned
    assert metrics["accuracy"] == read_metrics(run, "test")[-1]["accuracy"] == predicted_accuracy(rows)


def test_the_evaluation_split_of_a_tree_labels_each_folder_by_the_training_splits_names(tmp_path):
    tree = colour_tree(tmp_path, {"train": ("blue", "green", "red"), "test": ("red", "blue")}, per_class=1)
    cfg = load_config("imagefolder", [f"data.root={tree}"]).data

    test = build_dataset(cfg, train=False)

    assert (test.classes, test.num_classes, labels_of(test)) == (["blue", "green", "red"], 3, [0, 2])


def test_a_val_folder_beside_test_is_labelled_by_the_training_splits_names_too(tmp_path):
    from accel_train.data.validation import hold_out_validation

    tree = colour_tree(tmp_path, {"train": ("blue", "green", "red"), "test": ("blue",), "val": ("green", "red")},
                       per_class=1)
    cfg = load_config("imagefolder", [f"data.root={tree}"]).data

    _, validation = hold_out_validation(cfg, 0, build_dataset(cfg, train=True))

    assert labels_of(validation) == [1, 2]


def test_an_evaluation_class_the_run_never_trained_on_is_one_line_exit_3_before_anything_trains(tmp_path):
    tree = colour_tree(tmp_path / "tree", {"train": ("blue", "red"), "test": ("blue", "green", "red")})

    with pytest.raises(DataNotFoundError) as refused:
        train_in_process("imagefolder", f"data.root={tree}", *TRAINING, f"output_dir={tmp_path / 'run'}")

    message = str(refused.value)
    assert refused.value.exit_code == 3 and "\n" not in message
    assert f"{tree / 'test'} has class 'green', which the run never trained on (its 2 classes: blue, red)" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_eval_of_a_run_on_a_folder_with_only_a_test_split_labels_it_by_the_runs_classes(lacking_green, tmp_path):
    """The run's classes.json, not the folder's own: it has no train/ to name them, and lacks blue."""
    _, run = lacking_green
    other = colour_tree(tmp_path / "other", {"test": ("green", "red")}, per_class=3)

    metrics = api.evaluate(str(run), overrides=[f"data.root={other}"])
    rows = api.predict(str(run), inputs=str(other / "test"), output=str(tmp_path / "predictions.csv"))

    assert metrics["num_samples"] == 6 and metrics["accuracy"] == predicted_accuracy(rows)


def test_shards_of_a_tree_record_the_training_splits_classes_in_every_split(tmp_path):
    tree = colour_tree(tmp_path / "tree", {"train": ("blue", "green", "red"), "test": ("red",), "val": ("green",)},
                       per_class=1)
    write_shards(load_config("imagefolder", [f"data.root={tree}"]).data, str(tmp_path / "shards"), shard_mb=0.001)
    cfg = DataConfig(name="shards", root=str(tmp_path / "shards"), cache_dir=str(tmp_path / "cache"), image_size=8)
    from accel_train.data.shards.dataset import read_index
    from accel_train.storage import Store

    store = Store(str(tmp_path / "shards"), "data.root")
    assert [read_index(store, split).classes for split in ("train", "test", "val")] == [["blue", "green", "red"]] * 3
    assert labels_of(build_dataset(cfg, train=False)) == [2]


def test_shards_written_when_each_split_numbered_its_own_classes_are_relabelled_by_name(tmp_path):
    """Before labels by name, the test split's index listed its own folders (red alone: label 0): read by name,
    it is label 2 of the train split's classes."""
    full = colour_tree(tmp_path / "full", {"train": ("blue", "green", "red"), "test": ("red",)}, per_class=1)
    alone = colour_tree(tmp_path / "alone", {"train": ("red",), "test": ("red",)}, per_class=1)
    for tree in (full, alone):
        write_shards(load_config("imagefolder", [f"data.root={tree}"]).data, str(tmp_path / f"{tree.name}_shards"),
                     shard_mb=0.001)
    shutil.rmtree(tmp_path / "full_shards" / "test")
    shutil.copytree(tmp_path / "alone_shards" / "test", tmp_path / "full_shards" / "test")
    cfg = DataConfig(name="shards", root=str(tmp_path / "full_shards"), cache_dir=str(tmp_path / "cache"),
                     image_size=8)

    test = build_dataset(cfg, train=False)

    assert (test.classes, labels_of(test)) == (["blue", "green", "red"], [2])


class NamedColours(Dataset):
    """A dataset of one's own with torchvision's `classes`: label i is the name classes[i]."""

    def __init__(self, classes: list[str]) -> None:
        self.classes = classes

    def __len__(self) -> int:
        return len(self.classes)

    def __getitem__(self, index: int):
        return np.zeros(1, np.float32), index


def test_a_dataset_of_ones_own_that_names_its_classes_is_labelled_by_the_runs_names():
    cfg = DataConfig(name="<given>")

    test = build_dataset(cfg, train=False, given=NamedColours(["red", "blue"]), classes=["blue", "green", "red"])
    assert (test.classes, test.num_classes, labels_of(test)) == (["blue", "green", "red"], 3, [2, 0])

    with pytest.raises(DataNotFoundError, match="class 'owl', which the run never trained on"):
        build_dataset(cfg, train=False, given=NamedColours(["owl"]), classes=["blue", "green", "red"])
