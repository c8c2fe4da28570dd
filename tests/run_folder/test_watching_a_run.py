"""Contracts of watching a run: TensorBoard through Accelerate's trackers holds exactly metrics.jsonl's scalars,
curves.png and `accel-train plot` draw them, `accel-train runs` tabulates and compares runs, and the console
prints progress without a terminal and a summary at the end."""

import json
import re
import time

import numpy as np
import pytest
import yaml
from PIL import Image

from accel_train.errors import UserError
from accel_train.run.tracking import installed, tracker_names
from support.commands import run_cli, train_in_process
from support.locations import FASHION_MNIST, needs_fashion_mnist
from support.runs import crash_after_checkpoint_then_resume, read_metrics

# 128 synthetic samples, a quarter held out for validation: 6 optimizer steps of 16 per epoch; 50 test samples.
RUN = ["mnist_cnn", "data.synthetic=true", "data.train_subset=128", "data.val_fraction=0.25",
       "data.eval_subset=50", "model.dropout=false", "train.batch_size=16", "train.eval_batch_size=25",
       "train.log_every_steps=1"]
NOT_SCALARS = ("split", "epoch", "step", "elapsed_s", "time")  # samples_per_s is a scalar


def scalars_of_metrics_jsonl(out) -> dict[str, list[tuple[int, float]]]:
    expected: dict[str, list] = {}
    for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()):
        for key, value in line.items():
            if key not in NOT_SCALARS:
                expected.setdefault(f"{line['split']}/{key}", []).append((line["step"], value))
    return expected


@pytest.mark.skipif(not installed("tensorboard"), reason="tensorboard not installed (it is in the dev extra)")
def test_tensorboard_holds_the_scalars_of_metrics_jsonl_at_their_steps_also_after_a_crash_and_resume(
        tmp_path, monkeypatch, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    out = tmp_path / "run"
    # TensorBoard reads a run's event files in name order: the second each was opened, then a counter of this
    # process. The counter is set so that the resumed run's number sorts first ("...10" before "...8"), as it did
    # in a CI run by chance when both runs opened their files within one second.
    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(8))
    # The run dies after its step-8 checkpoint and is resumed from step 6: what it logged at steps 7 and 8
    # must not stay twice in TensorBoard (nor in metrics.jsonl).
    crash_after_checkpoint_then_resume(8, *RUN, "train.epochs=2", "checkpoint.every_steps=4",
                                       f"output_dir={out}", "train.progress_every_s=0.001",
                                       resume=str(out / "checkpoints" / "step-00000006"))
    events = EventAccumulator(str(out / "trackers" / "accel-train"))
    events.Reload()
    logged = {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    expected = scalars_of_metrics_jsonl(out)
    assert [step for step, _ in expected["train/loss"]] == list(range(1, 13))
    assert logged.keys() == expected.keys()
    for tag, points in expected.items():
        assert [step for step, _ in logged[tag]] == [step for step, _ in points], tag
        assert [value for _, value in logged[tag]] == pytest.approx([value for _, value in points], rel=1e-6), tag
    (hparams, *_) = sorted((out / "trackers" / "accel-train").glob("*/hparams.yml"))
    recorded = yaml.safe_load(hparams.read_text())
    assert recorded["train.batch_size"] == 16 and recorded["data.val_fraction"] == 0.25
    assert recorded["run.world_size"] == 1 and recorded["run.recipe"] == "mnist_cnn"

    printed = capsys.readouterr().out.split("training mnist_cnn")[-1]  # the resumed run's console
    progress = [line for line in printed.splitlines() if line.startswith("epoch 1 step ") and "/12 (" in line]
    assert progress and all("loss " in line and "lr " in line and "samples/s" in line for line in progress[1:])
    summary = printed[printed.index("done: "):].splitlines()
    val = read_metrics(out, "val")
    best = max(val, key=lambda line: line["accuracy"])
    (test,) = read_metrics(out, "test")
    assert summary[0].startswith("done: 12 steps, 2 epoch(s), 1 process(es), mixed precision no")
    assert summary[1].startswith("  wall time ") and "samples/s while training" in summary[1]
    assert summary[2].split() == ["best", "val", "accuracy", f"{best['accuracy']:.4f}", "at", "step",
                                  str(best["step"])]
    assert summary[3].startswith(f"  final      test num_samples 50, loss {test['loss']:.4f}")
    assert f"{out}/: model.safetensors" in summary[4] and "curves.png" in summary[4] and "trackers/" in summary[4]
    assert summary[5] == f"  watch      tensorboard --logdir {out / 'trackers'}"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two finished runs under one folder that differ in the LR, in their tracker and in drawing curves.png."""
    root = tmp_path_factory.mktemp("runs")
    train_in_process(*RUN, "train.epochs=2", f"output_dir={root / 'base'}")
    train_in_process(*RUN, "train.epochs=1", "train.lr=0.003", "train.log_with=none", "train.plot=false",
                     f"output_dir={root / 'fast'}")
    return root


def test_eval_of_a_run_evaluates_its_validation_or_test_split_as_training_did(two_runs):
    from accel_train import evaluate

    run = two_runs / "fast"
    for split, samples in (("val", 32), ("test", 50)):
        metrics, final = evaluate(run, split=split), read_metrics(run, split)[-1]
        assert metrics["num_samples"] == final["num_samples"] == samples
        assert metrics["loss"] == pytest.approx(final["loss"], abs=1e-6), split


def test_runs_tabulates_every_run_under_a_folder_from_its_own_files(two_runs):
    table = run_cli("runs", str(two_runs)).stdout.splitlines()
    assert table[0].split() == ["run", "recipe", "procs", "precision", "steps", "metric", "best", "(step)", "final",
                                "wall", "samples/s", "restarts"]
    rows = {row.split()[0]: row.split() for row in table[1:]}
    assert all(row[-1] == "0" for row in rows.values())
    assert rows.keys() == {"base", "fast"}
    for name, steps in (("base", "12"), ("fast", "6")):
        val, (test,) = read_metrics(two_runs / name, "val"), read_metrics(two_runs / name, "test")
        best = max(val, key=lambda line: line["accuracy"])
        assert rows[name][1:7] == ["mnist_cnn", "1", "no", steps, "accuracy", f"{best['accuracy']:.4f}"]
        assert rows[name][7:9] == [f"({best['step']})", f"{test['accuracy']:.4f}"]

    summaries = {s["name"]: s for s in json.loads(run_cli("runs", str(two_runs), "--json").stdout)}
    base = summaries["base"]
    lines = [json.loads(line) for line in (two_runs / "base" / "metrics.jsonl").read_text().splitlines()]
    rates = [line["samples_per_s"] for line in lines if line["split"] == "train"]
    assert base["steps"] == 12 and base["epochs"] == 2 and base["world_size"] == 1
    assert base["final"]["split"] == "test" and base["final"]["metrics"]["num_samples"] == 50
    assert base["wall_s"] == lines[-1]["elapsed_s"] > 0
    assert (base["starts"], base["restarts"]) == (1, 0)
    assert min(rates) <= base["samples_per_s"] <= max(rates)


def test_runs_diff_names_exactly_the_config_keys_two_runs_differ_in(two_runs):
    differences = json.loads(run_cli("runs", str(two_runs), "--diff", "base", "fast", "--json").stdout)
    assert differences == [{"key": "train.epochs", "a": 2, "b": 1}, {"key": "train.log_with", "a": "auto", "b": "none"},
                           {"key": "train.lr", "a": 0.001, "b": 0.003},
                           {"key": "train.plot", "a": True, "b": False}]
    table = run_cli("runs", str(two_runs), "--diff", str(two_runs / "base"), str(two_runs / "fast")).stdout
    assert "train.lr" in table and "0.003" in table and "output_dir" not in table
    missing = run_cli("runs", str(two_runs), "--diff", "base", "nothing", check=False)
    assert missing.returncode != 0 and "nothing: not a run folder" in missing.stderr


def colour_share(png, rgb) -> float:
    pixels = np.asarray(Image.open(png).convert("RGB")).astype(int)
    return float((np.abs(pixels - np.array(rgb)).sum(axis=-1) < 30).mean())


BLUE, ORANGE, WHITE = (31, 119, 180), (255, 127, 14), (255, 255, 255)  # matplotlib's C0 and C1: runs 1 and 2


def test_training_draws_curves_png_and_plot_overlays_several_runs(two_runs, tmp_path):
    own = two_runs / "base" / "curves.png"
    assert colour_share(own, WHITE) < 0.97 and colour_share(own, BLUE) > 0.001 and colour_share(own, ORANGE) == 0
    assert not (two_runs / "fast" / "curves.png").exists()  # train.plot=false; plot draws it from the files

    picture = tmp_path / "both.png"
    printed = run_cli("plot", str(two_runs / "base"), str(two_runs / "fast"), f"output={picture}").stdout
    assert printed.strip() == str(picture)
    width, height = Image.open(picture).size
    assert width >= 800 and height >= 400
    assert colour_share(picture, BLUE) > 0.001 and colour_share(picture, ORANGE) > 0.001

    from_folder = tmp_path / "folder.png"
    run_cli("plot", str(two_runs), f"output={from_folder}")  # a folder holding runs: each of them
    assert colour_share(from_folder, ORANGE) > 0.001
    nothing = run_cli("plot", str(tmp_path / "empty"), check=False)
    assert nothing.returncode != 0 and "no such folder" in nothing.stderr
    under_a_file = run_cli("plot", str(two_runs / "base"), f"output={picture}/x.png", check=False)
    assert under_a_file.returncode == 74 and "Traceback" not in under_a_file.stderr
    assert under_a_file.stderr.strip().startswith(f"accel-train: error: cannot write {picture}/x.png while drawing")


def test_runs_names_a_damaged_metrics_line_before_the_last_and_skips_only_a_last_line_cut_short(two_runs, tmp_path):
    import shutil

    run = tmp_path / "damaged"
    shutil.copytree(two_runs / "fast", run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([*lines, lines[-1][:20]]) + "\n")  # a crash cut the last one short
    whole = run_cli("runs", str(run)).stdout.splitlines()[1].split()
    assert whole[4] == str(json.loads(lines[-1])["step"]), whole
    (run / "metrics.jsonl").write_text("\n".join([*lines[:2], lines[2][:20], *lines[3:]]) + "\n")
    refused = run_cli("runs", str(run), check=False)
    assert refused.returncode == 3, refused  # a damaged file (README's exit codes)
    assert refused.stderr.strip().startswith(f"accel-train: error: {run / 'metrics.jsonl'} line 3 is damaged ("), \
        refused.stderr


def test_plot_of_runs_without_a_validation_split_shows_only_the_test_split(tmp_path):
    from accel_train.run.plots import draw_runs

    run = tmp_path / "run"
    run.mkdir()
    lines = [{"split": "train", "epoch": 0, "step": 2, "loss": 2.0, "lr": 0.1, "samples_per_s": 5.0},
             {"split": "test", "epoch": 0, "step": 2, "loss": 1.5, "accuracy": 0.5, "num_samples": 10}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    figure = draw_runs([run], ["run"])
    legends = {axes.get_title(): [text.get_text() for text in axes.get_legend().get_texts()]
               for axes in figure.axes if axes.get_legend() is not None}
    assert legends == {"eval loss": ["test"], "eval accuracy": ["test"]}, legends
    lines.append({**lines[1], "split": "val"})
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    legends = [text.get_text() for text in draw_runs([run], ["run"]).axes[1].get_legend().get_texts()]
    assert legends == ["val", "test"], legends


def test_log_with_none_writes_no_tracker_files_and_a_missing_tracker_is_named(two_runs, tmp_path):
    assert (two_runs / "base" / "trackers").is_dir() == installed("tensorboard")
    assert not (two_runs / "fast" / "trackers").exists()
    assert tracker_names("none") == []
    for name, package in (("wandb", "wandb"), ("mlflow", "mlflow"), ("aim", "aim")):
        if installed(package):
            continue
        with pytest.raises(UserError, match=f"train.log_with={name}: {package} is not installed"):
            tracker_names(name)
    if not installed("wandb"):  # the command line says it in one line, before anything is written
        refused = run_cli("train", "mnist_cnn", "train.log_with=wandb", f"output_dir={tmp_path / 'new'}", check=False)
        assert refused.returncode == 2 and refused.stderr.strip() == (
            "accel-train: error: train.log_with=wandb: wandb is not installed (pip install wandb); or set "
            "train.log_with=none")
        assert not (tmp_path / "new").exists()


def screen(raw: str, columns: int = 120) -> list[str]:
    """The lines a terminal of `columns` shows at the end: a carriage return rewrites its line from the first column,
    and a character written past the last column starts a new line (the terminal wraps; nothing here uses escapes)."""
    rows, row, column = [[]], 0, 0
    for char in raw.replace("\r\n", "\n"):
        if char == "\r":
            column = 0
        elif char == "\n":
            row, column = row + 1, 0
        else:
            if column == columns:
                row, column = row + 1, 0
            rows.extend([] for _ in range(row + 1 - len(rows)))
            line = rows[row]
            line.extend(" " * (column + 1 - len(line)))
            line[column] = char
            column += 1
    return [shown for shown in ("".join(line).rstrip() for line in rows) if shown]


def run_in_a_terminal(command: list[str], cwd, columns: int = 120, interrupt_when=None) -> tuple[int, str]:
    """`command` with stdout and stderr on a pseudo-terminal of `columns`, in the user's environment (no
    TQDM_DISABLE): what a person at the terminal sees, byte for byte. `interrupt_when(output so far)`: once true,
    Ctrl-C is typed, as a person would (the terminal echoes it and signals the command's process group)."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import subprocess
    import termios

    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {key: value for key, value in os.environ.items() if key not in ("TQDM_DISABLE", "WORLD_SIZE")}

    def own_terminal() -> None:  # a session of its own, with this terminal controlling it: Ctrl-C reaches it
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    process = subprocess.Popen(command, stdin=secondary, stdout=secondary, stderr=secondary, cwd=cwd,
                               env={**env, "HF_HUB_OFFLINE": "1"}, preexec_fn=own_terminal)
    os.close(secondary)
    output = b""
    while True:
        ready, _, _ = select.select([primary], [], [], 1)
        try:
            chunk = os.read(primary, 65536) if ready else b""
        except OSError:  # the terminal closed: the process has exited
            break
        if ready and not chunk:
            break
        output += chunk
        if interrupt_when is not None and interrupt_when(output.decode(errors="replace")):
            os.write(primary, b"\x03")
            interrupt_when = None
        if not ready and process.poll() is not None:
            break
    os.close(primary)
    return process.wait(timeout=60), output.decode()


@needs_fashion_mnist
def test_the_demo_in_a_terminal_shows_no_warning_and_an_unbroken_bar(tmp_path):
    """`make demo`'s command (on 1,280 images, a checkpoint every 5 steps for messages during the bar): every
    message starts a line of its own, the bar is left once, at 100% with its epoch, and nothing warns."""
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "accel-train"
    code, raw = run_in_a_terminal([str(script), "train", "fashion_mnist_cnn", "train.epochs=1", "output_dir=demo",
                                   f"data.root={FASHION_MNIST}", "data.train_subset=1280", "data.eval_subset=500",
                                   "checkpoint.every_steps=5"], tmp_path)
    assert code == 0, raw
    assert "warning" not in raw.lower() and "\x1b" not in raw, raw
    lines = screen(raw)
    assert lines[0].startswith("training mnist_cnn on fashion_mnist: 1 process(es)"), lines
    done = next(i for i, line in enumerate(lines) if line.startswith("done: 20 steps"))
    bars = [line for line in lines[1:done] if re.match(r"epoch \d+: +\d+%\|", line)]
    messages = [line for line in lines[1:done] if line not in bars]
    assert len(bars) == 1 and re.match(r"epoch 0: 100%\|.*\| 20/20 \[", bars[0]), lines
    expected = (r"checkpoint step \d+ saved in demo/checkpoints/step-\d+: blocked .*|checkpoints: 4 saved; .*|"
                r"epoch 0 step 20 test: num_samples 500, .*")
    assert len(messages) == 5 and all(re.fullmatch(expected, line) for line in messages), lines


def test_ctrl_c_in_a_wide_terminal_leaves_one_bar_and_the_stop_line_on_a_line_of_its_own(tmp_path):
    """Typed in a 160-column terminal while the bar runs: the terminal echoes "^C" after the bar, which on a bar as
    wide as the terminal wrapped to a new line and left a stale copy of the bar; and the stop line, printed after
    an open bar, began at its end."""
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "accel-train"
    code, raw = run_in_a_terminal([str(script), "train", *RUN, "data.train_subset=4096", "train.batch_size=32",
                                   "train.epochs=1", "output_dir=run"], tmp_path, columns=160,
                                  interrupt_when=lambda shown: re.search(r"\| [1-9]\d/\d+ \[", shown))
    lines = screen(raw, columns=160)
    assert code == 75, lines
    bars = [line for line in lines if re.search(r"\d+%\|", line)]
    assert len(bars) == 1 and len(bars[0]) < 160, lines
    stop = [line for line in lines if "stopped by SIGINT" in line]
    assert len(stop) == 1 and stop[0].startswith("accel-train: stopped by SIGINT at step "), lines
    assert lines.index(stop[0]) == len(lines) - 1, lines


def test_a_resume_opens_its_tensorboard_events_after_the_second_of_the_earlier_ones(tmp_path):
    from accel_train.run.tracking import after_earlier_events

    now = int(time.time())
    (tmp_path / f"events.out.tfevents.{now:010d}.host.1.8").write_bytes(b"")
    after_earlier_events(tmp_path)
    assert time.time() >= now + 1  # the next file's name starts with a later second, so it sorts after


def state_of(tmp_path, saved_world_size=None, trackers=(), **settings):
    """What observers read, for a run of mnist_cnn in `tmp_path` at 1 process."""
    from accel_train.config import load_config
    from accel_train.data import Data
    from accel_train.run.place import RunPlace
    from accel_train.state import Progress, ResumePoint, State

    config = load_config("mnist_cnn", [f"output_dir={tmp_path}", *(f"{k}={v}" for k, v in settings.items())])
    launch = {"world_size": 1, "device": "cpu", "mixed_precision": "no"}
    return State(config, Progress(steps_per_epoch=10, total_steps=30), ResumePoint(saved_world_size=saved_world_size),
                 launch, (0, 0), Data(None, 10, (1, 28, 28), ["0"] * 10), tuple(trackers),
                 RunPlace.open(tmp_path, patience_s=1))


def test_the_start_line_says_a_resume_at_another_world_size_once(tmp_path):
    from accel_train.run.display import headline

    assert headline(state_of(tmp_path, saved_world_size=2)) == (
        "training mnist_cnn on mnist: 1 process(es), resumed from a checkpoint of 2 process(es), cpu, mixed precision "
        "no")
    assert headline(state_of(tmp_path, saved_world_size=1)) == "training mnist_cnn on mnist: 1 process(es), cpu, " \
        "mixed precision no"


def test_the_summary_lists_only_the_files_the_run_left(tmp_path):
    """A best model named by checkpoint.best_metric is listed once there is one; before that it is not."""
    from accel_train.run.display import results

    state = state_of(tmp_path, **{"checkpoint.best_metric": "accuracy", "train.plot": "false"})
    for name in ("model.safetensors", "metrics.jsonl", "config.yaml", "starts.jsonl", "classes.json"):
        (tmp_path / name).write_text("")
    assert "model_best.safetensors" not in results(state)
    (tmp_path / "model_best.safetensors").write_text("")
    assert results(state)[:2] == ["model.safetensors", "model_best.safetensors"]
