"""Contracts of `accel-train export RUN output=DIR`: a run's model as a folder its own library loads, computing what the
run computes: an hf: model through transformers' pipeline("image-classification") gives the labels and scores
`accel-train predict` gives; a timm: model through timm.create_model("local-dir:DIR", pretrained=True) the run's
logits; any model as ONNX, its outputs checked against onnxruntime's. Each folder has a model card. Offline: a tiny ViT
and timm's test_resnet on one-colour images (support/hub.py)."""

import json

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from accel_train import api
from accel_train.cli import main
from support.commands import train_in_process
from support.hub import COLOURS, as_parquet_repository, colour_dataset, tiny_vit

TRAINING = ("data.augment=false", "data.num_workers=0", "train.batch_size=8", "train.epochs=4", "train.max_steps=4",
            "train.warmup_steps=0", "train.lr=0.05", "train.plot=false", "checkpoint.at_epoch_end=false")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs of an hf: model, a timm: model and one of the registry's, and image files of each colour (not square)."""
    root = tmp_path_factory.mktemp("export")
    data = as_parquet_repository(colour_dataset({"train": (tuple(COLOURS), 8), "validation": (("blue", "red"), 2)}),
                                 root / "data")
    vit = tiny_vit(root / "vit", list(COLOURS))
    train_in_process("imagefolder", f"data.name=hf:{data}", f"model.name=hf:{vit}", "model.pretrained=true",
                     *TRAINING, f"output_dir={root / 'hf'}")
    train_in_process("imagefolder", f"data.name=hf:{data}", "model.name=timm:test_resnet", "data.image_size=32",
                     *TRAINING, f"output_dir={root / 'timm'}")
    train_in_process("mnist_cnn", "data.synthetic=true", "data.train_subset=16", "data.eval_subset=8",
                     "train.batch_size=8", "train.max_steps=2", "train.plot=false", f"output_dir={root / 'cnn'}")
    files = root / "files"
    files.mkdir()
    for number, (name, colour) in enumerate(COLOURS.items()):
        pixels = np.full((20 + 3 * number, 14, 3), colour, np.uint8)
        pixels[::3] = pixels[::3] // 2  # stripes: resizing and cropping matter
        Image.fromarray(pixels).save(files / f"{name}.png")
    return root


def exported(run, output, *options: str) -> None:
    main(["export", str(run), f"output={output}", *options])


def card(folder) -> dict:
    text = (folder / "README.md").read_text()
    assert text.startswith("---\n"), text[:200]
    return yaml.safe_load(text.split("---\n")[1])


def test_an_hf_run_exported_gives_in_transformers_pipeline_the_labels_and_scores_predict_gives(runs, tmp_path, capsys):
    from transformers import pipeline

    exported(runs / "hf", tmp_path / "vit")
    predicted = api.predict(str(runs / "hf"), inputs=str(runs / "files"), output=str(tmp_path / "predictions.csv"))
    classify = pipeline("image-classification", model=str(tmp_path / "vit"), top_k=1)

    for row in predicted:
        (best,) = classify(row["path"])
        assert best["label"] == row["labels"][0] and best["score"] == pytest.approx(row["scores"][0], abs=1e-3), row
    config = json.loads((tmp_path / "vit" / "config.json").read_text())
    assert config["id2label"] == {str(index): name for index, name in enumerate(COLOURS)}
    described = card(tmp_path / "vit")
    assert described["library_name"] == "transformers" and "accuracy" in described["metrics"]
    assert "## Training configuration" in (tmp_path / "vit" / "README.md").read_text()
    assert capsys.readouterr().out.startswith(f"exported {runs / 'hf'} to {tmp_path / 'vit'}: README.md, config.json")


def test_a_timm_run_exported_loads_in_timm_and_computes_the_runs_logits(runs, tmp_path):
    import timm
    from safetensors.torch import load_file

    exported(runs / "timm", tmp_path / "timm")
    mine = timm.create_model("test_resnet", num_classes=3)
    mine.load_state_dict(load_file(str(runs / "timm" / "model.safetensors")))
    config = json.loads((tmp_path / "timm" / "config.json").read_text())
    assert config["label_names"] == list(COLOURS) and config["pretrained_cfg"]["input_size"] == [3, 32, 32]
    if "local-dir" not in getattr(timm.models._factory, "_MODEL_SOURCES", ()):  # timm < 1.0.30 loads from the Hub
        pytest.skip(f"timm {timm.__version__} has no local-dir: to load the folder from")
    theirs = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(theirs.eval()(images), mine.eval()(images))
    assert card(tmp_path / "timm")["library_name"] == "timm"


@pytest.mark.floors  # onnx, onnxscript and onnxruntime at their floors with this torch
@pytest.mark.parametrize("run", ["cnn", "hf"])
def test_any_run_exports_as_onnx_whose_outputs_onnxruntime_reproduces(runs, tmp_path, run):
    import onnxruntime

    from accel_train.tools.export import ONNX_TOLERANCE

    exported(runs / run, tmp_path / "onnx", "format=onnx")
    session = onnxruntime.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    shape = (1, 28, 28) if run == "cnn" else (3, 16, 16)
    images = torch.randn(5, *shape, generator=torch.Generator().manual_seed(2))
    (found,) = session.run(None, {"pixel_values": images.numpy()})
    reference = reference_logits(runs / run, images)
    assert found.shape == tuple(reference.shape)
    assert float((torch.from_numpy(found) - reference).abs().max()) <= ONNX_TOLERANCE
    assert json.loads((tmp_path / "onnx" / "classes.json").read_text())
    assert "library_name" not in card(tmp_path / "onnx")


def reference_logits(run, images: torch.Tensor) -> torch.Tensor:
    """What the run's own model computes: built as eval builds it, with the run's weights."""
    from accel_train.config import load_config
    from accel_train.data.registry import Data
    from accel_train.run.weights import class_names, load_weights, read_weights
    from accel_train.workloads.tasks import task_named
    from accel_train.workloads.tasks.classification import logits_of

    config = load_config(str(run), [])
    task = task_named(config.task)
    task.check_config(config)
    classes = class_names(str(run), config.data.num_classes)
    data = Data(None, len(classes), tuple(images.shape[1:]), classes)
    task.setup(config, data)
    model = load_weights(task.build_model(config, data), read_weights(run / "model.safetensors"), str(run), "model")
    with torch.no_grad():
        return logits_of(model.eval()(images))


@pytest.mark.parametrize("options, line", [
    ([], "export: model.name=mnist_cnn has no library of its own to load it (hf: and timm: models do); give "
         "format=onnx, or use the run's model.safetensors as it is"),
    (["format=tflite"], "export: format=tflite: choose one of library, onnx"),
])
def test_an_export_the_run_cannot_have_is_one_line(runs, tmp_path, capsys, options, line):
    with pytest.raises(SystemExit) as refused:
        exported(runs / "cnn", tmp_path / "out", *options)
    assert refused.value.code == 2 and capsys.readouterr().err == f"accel-train: error: {line}\n"
    assert not (tmp_path / "out").exists()


def test_an_export_never_writes_into_a_folder_that_holds_files(runs, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    with pytest.raises(SystemExit):
        exported(runs / "hf", tmp_path / "out")
    assert "output=" in capsys.readouterr().err and (tmp_path / "out" / "mine.txt").read_text() == "keep me"
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["mine.txt"]



def test_an_export_stages_under_a_name_of_its_own_and_leaves_whatever_else_is_beside_its_output(runs, tmp_path):
    """A folder named as the export's staging once was (.OUT.partial) is someone's: it stays, and nothing of the
    export's own staging is left."""
    (tmp_path / ".vit.partial").mkdir()
    (tmp_path / ".vit.partial" / "mine.txt").write_text("keep me")

    exported(runs / "hf", tmp_path / "vit")

    assert (tmp_path / ".vit.partial" / "mine.txt").read_text() == "keep me"
    assert sorted(path.name for path in tmp_path.iterdir()) == [".vit.partial", "vit"]
    assert "config.json" in {path.name for path in (tmp_path / "vit").iterdir()}


def test_an_export_through_a_link_to_a_folder_goes_into_the_folder_it_names(runs, tmp_path):
    """output= a link to an empty folder, and output= a new folder inside a linked one."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")

    exported(runs / "hf", tmp_path / "link")
    exported(runs / "hf", tmp_path / "link" / "inside")

    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / "config.json").is_file()
    assert (tmp_path / "real" / "inside" / "config.json").is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["link", "real"]


@pytest.mark.parametrize("place, line", [
    ("file", "export: output={tmp}/file is a file, not a folder; give a new folder"),
    ("link_to_file", "export: output={tmp}/link_to_file is a link to a file, not a folder; give a new folder"),
    ("link_to_nothing", "export: output={tmp}/link_to_nothing is a link to {tmp}/gone, which is not there; give a "
                        "folder"),
    ("file/sub", "export: output={tmp}/file/sub: {tmp}/file is a file, so no folder can be made below it; give "
                 "another folder"),
])
def test_an_export_where_no_folder_can_be_is_one_line_and_touches_nothing(runs, tmp_path, capsys, place, line):
    (tmp_path / "file").write_text("mine")
    (tmp_path / "link_to_file").symlink_to(tmp_path / "file")
    (tmp_path / "link_to_nothing").symlink_to(tmp_path / "gone")
    before = sorted(tmp_path.rglob("*"))

    with pytest.raises(SystemExit) as refused:
        exported(runs / "hf", tmp_path / place)

    assert refused.value.code == 2 and capsys.readouterr().err == f"accel-train: error: {line.format(tmp=tmp_path)}\n"
    assert sorted(tmp_path.rglob("*")) == before and (tmp_path / "file").read_text() == "mine"


def test_an_export_into_a_read_only_place_is_one_line_exit_74(runs, small_disk, capsys):
    disk = small_disk("1m", readonly=True)

    with pytest.raises(SystemExit) as refused:
        exported(runs / "hf", disk / "vit")

    assert refused.value.code == 74
    assert capsys.readouterr().err == (f"accel-train: error: cannot write {disk / 'vit'} while exporting the model "
                                       "(read-only file system); give an output= folder you can write to\n")
