"""Contracts for the user's own code: a model, dataset and Task by import path or as Python objects, the Python
API, predict, and the projects in examples/ at 1 and 2 processes. What accel-train guarantees for its own
recipes (exact eval at any world size, exact resume, one-line errors) must hold for them too."""

import csv
import json
import shutil

import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from accel_train.config import load_config
from accel_train.errors import DataNotFoundError, UnreadableFileError, UserError
from accel_train.run.summaries import TIMING
from support.commands import PYTHON, free_port, last_json_line, launch, run_cli, train_in_process
from support.locations import FASHION_MNIST, REPO, TESTS, USER_RECIPE, needs_fashion_mnist
from support.nodes import run_nodes, slurm_nodes
from support.runs import assert_same_run, crash_after_checkpoint_then_resume, metrics_without_timing, read_metrics

EXAMPLES = REPO / "examples"


def checked(*overrides: str):
    """What a run checks before any data loads, in this process; the config it checked."""
    from accel_train.workloads.tasks import task_named

    config = load_config(USER_RECIPE, list(overrides))
    task_named(config.task).check_config(config)
    return config


@pytest.mark.parametrize("overrides, words", [
    (["model.name=no_such_module:Net"], ["model.name=no_such_module:Net", "no module no_such_module"]),
    (["model.name=user_models:NoSuchNet"], ["user_models", "has no NoSuchNet", "TinyNet"]),
    (["model.name=user_models:"], ["an import path is module:attribute"]),
    (["model.name=user_models:NUMBER"], ["found int", "expected a class or function"]),
    (["model.name=user_models:TinyNet", "model.args.depth=3"], ["TinyNet(num_classes", "takes no depth"]),
    (["model.name=user_models:needs_depth"], ["needs depth", "model.args.depth"]),
    (["model.name=broken_module:RATIO"], ["importing broken_module failed", "ZeroDivisionError"]),
    (["data.name=user_models:no_train_argument"], ["data.name=user_models:no_train_argument", "takes no train"]),
    (["data.name=user_models:points", "data.args.colour=red"], ["takes no colour", "data.args"]),
    (["task=user_models:NotATask"], ["task=user_models:NotATask", "expected a subclass of accel_train.Task"]),
    (["task=user_models:HalfTask"], ["HalfTask does not define eval_step, new_metric"]),
])
def test_an_import_path_mistake_is_named_in_one_line_before_any_data_loads(overrides, words):
    with pytest.raises(UserError) as error:
        checked(*overrides)
    assert "\n" not in str(error.value)
    assert all(word in str(error.value) for word in words), str(error.value)


@pytest.mark.parametrize("overrides, words", [
    (["model.name=user_models:not_a_module"], ["returned list", "expected a torch.nn.Module"]),
    (["data.name=user_models:returns_a_generator"], ["found generator", "expected a torch Dataset"]),
    (["data.name=user_models:points"], ["gives no classes", "set data.num_classes"]),
    (["data.name=user_models:float_labels", "data.num_classes=2"], ["a sample is (Tensor, Tensor)",
                                                                     "(input tensor, integer label)"]),
])
def test_what_user_code_returns_is_checked_where_it_is_called(overrides, words):
    from accel_train.data import build_dataset
    from accel_train.workloads.tasks import task_named

    config = checked(*overrides)
    task = task_named(config.task)
    with pytest.raises(UserError) as error:
        data = build_dataset(config.data, train=True)
        task.setup(config, data)
        task.build_model(config, data)
    assert all(word in str(error.value) for word in words), str(error.value)


def test_a_zoo_factory_with_kwargs_gets_num_classes_and_never_an_image_shape_it_does_not_name(tmp_path):
    """timm's create_model(model_name, **kwargs) passes its keywords on to the model: image_shape would end in a
    TypeError there."""
    from accel_train.workloads.models import build_model

    config = checked("model.name=user_models:zoo_model", "model.args.model_name=tiny", "model.args.width=4")
    model = build_model(config.model, 7, (1, 28, 28))
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 7)


@pytest.mark.parametrize("overrides, code, line", [
    (["data.name=user_models:hub_dataset", "data.args.path=mnist"], 3,
     "data.name=user_models:hub_dataset: building it raised ConnectionError: Couldn't reach 'mnist' on the Hub "
     "(LocalEntryNotFoundError) (at user_models.py:"),
    (["data.name=user_models:first_sample_fails", "data.num_classes=2"], 3,
     "data.name=user_models:first_sample_fails: reading its first sample raised ValueError: no sample 0: the file "
     "list is empty (at user_models.py:"),
    (["model.name=user_models:weights_from_the_network"], 3,
     "model.name=user_models:weights_from_the_network: building it raised ConnectionError: Couldn't reach "
     "'tiny/weights' on the Hub (at user_models.py:"),
    (["model.name=user_models:zoo_model", "model.args.model_name=huge"], 2,
     "model.name=user_models:zoo_model: building it raised KeyError: 'huge' (at user_models.py:"),
], ids=["a dataset that cannot reach the network", "a dataset whose first sample fails",
        "a model whose weights cannot be fetched", "a zoo without that model"])
def test_what_user_code_raises_while_building_is_one_line_naming_the_key_with_readmes_exit_code(
        overrides, code, line, tmp_path, capsys):
    from accel_train.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["train", USER_RECIPE, *overrides, f"output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert stop.value.code == code and "Traceback" not in err, err
    (said,) = [text for text in err.splitlines() if text.startswith("accel-train: error: ")]
    assert said.startswith(f"accel-train: error: {line}"), said


def test_an_import_path_mistake_on_the_command_line_exits_2_in_one_line(tmp_path):
    result = run_cli("train", USER_RECIPE, "model.name=user_models:needs_depth", f"output_dir={tmp_path}",
                     check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("accel-train: error:")]
    assert "model.name=user_models:needs_depth" in line and "needs depth" in line
    assert not (tmp_path / "metrics.jsonl").exists()


def test_modules_are_found_in_the_current_directory(tmp_path, monkeypatch):
    from accel_train.import_paths import import_object

    (tmp_path / "here_models.py").write_text("from torch import nn\nNet = nn.Linear\n")
    monkeypatch.chdir(tmp_path)
    assert import_object("here_models:Net", "model.name") is torch.nn.Linear


def test_a_user_dataset_and_model_by_import_path_train_and_record_their_class_names(tmp_path):
    metrics = train_in_process(USER_RECIPE, "data.name=user_models:points", "data.num_classes=3",
                               "model.args.hidden=4", "train.plot=false", f"output_dir={tmp_path}")
    assert metrics["num_samples"] == 20  # data.eval_subset applies to a user dataset
    assert not (tmp_path / "classes.json").exists()  # a dataset without names: none to record
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert weights["net.1.weight"].shape == (4, 16) and weights["net.3.weight"].shape == (3, 4)


# --- the Python API --------------------------------------------------------------------------------------------

class Tagged(torch.utils.data.Dataset):
    """Inputs whose label is recoverable: a classification problem a linear model learns."""

    classes = ["low", "high"]

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, 3, generator=generator)
        self.labels = (self.inputs.sum(dim=1) > 0).long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.inputs[index], self.labels[index]


def test_the_python_api_trains_objects_in_place_of_names_and_records_them(tmp_path):
    import accel_train

    torch.manual_seed(0)
    settings = [f"output_dir={tmp_path}", "train.batch_size=16", "train.epochs=3", "train.lr=0.05",
                "data.num_workers=0", "train.plot=false"]
    metrics = accel_train.train("mnist_cnn", settings, model=torch.nn.Linear(3, 2),
                                train_dataset=Tagged(320, seed=0), eval_dataset=Tagged(101, seed=1))
    assert metrics["num_samples"] == 101 and metrics["accuracy"] > 0.85, metrics
    config = (tmp_path / "config.yaml").read_text()
    assert "name: <torch.nn.modules.linear.Linear>" in config
    assert "name: <test_user_code_python_api_and_predict.Tagged>" in config
    assert json.loads((tmp_path / "classes.json").read_text()) == ["low", "high"]
    again = accel_train.evaluate("mnist_cnn", tmp_path, ["data.num_workers=0"], model=torch.nn.Linear(3, 2),
                                 eval_dataset=Tagged(101, seed=1))
    assert again == {**metrics, "num_processes": 1}


@pytest.mark.parametrize("call, words", [
    (lambda api: api.train("mnist_cnn", model=42), ["model: found int, expected a torch.nn.Module"]),
    (lambda api: api.train("mnist_cnn", train_dataset=Tagged(10, 0)), ["give both, or neither"]),
    (lambda api: api.train("mnist_cnn", task=object()), ["task: found object", "accel_train.Task"]),
    (lambda api: api.train("mnist_cnn", "train.lr=0.1"), ["pass a list of key=value strings"]),
    (lambda api: api.evaluate("mnist_cnn", "/nonexistent/run"), ["/nonexistent/run: no such file or folder"]),
])
def test_the_python_api_raises_user_error_with_the_command_lines_one_line(call, words):
    import accel_train

    with pytest.raises(accel_train.UserError) as error:
        call(accel_train)
    assert all(word in str(error.value) for word in words), str(error.value)


def test_importing_the_package_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, accel_train\nprint(sorted(accel_train.__all__), 'torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip().endswith("False"), result.stdout
    assert "'train'" in result.stdout and "'Task'" in result.stdout and "'predict'" in result.stdout


# --- exact resume of a user's model -------------------------------------------------------------------------

def test_a_user_model_resumes_exactly(tmp_path, monkeypatch):
    recipe = str(EXAMPLES / "two_conv_net" / "recipe.yaml")
    run = ["data.synthetic=true", "data.augment=true", "data.train_subset=96", "data.eval_subset=30",
           "train.batch_size=12", "train.epochs=2", "train.log_every_steps=3", "checkpoint.every_steps=4",
           "model.args.width=8", "train.plot=false"]
    train_in_process(recipe, *run, f"output_dir={tmp_path / 'reference'}")
    # step 8: epoch 0, in the middle of the train line at step 9
    crash_after_checkpoint_then_resume(8, recipe, *run, f"output_dir={tmp_path / 'resumed'}")
    assert_same_run(tmp_path / "resumed", tmp_path / "reference")


EDITED_NET = """import torch
from torch import nn

WIDTH = {width}  # the user's edit between two runs: nothing in the config says so


class Net(nn.Module):
    def __init__(self, num_classes, image_shape):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(image_shape).prod()), WIDTH), nn.ReLU(),
                                 nn.Linear(WIDTH, num_classes))

    def forward(self, x):
        return self.net(x)
"""


def test_a_checkpoint_whose_tensors_no_longer_fit_the_users_model_is_refused_in_one_line(tmp_path, monkeypatch,
                                                                                         capsys):
    """The same config, a model file edited since the save: only the checkpoint's tensor shapes can tell, and the
    resume says which tensor differs before loading anything (exit 2, one line, no traceback)."""
    import importlib
    import sys

    from accel_train.cli import main

    monkeypatch.setattr(sys, "path", list(sys.path))  # the recipe's folder joins sys.path for this test only
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # the edited file is read again, not a cached .pyc
    module = tmp_path / "edited_net.py"
    module.write_text(EDITED_NET.format(width=8))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("base: mnist_cnn\nmodel:\n  name: edited_net:Net\n")
    run = ["train", str(recipe), "data.synthetic=true", "data.train_subset=24", "data.eval_subset=10",
           "train.batch_size=12", "train.max_steps=2", "checkpoint.every_steps=1", "train.plot=false",
           f"output_dir={tmp_path / 'run'}"]
    train_in_process(*run[1:])
    module.write_text(EDITED_NET.format(width=16))
    monkeypatch.delitem(sys.modules, "edited_net")  # as the next command's new process would import it
    importlib.invalidate_caches()
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main([*run, "resume=auto"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err, err
    (line,) = err.splitlines()
    assert line.startswith("accel-train: error: resume: ") and "step-00000002 does not fit model.name=edited_net:Net" \
        in line and "net.1.bias has shape [8] there, [16] here" in line, line


# --- the examples, at 1 and 2 processes ---------------------------------------------------------------------

EXAMPLE_RUNS = {
    # recipe, overrides that keep the test short, training world sizes, eval world sizes for the 1-process checkpoint
    "two_conv_net": (str(EXAMPLES / "two_conv_net" / "recipe.yaml"),
                     ["data.synthetic=true", "data.train_subset=96", "data.eval_subset=101", "train.batch_size=24",
                      "train.eval_batch_size=50", "train.epochs=1", "model.args.width=8"], (1,), (2,)),
    # 997 eval samples do not divide by 2 (a user's dataset, model and Task), served by a DataLoader worker; the
    # checkpoint is evaluated at 2 processes by torchrun and by the SLURM script, whose workers must find the
    # user's modules beside the recipe
    "regression": (str(EXAMPLES / "regression" / "recipe.yaml"),
                   ["data.args.size=1200", "data.eval_subset=997", "train.epochs=1", "train.batch_size=100",
                    "train.eval_batch_size=100", "data.num_workers=1"], (1,), ()),
}


def same_metrics(evaluated: dict, b: dict, processes: int) -> None:
    """`evaluated` by `processes` processes (as it reports) and `b` are identical metrics: the same names and counts,
    and floats equal but for summation order (1e-6)."""
    a = dict(evaluated)
    assert a.pop("num_processes") == processes
    names = a.keys() - {"split", "epoch", "step", *TIMING}
    assert names == b.keys() - {"split", "epoch", "step", *TIMING}
    for name in names:
        if isinstance(b[name], float):
            assert a[name] == pytest.approx(b[name], rel=1e-6), name
        else:
            assert a[name] == b[name], name


@pytest.mark.parametrize("example", EXAMPLE_RUNS)
def test_an_example_trains_and_one_checkpoint_evaluates_identically_at_other_world_sizes(example, tmp_path):
    recipe, overrides, train_sizes, eval_sizes = EXAMPLE_RUNS[example]
    for processes in train_sizes:
        launch(processes, "train", recipe, *overrides, f"output_dir={tmp_path / str(processes)}")
    one, *more = (read_metrics(tmp_path / str(processes), "test")[-1] for processes in train_sizes)
    assert all(other["num_samples"] == one["num_samples"] for other in more)
    for processes in eval_sizes:  # the 1-process run's checkpoint, evaluated by more processes
        evaluated = last_json_line(launch(processes, "eval", recipe, *overrides, f"checkpoint={tmp_path / '1'}").stdout)
        same_metrics(evaluated, one, processes)
    if example == "regression":  # torchrun's workers and the SLURM script's nodes find the modules beside the recipe
        evaluation = ["eval", recipe, *overrides, f"checkpoint={tmp_path / '1'}"]
        torchrun = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                    "-m", "accel_train"]
        (node,) = run_nodes([(torchrun + evaluation, {})])
        same_metrics(last_json_line(node.stdout), one, 2)
        node_0, _ = run_nodes([(command + evaluation, env) for command, env in slurm_nodes(tmp_path)])
        same_metrics(last_json_line(node_0.stdout), one, 2)


def test_the_python_api_script_trains_at_2_processes_and_its_weights_evaluate_identically_at_1(tmp_path):
    script = str(EXAMPLES / "python_api" / "train_blobs.py")
    trained = last_json_line(launch(2, str(tmp_path / "run"), script=script).stdout)
    assert trained["num_samples"] == 301 and trained["accuracy"] > 0.8, trained
    evaluated = last_json_line(launch(1, "--evaluate", str(tmp_path / "run"), script=script).stdout)
    same_metrics(evaluated, trained, 1)


# 4 steps of 24 real Fashion-MNIST images, 50 evaluated
FOUR_COMMANDS = [f"data.root={FASHION_MNIST}", "data.train_subset=96", "data.eval_subset=50", "train.batch_size=24",
                 "train.epochs=1", "train.plot=false", "train.log_with=none"]


@needs_fashion_mnist
def test_a_script_that_trains_evaluates_predicts_and_trains_again_runs_all_four_at_2_processes(tmp_path):
    """tests/user_code/four_commands.py: train, evaluate, predict, train a second run, in one process each under
    accelerate launch; every command runs in the same process group (one that ended the group left the next
    without one: "Default process group has not been initialized")."""
    import accel_train

    pictures, runs = tmp_path / "pictures", tmp_path / "runs"
    pictures.mkdir()
    generator = torch.Generator().manual_seed(0)
    for index in range(3):
        pixels = (torch.rand(28, 28, generator=generator) * 255).byte().numpy()
        Image.fromarray(pixels).save(pictures / f"item{index}.png")
    launch(2, str(runs), str(pictures), *FOUR_COMMANDS, script=str(TESTS / "user_code" / "four_commands.py"))
    reports = [json.loads((runs / f"returned-{rank}.json").read_text()) for rank in (0, 1)]
    assert reports[0] == reports[1]  # every process returns the same answers
    report = reports[0]
    for run in ("first", "second"):
        assert yaml.safe_load((runs / run / "config.yaml").read_text())["run"]["world_size"] == 2
    same_metrics(report["evaluated"], read_metrics(runs / "first", "test")[-1], 2)  # the run's final evaluation
    # the same commands at 1 process, from the command line and in this process
    same_metrics(last_json_line(run_cli("eval", str(runs / "first")).stdout),
                 {key: value for key, value in report["evaluated"].items() if key != "num_processes"}, 1)
    alone = accel_train.predict(str(runs / "first"), inputs=str(pictures))
    assert [(row["path"], row["labels"]) for row in report["predicted"]] == \
        [(row["path"], row["labels"]) for row in alone] and len(alone) == 3
    assert [score for row in report["predicted"] for score in row["scores"]] == \
        pytest.approx([score for row in alone for score in row["scores"]], rel=1e-5)
    # the second run trains like the first: the same settings, the same seed
    assert metrics_without_timing(runs / "second") == metrics_without_timing(runs / "first")
    same_metrics({**report["again"], "num_processes": 2}, report["trained"], 2)


# --- predict ------------------------------------------------------------------------------------------------

CLASSES = ("cat", "dog", "owl")
IMAGE_RUN = ["model.name=resnet18", "data.image_size=32", "data.num_workers=0", "train.plot=false"]


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    """A run trained on an image folder of three classes, and 13 input images of mixed sizes and modes."""
    root = tmp_path_factory.mktemp("predict")
    for split in ("train", "val"):
        for index, name in enumerate(CLASSES):
            (root / "images" / split / name).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (40 + i, 36), (index * 80, i * 40, 200 - index * 60)).save(
                    root / "images" / split / name / f"{i}.png")
    train_in_process("imagefolder", f"data.root={root / 'images'}", *IMAGE_RUN, "train.batch_size=6",
                     "train.eval_batch_size=6", "train.max_steps=2", f"output_dir={root / 'run'}")
    modes = ("RGB", "L", "RGBA")
    for i in range(13):
        folder = root / "inputs" / ("nested" if i % 4 == 0 else "")
        folder.mkdir(parents=True, exist_ok=True)
        mode = modes[i % 3]
        colour = (i * 19) % 256 if mode == "L" else (i * 19, 90, 250 - i * 9)
        suffix = "png" if mode == "RGBA" else "jpg"
        Image.new(mode, (30 + 3 * i, 50 - i), colour).save(folder / f"photo_{i:02d}.{suffix}")
    return root


def test_predict_writes_one_row_per_file_identically_at_1_2_and_3_processes(image_run):
    assert json.loads((image_run / "run" / "classes.json").read_text()) == list(CLASSES)
    written = {}
    for processes in (1, 2, 3):  # 13 files split unevenly at 2 and 3; one thread a process
        output = image_run / f"predictions_{processes}.csv"
        launch(processes, "predict", "imagefolder", f"checkpoint={image_run / 'run'}",
               f"input={image_run / 'inputs'}", f"output={output}", "predict.top_k=2", "predict.batch_size=4",
               *IMAGE_RUN)
        written[processes] = output.read_text()
    assert written[1] == written[2] == written[3]
    header, *rows = csv.reader(written[1].splitlines())
    assert header == ["path", "label", "score", "label_2", "score_2"]
    files = sorted(str(path) for path in (image_run / "inputs").rglob("*.*"))
    assert [row[0] for row in rows] == files and len(files) == 13
    for _, label, score, label_2, score_2 in rows:
        assert label in CLASSES and label_2 in CLASSES and label != label_2
        assert 1 >= float(score) >= float(score_2) >= 0


def test_predict_gives_each_file_the_models_own_labels_and_scores_for_that_file(image_run):
    """Each row is the model's output for the file the row names: not its neighbour's in the batch or the sort."""
    import accel_train
    from accel_train.data import Data, image_converter, load_image
    from accel_train.workloads.tasks import task_named

    settings = [*IMAGE_RUN, "predict.top_k=3", "predict.batch_size=4"]  # 13 files: batches of 4, 4, 4 and 1
    rows = accel_train.predict("imagefolder", image_run / "run", image_run / "inputs", settings)
    config = load_config("imagefolder", settings)
    convert, shape = image_converter(config.data)
    task, described = task_named(config.task), Data(None, len(CLASSES), shape, list(CLASSES))
    task.setup(config, described)
    model = task.build_model(config, described)
    model.load_state_dict(load_file(str(image_run / "run" / "model.safetensors")))
    model.eval()
    files = sorted(str(path) for path in (image_run / "inputs").rglob("*.*"))
    assert [row["path"] for row in rows] == files
    own = []
    for row in rows:
        with torch.no_grad():  # the file alone, through the plain model
            probabilities = model(convert(load_image(row["path"]))[None]).softmax(-1)[0]
        scores, labels = probabilities.sort(descending=True)
        assert row["labels"] == [CLASSES[label] for label in labels.tolist()], row["path"]
        assert row["scores"] == pytest.approx(scores.tolist(), rel=1e-4, abs=1e-6), row["path"]
        own.append(scores.tolist())
    assert len({json.dumps(scores) for scores in own}) == len(files)  # the rows tell the files apart


def test_predict_runs_every_file_in_a_full_batch_so_its_scores_do_not_depend_on_the_world_size(image_run):
    """A batch of another shape may run other kernels, whose last bits differ: with the last batch padded to
    predict.batch_size, each file meets the same batch at any world size (docs/contracts.md)."""
    import accel_train

    batch_sizes = set()

    def record(module, inputs):
        if inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].ndim == 4:
            batch_sizes.add(inputs[0].shape[0])

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        rows = accel_train.predict("imagefolder", image_run / "run", image_run / "inputs",
                                   [*IMAGE_RUN, "predict.batch_size=4"])  # 13 files
    finally:
        handle.remove()
    assert batch_sizes == {4} and len(rows) == 13


def test_predict_takes_a_file_or_a_glob_and_names_what_it_cannot_read(image_run, tmp_path):
    import accel_train

    settings = [*IMAGE_RUN, "predict.top_k=3"]
    run = image_run / "run"
    (single,) = accel_train.predict("imagefolder", run, image_run / "inputs" / "photo_01.jpg", settings)
    assert single["path"].endswith("photo_01.jpg") and sorted(single["labels"]) == sorted(CLASSES)
    assert sum(single["scores"]) == pytest.approx(1.0, rel=1e-5)
    pngs = accel_train.predict("imagefolder", run, str(image_run / "inputs" / "**" / "*.png"), settings)
    assert [row["path"] for row in pngs] == sorted(str(p) for p in (image_run / "inputs").rglob("*.png"))
    with pytest.raises(DataNotFoundError, match="no image file there"):
        accel_train.predict("imagefolder", run, tmp_path, settings)
    broken = tmp_path / "broken.jpg"
    broken.write_bytes((image_run / "inputs" / "photo_01.jpg").read_bytes()[:100])
    not_an_image = tmp_path / "notes.txt"
    not_an_image.write_text("not an image")
    for unreadable in (broken, not_an_image):  # named as predict's input, not as a dataset the user never named
        with pytest.raises(UnreadableFileError, match=f"^predict: cannot read {unreadable} as an image"):
            accel_train.predict("imagefolder", run, unreadable, settings)
    with pytest.raises(UserError, match="data.name=user_models:points \\(trained with imagefolder\\)"):
        accel_train.predict(USER_RECIPE, run, broken, ["data.name=user_models:points"])
    from accel_train.training.prediction import predict  # past the run's check: a recipe whose data are not images

    with pytest.raises(UserError, match="data.name=user_models:points is a dataset by import path whose evaluation "
                                        "split has no `transform`"):
        predict(load_config(USER_RECIPE, ["data.name=user_models:points"]), str(run), str(broken))


def test_predict_converts_an_image_as_the_recipes_eval_data_is(tmp_path):
    """Grayscale 28 px for MNIST, whatever the file: the file's pixels reach the model as an eval sample's do."""
    from accel_train.data import build_dataset, image_converter

    config = load_config("mnist_cnn", ["data.synthetic=true", "data.eval_subset=3"])
    convert, shape = image_converter(config.data)
    pixels = build_dataset(config.data, train=False).dataset.images[0]  # uint8 (1, 28, 28)
    Image.fromarray(pixels[0].numpy()).convert("RGB").save(tmp_path / "sample.png")
    with Image.open(tmp_path / "sample.png") as image:
        converted = convert(image)
    assert shape == (1, 28, 28) and converted.shape == shape
    expected, _ = build_dataset(config.data, train=False).dataset.__getitems__([0])
    assert torch.equal(converted, expected[0])
    shutil.rmtree(tmp_path)


def test_predict_for_a_users_dataset_uses_its_evaluation_transform_or_data_image_transform(image_run, tmp_path):
    """A dataset by import path (tests/user_code/user_models.py: photos, FakeData with a `transform`, no classes):
    predict turns each file into an input with the evaluation split's transform, or with data.image_transform, the
    same; labels are class indices. Without either, one line says which to give."""
    import accel_train
    from accel_train.data import Data, load_image
    from accel_train.run.weights import read_weights
    from accel_train.workloads.tasks import task_named

    run, inputs = tmp_path / "run", image_run / "inputs"
    settings = ["data.name=user_models:photos", "data.num_classes=3", "data.train_subset=null",
                "data.eval_subset=null", "train.max_steps=2", "train.plot=false", "train.log_with=none"]
    train_in_process(USER_RECIPE, *settings, f"output_dir={run}")
    by_split = accel_train.predict(str(run), inputs=str(inputs))
    by_key = accel_train.predict(str(run), inputs=str(inputs), overrides=["data.image_transform=user_models:to_input"])
    assert by_split == by_key and len(by_split) == 13
    assert {label for row in by_split for label in row["labels"]} <= {"0", "1", "2"}
    # the first row is the trained model's answer for that file through the dataset's own transform
    from user_models import to_input  # importable once the run has found the recipe's folder

    config, task = load_config(str(run)), task_named("classification")
    task.setup(config, Data(None, 3, (3, 16, 16), None))
    model = task.build_model(config, Data(None, 3, (3, 16, 16), None)).eval()
    model.load_state_dict(read_weights(run / "model.safetensors"))
    with torch.no_grad():
        scores = model(to_input(load_image(by_split[0]["path"]))[None]).softmax(-1)[0]
    assert str(int(scores.argmax())) == by_split[0]["labels"][0]
    assert scores.max().item() == pytest.approx(by_split[0]["scores"][0], abs=1e-6)
    bare = tmp_path / "bare"
    train_in_process(USER_RECIPE, *settings, "data.args.transform=false", f"output_dir={bare}")
    with pytest.raises(UserError, match=r"predict: data.name=user_models:photos is a dataset by import path whose "
                                        r"evaluation split has no `transform`.*data.image_transform=module:function"):
        accel_train.predict(str(bare), inputs=str(inputs))
    assert len(accel_train.predict(str(bare), inputs=str(inputs),
                                   overrides=["data.image_transform=user_models:to_input"])) == 13
