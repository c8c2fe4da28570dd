"""The package's lines go through `logging` (accel_train/console.py, docs/logging.md): the command line and a program
that configures nothing print the same lines as before; a program controls them with the standard logging calls."""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest

from support.commands import run_cli, train_in_process

# A run small enough for a test that says every kind of line: a headline, a checkpoint per step, an evaluation, a
# warning (best_metric chosen on the test set), the summary, the checkpoints' total.
RUN = ["data.synthetic=true", "data.train_subset=64", "data.eval_subset=32", "train.batch_size=32", "train.epochs=1",
       "train.plot=false", "train.log_with=none", "data.num_workers=0", "checkpoint.every_steps=1",
       "checkpoint.best_metric=accuracy"]
STDOUT = """\
training mnist_cnn on mnist: 1 process(es), cpu, mixed precision no, 2 steps
checkpoint step 1 saved in {out}/checkpoints/step-00000001: blocked # s, written in # s (# MiB)
epoch 0 step 2 test: num_samples 32, loss #, accuracy #, correct #, top5 #
checkpoint step 2 saved in {out}/checkpoints/step-00000002: blocked # s, written in # s (# MiB)
done: 2 steps, 1 epoch(s), 1 process(es), mixed precision no
  wall time  #s (# samples/s while training, #% of it waiting for data)
  best       test accuracy # at step 2
  final      test num_samples 32, loss #, accuracy #, correct #, top5 # (step 2)
  files      {out}/: model.safetensors, model_best.safetensors, metrics.jsonl, config.yaml, starts.jsonl, \
classes.json, checkpoints/
checkpoints: 2 saved; training blocked # s by them, written in # s in all
"""
STDERR = """\
accel-train: warning: checkpoint.best_metric / train.early_stop_patience choose on the test set, which then no \
longer measures unseen data; set data.val_fraction (e.g. 0.1) to choose on a validation split
"""


def measured(text: str) -> list[str]:
    """The lines with what a run measures (times, sizes, speeds, metrics) as #: what is left is what they say. Sorted:
    a background save's line comes when the save ends, before or after the evaluation's."""
    text = re.sub(r"\d+\.\d+|\d+(?=%| samples/s)", "#", text)
    return sorted(re.sub(r"correct \d+", "correct #", text).splitlines())


@pytest.fixture
def library_logger():
    """The "accel_train" logger as importing the package left it, and so again after the test: its level, handlers and
    propagation."""
    import accel_train  # noqa: F401 (what sets the logger up)

    logger = logging.getLogger("accel_train")
    before = logger.level, list(logger.handlers), logger.propagate
    yield logger
    logger.setLevel(before[0])
    logger.handlers[:] = before[1]
    logger.propagate = before[2]


class Terminal(io.StringIO):
    """A stderr that says it is a terminal: where a progress bar would be drawn."""

    def isatty(self) -> bool:
        return True


def test_the_command_line_prints_the_lines_it_always_printed(tmp_path):
    result = run_cli("train", "mnist_cnn", *RUN, f"output_dir={tmp_path}")
    assert measured(result.stdout) == sorted(STDOUT.format(out=tmp_path).splitlines()), result.stdout
    assert result.stderr == STDERR, result.stderr


def test_a_program_that_configures_nothing_sees_the_command_lines_lines(tmp_path, capsys, library_logger):
    train_in_process("mnist_cnn", *RUN, f"output_dir={tmp_path}")
    printed = capsys.readouterr()
    assert measured(printed.out) == sorted(STDOUT.format(out=tmp_path).splitlines()), printed.out
    assert printed.err == STDERR, printed.err


def test_a_program_at_error_level_sees_no_line_and_no_progress_bar(tmp_path, capfd, monkeypatch, library_logger):
    library_logger.setLevel(logging.ERROR)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)  # tqdm draws its bar where stderr is a terminal
    train_in_process("mnist_cnn", *RUN, "train.progress_bar=true", f"output_dir={tmp_path}")
    printed = capfd.readouterr()
    assert (printed.out, printed.err, terminal.getvalue()) == ("", "", "")


def test_a_programs_handler_receives_the_records_with_their_module_and_level(tmp_path, capsys, library_logger):
    received: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = received.append
    library_logger.addHandler(handler)
    train_in_process("mnist_cnn", *RUN, f"output_dir={tmp_path}")
    said = [(record.name, record.levelname, record.getMessage()) for record in received]
    assert ("accel_train.training.selection", "WARNING", STDERR.removeprefix("accel-train: warning: ").rstrip()) in said
    assert [name for name, level, message in said if message.startswith("done: ")] == ["accel_train.run.display"]
    assert capsys.readouterr().out, "a handler of the program's own is added beside the console's, which still prints"


def test_propagation_hands_the_lines_to_the_programs_handlers_and_prints_each_once(capsys, library_logger):
    received: list[logging.LogRecord] = []
    root = logging.getLogger()
    handler = logging.Handler()
    handler.emit = received.append
    root.addHandler(handler)
    try:
        library_logger.propagate = True
        logging.getLogger("accel_train.run.display").info("a line")
        logging.getLogger("accel_train.run.display").warning("a warning")
    finally:
        root.removeHandler(handler)
    assert [(record.levelname, record.getMessage()) for record in received] == [("INFO", "a line"),
                                                                               ("WARNING", "a warning")]
    assert capsys.readouterr() == ("", "")
