"""Contracts of the command line: mistakes are caught before any work, in one line, with exit code 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from accel_train.cli import main
from accel_train.config import describe_keys, list_recipes, load_config, spelled
from accel_train.errors import UserError
from support.commands import run_cli
from support.locations import REPO

SHIPPED = {"mnist_cnn", "fashion_mnist_cnn", "cifar10_resnet50", "stl10_resnet18", "imagefolder"}


@pytest.mark.parametrize("override, names", [
    ("train.lrr=0.1", ["train.lrr", "did you mean train.lr?"]),
    ("trian.lr=0.1", ["trian", "did you mean train?"]),
    ("train.learning_rate=0.1", ["train.learning_rate", "valid keys here", "train.lr", "train.batch_size"]),
    ("train.batch_size=many", ["train.batch_size", "integer", "many"]),
    ("train.lr=fast", ["train.lr", "number"]),
    ("train.optimizer=lion", ["train.optimizer", "adamw", "adam", "sgd"]),
    ("train.batch_size=0", ["train.batch_size", "greater than 0"]),
    ("data.train_subset=-5", ["data.train_subset", "greater than 0"]),
    ("data.augment=maybe", ["data.augment", "true or false"]),
    ("train=3", ["'train' is a section", "train.epochs"]),
    ("model.name=resnet9000", ["model.name", "resnet9000", "mnist_cnn"]),
    ("data.name=imagenet22k", ["data.name", "imagenet22k", "cifar10", "fashion_mnist"]),
    ("task=segmentation", ["task", "segmentation", "classification"]),
])
def test_config_mistakes_exit_2_with_one_line_naming_the_key(override, names, tmp_path, capsys):
    # The command line's own main() in this process (the exit code through a real process: the tests below)
    from accel_train import cli

    with pytest.raises(SystemExit) as exit:
        cli.main(["train", "fashion_mnist_cnn", override, f"output_dir={tmp_path}"])
    stderr = capsys.readouterr().err
    assert exit.value.code == 2, stderr
    error_lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(error_lines) == 1 and error_lines[0].startswith("accel-train: error:"), stderr
    for name in names:
        assert name in error_lines[0]
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("overrides, names", [
    (["model.sync_batchnorm=true", "train.micro_batch_size=auto"],
     ["model.sync_batchnorm=true with train.micro_batch_size=auto", "inside the forward pass",
      "set a train.micro_batch_size"]),
    (["train.deterministic=true", "train.tf32=true"], ["train.deterministic=true with train.tf32=true"]),
    (["train.tf32=sometimes"], ["train.tf32", "auto"]),
])
def test_settings_that_cannot_hold_together_exit_2_with_one_line_naming_them(overrides, names, tmp_path, capsys):
    from accel_train import cli

    # a run of seconds, were the settings accepted (the refusal broken): the test then fails at once
    tiny = ["data.synthetic=true", "data.train_subset=32", "data.eval_subset=16", "train.batch_size=16",
            "train.max_steps=1", "train.plot=false"]
    with pytest.raises(SystemExit) as exit:
        cli.main(["train", "fashion_mnist_cnn", *tiny, *overrides, f"output_dir={tmp_path}"])
    error_lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit.value.code == 2 and len(error_lines) == 1, error_lines
    assert all(name in error_lines[0] for name in names), error_lines[0]
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_unknown_recipe_lists_the_shipped_ones():
    result = run_cli("train", "resnet_on_moon", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "resnet_on_moon" in result.stderr and "fashion_mnist_cnn" in result.stderr


def test_override_without_equals_sign_is_rejected():
    result = run_cli("train", "mnist_cnn", "train.lr", check=False)
    assert result.returncode == 2 and "key=value" in result.stderr


def test_eval_requires_a_checkpoint():
    result = run_cli("eval", "mnist_cnn", check=False)
    assert result.returncode == 2 and "checkpoint=PATH" in result.stderr


def test_recipes_lists_every_shipped_recipe_with_a_description():
    listed = {line.split()[0]: line for line in run_cli("recipes").stdout.splitlines()}
    assert SHIPPED <= set(listed)
    assert all(len(line.split()) > 3 for line in listed.values())
    assert set(list_recipes()) == set(listed)


def test_every_recipe_has_the_common_keys_and_loads():
    for name in list_recipes():
        config = load_config(name, ["seed=3", "output_dir=/tmp/x", "data.root=/tmp/d", "data.train_subset=10",
                                    "data.eval_subset=7", "train.epochs=2", "train.max_steps=5",
                                    "train.batch_size=12", "train.lr=0.5"])
        assert (config.seed, config.data.train_subset, config.train.max_steps, config.train.lr) == (3, 10, 5, 0.5)


def test_recipe_file_with_base_inherits_and_overrides(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("base: fashion_mnist_cnn\ntrain:\n  lr: 3.0e-4\n")
    config = load_config(str(recipe), ["train.max_steps=null"])
    assert config.data.name == "fashion_mnist" and config.model.name == "mnist_cnn"
    assert config.train.lr == 3e-4 and config.train.schedule == "step" and config.train.max_steps is None


def test_recipe_file_with_unknown_key_names_it(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("train:\n  epochz: 3\n")
    with pytest.raises(UserError, match="train.epochz.*train.epochs"):
        load_config(str(recipe))


# train.lr_base: the learning rate for a global batch of train.lr_base_batch samples (timm's --lr-base).


def _run_folder_with_lr_base(tmp_path, *overrides):
    """A run folder as training leaves it (its config.yaml, written by save_config), to use as a recipe."""
    from accel_train.config import save_config

    config = load_config("fashion_mnist_cnn", ["train.lr_base=0.004", "train.batch_size=512", *overrides])
    run = tmp_path / "run"
    run.mkdir()
    save_config(config, run / "config.yaml", {"world_size": 2})
    return run


@pytest.mark.parametrize("scale, factor_512, factor_64", [("linear", 2.0, 0.25), ("sqrt", 2.0 ** 0.5, 0.5)])
def test_lr_base_gives_train_lr_for_the_global_batch(scale, factor_512, factor_64):
    from accel_train.config import Config, TrainConfig

    for batch, factor in ((512, factor_512), (64, factor_64)):
        config = load_config("fashion_mnist_cnn", ["train.lr_base=0.004", f"train.lr_scale={scale}",
                                                   f"train.batch_size={batch}"])
        assert config.train.lr == pytest.approx(0.004 * factor, rel=1e-12), (scale, batch)
        # at lr_base_batch itself, lr is lr_base; a Config built in Python goes the same way
        assert load_config(config, ["train.lr_base_batch=" + str(batch)]).train.lr == pytest.approx(0.004)
        built = Config(train=TrainConfig(lr_base=0.004, lr_scale=scale, batch_size=batch))
        assert load_config(built).train.lr == pytest.approx(0.004 * factor, rel=1e-12)


def test_config_yaml_records_lr_base_and_reloading_it_recomputes_lr_for_the_batch_given(tmp_path):
    import yaml

    run = _run_folder_with_lr_base(tmp_path)
    recorded = yaml.safe_load((run / "config.yaml").read_text())["train"]
    assert recorded["lr"] == pytest.approx(0.008)  # the LR the run trained with
    assert (recorded["lr_base"], recorded["lr_base_batch"], recorded["lr_scale"]) == (0.004, 256, "linear")
    assert load_config(str(run)).train.lr == pytest.approx(0.008)  # the same run again: the same LR
    # a sweep over the batch size from the run folder gets the LR of each batch, not the recorded one
    assert load_config(str(run), ["train.batch_size=1024"]).train.lr == pytest.approx(0.016)
    assert load_config(str(run), ["train.batch_size=128"]).train.lr == pytest.approx(0.002)


def test_train_lr_without_lr_base_is_taken_as_given_at_any_batch_size():
    recipe_lr = load_config("fashion_mnist_cnn").train.lr
    assert load_config("fashion_mnist_cnn", ["train.batch_size=512"]).train.lr == recipe_lr
    config = load_config("fashion_mnist_cnn", ["train.lr=0.05", "train.batch_size=512"])
    assert (config.train.lr, config.train.lr_base) == (0.05, None)


@pytest.mark.parametrize("source", ["override", "recipe"])
def test_train_lr_given_with_lr_base_is_one_line_naming_both(source, tmp_path, capsys):
    recipe = ["fashion_mnist_cnn", "train.lr_base=0.004"] if source == "override" else [str(
        _run_folder_with_lr_base(tmp_path))]
    with pytest.raises(SystemExit) as stop:
        main(["keys", *recipe, "train.lr=0.1"])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert stop.value.code == 2 and not captured.out, captured
    assert len(lines) == 1 and lines[0].startswith("accel-train: error: train.lr=0.1 and train.lr_base=0.004 "), lines
    assert "train.lr_base=null" in lines[0]


def test_lr_base_null_override_drops_the_recipes_lr_base(tmp_path):
    run = _run_folder_with_lr_base(tmp_path)
    config = load_config(str(run), ["train.lr_base=null", "train.lr=0.05"])
    assert (config.train.lr, config.train.lr_base) == (0.05, None)
    # without lr_base the recorded lr is a plain train.lr: it no longer follows the batch size
    assert load_config(str(run), ["train.lr_base=null", "train.batch_size=1024"]).train.lr == pytest.approx(0.008)


@pytest.mark.parametrize("override, names", [
    ("train.lr_scale=cube", ["train.lr_scale", "'cube'", "linear", "sqrt"]),
    ("train.lr_base=0", ["train.lr_base", "greater than 0"]),
    ("train.lr_base=-0.1", ["train.lr_base", "greater than 0"]),
    ("train.lr_base_batch=0", ["train.lr_base_batch", "greater than 0"]),
])
def test_lr_base_mistakes_exit_2_with_one_line_naming_the_key(override, names, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["keys", "fashion_mnist_cnn", "train.lr_base=0.004", override])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert stop.value.code == 2 and not captured.out, captured
    assert len(lines) == 1 and lines[0].startswith("accel-train: error:"), lines
    for name in names:
        assert name in lines[0], (name, lines[0])


def test_a_resume_whose_lr_base_gives_another_lr_warns_as_a_changed_train_lr_does(capsys):
    """The checkpoint's scheduler carries the LR on: a train.lr computed anew is named, like one changed by hand."""
    from types import SimpleNamespace

    from accel_train.run.resume import note_schedule_changes

    def warning(saved: list[str], ours: list[str]) -> str:
        meta = {"config": load_config("fashion_mnist_cnn", saved).to_dict()}
        note_schedule_changes("ckpt", meta, load_config("fashion_mnist_cnn", ours), SimpleNamespace(
            is_main_process=True))
        return capsys.readouterr().err

    by_hand = warning(["train.lr=0.004"], ["train.lr=0.008"])
    assert "ignoring train.lr 0.004 -> 0.008" in by_hand, by_hand
    assert warning(["train.lr_base=0.004", "train.batch_size=256"],
                   ["train.lr_base=0.008", "train.batch_size=256"]) == by_hand
    assert warning(["train.lr_base=0.004"], ["train.lr_base=0.004"]) == ""



def test_console_script_is_installed_and_answers_help():
    script = Path(sys.executable).parent / "accel-train"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True)
    assert "accel-train eval RUN [KEY=VALUE ...]" in result.stdout


@pytest.mark.parametrize("command", ["train", "eval", "predict", "keys"])
def test_each_command_has_its_own_usage_with_examples(command, capsys):
    with pytest.raises(SystemExit) as stop:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0
    assert out.startswith(f"usage: accel-train {command} ") and "[KEY=VALUE ...]" in out.splitlines()[0], out
    examples = out.split("examples:\n")[1].splitlines()
    assert sum(line.startswith(f"  accel-train {command} ") for line in examples) >= 2, out
    assert "accel-train recipes   " not in out and "Multi-process:" not in out  # not every command's usage


def test_a_command_missing_its_recipe_names_only_what_is_required(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train"])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err == ("accel-train: error: train: the following arguments are required: RECIPE; accel-train train "
                   "--help shows its usage\n"), err


def test_keys_prints_each_value_as_an_override_takes_it(capsys):
    """Every value `keys` shows, passed back as KEY=VALUE, gives that value: null, true, lists, mappings."""
    given = ["model.name=my_models:Net", "model.args={depth: 3}", "data.mean=[0.5, 0.25, 0.125]"]
    main(["keys", "imagefolder", *given])
    rows = [line.split(None, 3) for line in capsys.readouterr().out.splitlines()]
    shown = {key: value for key, _, column, value in rows if column == "value"}
    assert len(shown) == len(rows) > 60
    recipe = load_config("imagefolder", given)
    for key, _, _, value in describe_keys(recipe):
        if key == "description":
            continue
        spelled_value = spelled(value)
        assert shown[key].startswith(spelled_value + " "), (key, shown[key])
        again = {name: found for name, _, _, found in describe_keys(load_config("imagefolder",
                                                                              [*given, f"{key}={spelled_value}"]))}
        assert again[key] == value, key
    assert shown["data.name"].startswith("imagefolder ") and shown["train.warmup_steps"].startswith("100 ")
    assert shown["data.train_subset"].startswith("null ") and shown["data.augment"].startswith("true ")


def test_help_does_not_import_torch():
    code = ("import sys\nfrom accel_train.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded')")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip().endswith("torch not loaded")
    assert "accel-train train RECIPE" in result.stdout


@pytest.mark.parametrize("command", [["keys"], ["recipes"], ["profiles"], ["runs", "{tmp_path}", "--json"]],
                         ids=["keys", "recipes", "profiles", "runs --json"])
def test_a_listing_piped_into_a_reader_that_left_ends_quietly(command, tmp_path):
    """`accel-train keys | head -1`: head is gone before the listing is written (here, always: its end of the pipe is
    closed first). No BrokenPipeError traceback, and the shell's exit for a command the pipe ended."""
    import os
    import subprocess

    from support.commands import PYTHON, command_env

    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run([PYTHON, "-m", "accel_train", *(part.format(tmp_path=tmp_path) for part in command)],
                                stdout=write, stderr=subprocess.PIPE, text=True, env=command_env(), timeout=120)
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (141, ""), result.stderr


PATH_KEYS = {"output_dir": "~/runs/fm", "resume": "~/runs/fm/checkpoints/step-00000002", "data.root": "~/data",
             "data.cache_dir": "~/cache", "model.init_from": "~/runs/old"}


def test_a_tilde_in_every_path_key_is_the_home_folder_the_same_in_a_recipe_and_on_the_command_line(
        tmp_path, monkeypatch):
    """A shell leaves `~` in most overrides (bash in `data.root=~/data`, sh and zsh in every one): they reach
    accel-train as typed, as a recipe's `output_dir: ~/runs/fm` does. A URL and resume=auto are left as they are."""
    import yaml

    from accel_train.config import flatten

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    tree = {"base": "mnist_cnn", "data": {"name": "shards"}}  # data.cache_dir is the shards' cache
    for key, value in PATH_KEYS.items():
        section, _, name = key.rpartition(".")
        (tree.setdefault(section, {}) if section else tree)[name] = value
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(tree))
    expanded = {key: str(tmp_path / "home" / value.removeprefix("~/")) for key, value in PATH_KEYS.items()}

    from_recipe = flatten(load_config(str(tmp_path / "recipe.yaml")).to_dict())
    overrides = ["data.name=shards", *(f"{key}={value}" for key, value in PATH_KEYS.items())]
    from_overrides = flatten(load_config("mnist_cnn", overrides).to_dict())

    assert {key: from_recipe[key] for key in PATH_KEYS} == {key: from_overrides[key] for key in PATH_KEYS} == expanded
    kept = load_config("mnist_cnn", ["output_dir=s3://bucket/~runs", "resume=auto", "data.root=gs://bucket/~data"])
    assert (kept.output_dir, kept.resume, kept.data.root) == ("s3://bucket/~runs", "auto", "gs://bucket/~data")


def test_a_recipe_with_output_dir_under_tilde_trains_there_and_never_makes_a_folder_named_tilde(tmp_path, monkeypatch,
                                                                                                capsys):
    """And the commands' path arguments alike: eval checkpoint=~/..., plot output=~/... (as sh and zsh leave them)."""
    from support.commands import train_in_process

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipe.yaml").write_text("base: mnist_cnn\noutput_dir: ~/runs/fm\n")

    train_in_process(str(tmp_path / "recipe.yaml"), "data.synthetic=true", "data.train_subset=24",
                     "data.eval_subset=10", "train.batch_size=12", "train.max_steps=2", "train.plot=false")
    main(["eval", "checkpoint=~/runs/fm", "data.synthetic=true", "data.eval_subset=10"])
    main(["plot", str(tmp_path / "home" / "runs" / "fm"), "output=~/curves.png"])

    assert (tmp_path / "home" / "runs" / "fm" / "model.safetensors").is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["home", "recipe.yaml"]  # no folder named ~
    captured = capsys.readouterr()
    assert f"evaluating {tmp_path / 'home' / 'runs' / 'fm'}" in captured.err and '"num_samples": 10' in captured.out
    assert (tmp_path / "home" / "curves.png").is_file()
