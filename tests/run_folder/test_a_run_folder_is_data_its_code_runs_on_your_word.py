"""Contracts of whose code runs (config/trust.py, import_paths.py): a run folder someone else wrote is data. The import
paths its config.yaml names (model.name, task, data.name, data.image_transform) run only on this command's word
(--trust-code, trust_code=True), or where this user trained or allowed exactly that code before (a record in their own
cache); a file never grants trust (model.trust_remote_code, model.allow_pickled_weights); and no folder goes on
sys.path, so a file there that nobody named is never imported.

Each command is run here as a new process would run it: what an earlier one allowed in this process is forgotten
first (`as_a_new_command`)."""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from accel_train import import_paths
from accel_train.cli import main
from accel_train.config import load_config
from accel_train.errors import UserError
from support.commands import FRESH_PROCESSES, run_cli, train_in_process

OWN_NET = '''import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, num_classes, image_shape):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(image_shape).prod()), num_classes))

    def forward(self, x):
        return self.net(x)
'''
RECIPE = """base: mnist_cnn
model:
  name: own_net:Net
data: {synthetic: true, train_subset: 24, eval_subset: 10, num_workers: 0}
train: {batch_size: 12, max_steps: 2, plot: false, log_with: none}
checkpoint: {every_steps: 2}
"""
MARKS = """import pathlib
pathlib.Path({marker!r}).touch()
"""


def as_a_new_command(monkeypatch) -> None:
    """Forget what this process allowed, served and imported of the tests' modules, as a new process has nothing."""
    monkeypatch.setattr(import_paths, "_DISTRUSTED", {})
    monkeypatch.setattr(import_paths, "_ALLOWED", set())
    monkeypatch.setattr(import_paths._NAMED, "files", {})
    for name in ("own_net", "evil", "neighbour_net", "helper"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.invalidate_caches()


@pytest.fixture
def own_run(tmp_path, monkeypatch):
    """A run this user trained from their own recipe, with own_net.py beside it (outside the current directory)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    project = tmp_path / "project"
    project.mkdir()
    (project / "own_net.py").write_text(OWN_NET)
    (project / "recipe.yaml").write_text(RECIPE)
    as_a_new_command(monkeypatch)
    train_in_process(str(project / "recipe.yaml"), f"output_dir={tmp_path / 'run'}")
    as_a_new_command(monkeypatch)
    return tmp_path / "run"


def rewritten(run: Path, into: Path, **settings) -> Path:
    """A copy of `run` whose config.yaml and checkpoints' checkpoint.json say `settings` (dotted keys), as anyone who
    can write the folder could make it."""
    shutil.copytree(run, into)
    files = [into / "config.yaml", *sorted(into.glob("checkpoints/*/checkpoint.json"))]
    for file in files:
        tree = yaml.safe_load(file.read_text())
        config = tree.get("config", tree)
        for key, value in settings.items():
            section, _, name = key.rpartition(".")
            (config.setdefault(section, {}) if section else config)[name] = value
        file.write_text(yaml.safe_dump(tree, sort_keys=False) if file.suffix == ".yaml" else
                        __import__("json").dumps(tree))
    return into


def one_error_line(argv: list[str], capsys, alone: bool = True) -> str:
    """The command's error line (exit 2, no traceback); `alone`: the only line it printed."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert stop.value.code == 2 and (len(lines) == 1 or not alone) and "Traceback" not in err, err
    return lines[-1]


COMMANDS = {
    "eval RUN": lambda run, tmp: ["eval", str(run)],
    "eval a checkpoint": lambda run, tmp: ["eval", str(run / "checkpoints" / "step-00000002")],
    "predict": lambda run, tmp: ["predict", str(run), f"input={tmp}", f"output={tmp / 'p.csv'}"],
    "export": lambda run, tmp: ["export", str(run), f"output={tmp / 'exported'}"],
    "train RUN into a new folder": lambda run, tmp: ["train", str(run), f"output_dir={tmp / 'again'}"],
    "train RUN resume=auto": lambda run, tmp: ["train", str(run), "resume=auto"],
    "shard": lambda run, tmp: ["shard", str(run), f"output={tmp / 'shards'}"],
    "sweep": lambda run, tmp: ["sweep", str(run), "--trials", "1", "--metric", "accuracy",
                               "train.lr=loguniform(1e-3,1e-1)", f"output_dir={tmp / 'sweep'}"],
    "bench": lambda run, tmp: ["bench", str(run), "--quick"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_a_run_folder_whose_config_names_os_system_runs_nothing_and_every_command_refuses_it_in_one_line(
        command, own_run, tmp_path, monkeypatch, capsys):
    marker = tmp_path / "MARK"
    evil = rewritten(own_run, tmp_path / "evil", **{"model.name": "os:system",
                                                    "model.args": {"command": f"touch {marker}"}})
    line = one_error_line(COMMANDS[command](evil, tmp_path), capsys)
    assert line.startswith("accel-train: error: ") and "model.name=os:system" in line and "os.py" in line and \
        "--trust-code" in line, line
    assert not marker.exists()
    assert not any((tmp_path / name).exists() for name in ("again", "exported", "shards", "sweep", "p.csv"))


def test_with_the_commands_word_the_code_a_run_folder_names_runs(own_run, tmp_path, monkeypatch, capsys):
    import accel_train

    marker = tmp_path / "MARK"
    evil = rewritten(own_run, tmp_path / "evil", **{"model.name": "os:system",
                                                    "model.args": {"command": f"touch {marker}"}})
    line = one_error_line(["eval", str(evil), "--trust-code"], capsys, alone=False)  # after "evaluating ..."
    assert "model.name=os:system: returned int, expected a torch.nn.Module" in line, line
    assert marker.exists()
    marker.unlink()
    as_a_new_command(monkeypatch)
    with pytest.raises(UserError, match="returned int"):
        accel_train.evaluate(str(evil), trust_code=True)
    assert marker.exists()


@pytest.mark.parametrize("settings", [
    {"model.name": "evil:Model"},
    {"task": "evil:Task"},
    {"data.name": "evil:data"},
    {"data.name": "evil:data", "data.image_transform": "evil:transform"},
], ids=["model.name", "task", "data.name", "data.image_transform"])
def test_every_key_that_names_code_is_refused_from_a_run_folder_and_a_module_beside_it_never_imported(
        settings, own_run, tmp_path, monkeypatch, capsys):
    marker = tmp_path / "MARK"
    evil = rewritten(own_run, tmp_path / "evil", **settings)
    for folder in (evil, tmp_path):  # in the run folder, and beside it
        (folder / "evil.py").write_text(MARKS.format(marker=str(marker)))
    line = one_error_line(["eval", str(evil)], capsys)
    assert all(f"{key}={value}" in line for key, value in settings.items()) and "--trust-code" in line, line
    assert not marker.exists()
    as_a_new_command(monkeypatch)
    line = one_error_line(["eval", str(evil), "--trust-code"], capsys, alone=False)  # a run folder holds no code
    assert "no module evil" in line, line
    assert not marker.exists()


def test_a_file_named_like_a_module_torch_looks_for_beside_a_recipe_or_a_run_folder_is_never_importable(
        own_run, tmp_path, monkeypatch):
    """torch imports opt_einsum and pynvml where it finds them: a folder on sys.path would run such a file."""
    for folder in (own_run, tmp_path / "project"):
        (folder / "opt_einsum.py").write_text(MARKS.format(marker=str(tmp_path / "MARK")))
    load_config(str(tmp_path / "project" / "recipe.yaml"))
    load_config(str(own_run))
    assert importlib.util.find_spec("opt_einsum") is None
    assert importlib.util.find_spec("own_net") is not None  # the module the recipe names, served from its file


@pytest.mark.processes
def test_eval_of_a_run_folder_with_opt_einsum_and_pynvml_beside_its_config_imports_neither(own_run, tmp_path):
    """A fresh interpreter, as a user's: torch's own import looks for both."""
    for name in ("opt_einsum", "pynvml"):
        (own_run / f"{name}.py").write_text(MARKS.format(marker=str(tmp_path / f"MARK-{name}")))
    evaluated = run_cli("eval", str(own_run), check=False, env={**FRESH_PROCESSES, "PYTHONPATH": str(
        tmp_path / "project"), "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert not list(tmp_path.glob("MARK-*"))
    assert evaluated.returncode == 0, evaluated.stderr


def test_your_own_run_needs_no_word_and_code_changed_since_or_another_users_needs_it_again(
        own_run, tmp_path, monkeypatch, capsys):
    import accel_train

    assert accel_train.evaluate(str(own_run))["num_samples"] == 10  # trained by this user: nothing to say
    as_a_new_command(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "another users cache"))
    line = one_error_line(["eval", str(own_run)], capsys)
    assert "model.name=own_net:Net" in line and str(tmp_path / "project" / "own_net.py") in line, line
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with open(tmp_path / "project" / "own_net.py", "a") as module:
        module.write("\nCHANGED = True  # the module's code changed since the run trained\n")
    as_a_new_command(monkeypatch)
    assert "own_net" in one_error_line(["eval", str(own_run)], capsys)
    as_a_new_command(monkeypatch)
    assert accel_train.evaluate(str(own_run), trust_code=True)["num_samples"] == 10
    as_a_new_command(monkeypatch)
    assert accel_train.evaluate(str(own_run))["num_samples"] == 10  # allowed once: remembered


def test_trust_in_a_hubs_code_and_in_pickles_comes_from_the_command_never_from_a_file(tmp_path, caplog):
    from accel_train.api import trust

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {name: hf:some/repo, trust_remote_code: true, "
                                     "allow_pickled_weights: true}\nrun: {recipe: x}\n")
    (tmp_path / "mine.yaml").write_text("model: {name: hf:some/repo, trust_remote_code: true}\n")
    for recipe, keys in ((str(run), ["model.trust_remote_code", "model.allow_pickled_weights"]),
                         (str(tmp_path / "mine.yaml"), ["model.trust_remote_code"])):  # the user's own file too
        config = load_config(recipe)
        assert not config.model.trust_remote_code and not config.model.allow_pickled_weights
        caplog.clear()
        trust(config, trust_code=True)  # --trust-code is about import paths, not about a Hub repository's code
        assert [record.getMessage().split(":")[0] for record in caplog.records] == keys
        assert all("is ignored: trust is given by the command, never by a file" in record.getMessage()
                   for record in caplog.records)
    given = load_config(str(run), ["model.trust_remote_code=true", "model.allow_pickled_weights=true"])
    assert given.model.trust_remote_code and given.model.allow_pickled_weights
    caplog.clear()
    trust(given, trust_code=False)
    assert not caplog.records


def test_a_named_module_that_imports_its_neighbour_is_told_how_to_make_that_work(tmp_path, monkeypatch):
    from accel_train import api

    (tmp_path / "neighbour_net.py").write_text("import helper\nNet = helper.Net\n")
    (tmp_path / "helper.py").write_text(OWN_NET)
    (tmp_path / "recipe.yaml").write_text(RECIPE.replace("own_net:Net", "neighbour_net:Net"))
    as_a_new_command(monkeypatch)
    with pytest.raises(UserError) as error:
        api.train(str(tmp_path / "recipe.yaml"), [f"output_dir={tmp_path / 'run'}"])
    assert f"helper is beside it in {tmp_path}" in str(error.value) and "PYTHONPATH" in str(error.value), error.value
