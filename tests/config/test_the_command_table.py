"""Contracts of the command table (accel_train/cli.py): every command the usage and --help list has one parser and
one function of its own, and main calls the function of the command given."""

import re

import pytest

from accel_train import cli


def test_every_command_listed_has_exactly_one_parser_and_one_function_of_its_own():
    table = cli.command_line().commands.choices
    in_usage = set(re.findall(r"^accel-train ([a-z]+)", cli.USAGE, re.MULTILINE))
    listed = re.findall(r"^    ([a-z]+)\b", cli.command_line().format_help().split("positional arguments:")[1],
                        re.MULTILINE)
    assert listed == list(table) and set(listed) == in_usage, (listed, sorted(in_usage))  # none twice, none missing
    functions = {name: command.get_default("run") for name, command in table.items()}
    assert all(map(callable, functions.values())), functions
    assert len(set(functions.values())) == len(functions), functions  # no function runs two commands


# For each command, arguments its own function answers in a way no other command's would (its first check), and what
# it says. launch's: accelerate launch's own option, which the command line's parser would refuse; sweep's: the
# search space between the options, which only an intermixed parse takes.
ANSWERS = {
    "train": (["train", "{run}"], 2, "a run folder as the recipe trains that run again"),
    "eval": (["eval", "mnist_cnn"], 2, "eval mnist_cnn needs checkpoint=PATH"),
    "predict": (["predict", "mnist_cnn"], 2, "predict needs input=PATH"),
    "export": (["export", "mnist_cnn"], 2, "export needs output=DIR"),
    "shard": (["shard", "index"], 2, "shard index takes one URL"),
    "sweep": (["sweep", "mnist_cnn", "--trials", "0", "train.lr=loguniform(1e-4,1e-1)", "--metric", "accuracy"], 2,
              "sweep: --trials must be 1 or more"),
    "bench": (["bench", "--steps", "0"], 2, "bench: --steps and --processes must be 1 or more"),
    "runs": (["runs", "{tmp}"], 0, "no runs under {tmp}"),
    "plot": (["plot", "{tmp}"], 2, "plot: no run folder"),
    "photos": (["photos", "{tmp}/photos", "--train", "0"], 2, "photos: --train 0 --test 256"),
    "launch": (["launch", "--join_timeout", "x"], 2, "--join_timeout=x: give the seconds"),
    "recipes": (["recipes"], 0, "\nmnist_cnn "),
    "profiles": (["profiles"], 0, "\nmulti_gpu "),
    "profile": (["profile", "multi_gpu"], 0, "multi_gpu.yaml\n"),
    "keys": (["keys"], 0, "\ntrain.lr "),
    "doctor": (["doctor", "--config_file", "{tmp}/nowhere.yaml"], 2, "nowhere.yaml: no such file"),
}


def test_every_command_has_an_answer_below():
    assert set(ANSWERS) == set(cli.command_line().commands.choices)


@pytest.mark.parametrize("command", ANSWERS)
def test_main_calls_the_function_of_the_command_given(command, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("base: mnist_cnn\n")
    argv, code, answer = ANSWERS[command]
    try:
        cli.main([part.format(run=run, tmp=tmp_path) for part in argv])
        exit_code = 0
    except SystemExit as exit:
        exit_code = exit.code
    said = capsys.readouterr()
    assert exit_code == code and answer.format(tmp=tmp_path) in "\n" + said.out + said.err, said
