"""Contracts of `accel-train sweep`: every trial a normal run folder, pruned by signal, a stopped sweep resumed
without losing a trained step, the same seed sampling the same values, and bad input answered before any trial.

On real Fashion-MNIST (a small subset), so a learning rate that learns nothing is worse than one that learns and
the median pruner has something to decide.
"""

import json
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from support.commands import PYTHON, free_port, run_cli, start
from support.locations import FASHION_MNIST, PROFILES, needs_fashion_mnist

pytestmark = needs_fashion_mnist

# 1 epoch of 30 steps (960 train samples at 32), evaluated on the 320 held out every 3 steps: a trial the
# pruner rejects at its first evaluation still has most of its training ahead when SIGTERM comes.
DATA = [f"data.root={FASHION_MNIST}", "data.train_subset=1280", "data.val_fraction=0.25", "data.eval_subset=200",
        "train.batch_size=32", "train.eval_every_steps=3", "train.epochs=1", "train.plot=false"]
# 0.003 learns, 1e-6 learns nothing (pruned once a trial is complete), 1e9 diverges (the trial fails, exit 5)
SPACE = ["train.lr=choice(0.003,1e-6,1e9)", "train.label_smoothing=uniform(0,0.1)"]
SWEEP = ["sweep", "fashion_mnist_cnn", "--metric", "accuracy", "--startup_trials", "1", "--seed", "3", *SPACE, *DATA]


def wait_for(condition, log: Path, process=None, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process is None or process.poll() is None, f"exited {process.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def study_trials(folder: Path) -> list:
    from accel_train.sweep.study import load_study

    return load_study(folder).get_trials()


def train_steps(run: Path) -> list[int]:
    return [line["step"] for line in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if line["split"] == "train"]


@pytest.fixture(scope="module")
def six_trials(tmp_path_factory) -> tuple[Path, str]:
    folder = tmp_path_factory.mktemp("sweep") / "fm"
    result = run_cli(*SWEEP, "--trials", "6", f"output_dir={folder}", timeout=600)
    return folder, result.stdout


def test_a_six_trial_sweep_finishes_learning_trials_complete_bad_ones_are_pruned_diverging_ones_fail(six_trials):
    folder, output = six_trials
    trials = study_trials(folder)
    assert [t.number for t in trials] == list(range(6)) and all(t.state.is_finished() for t in trials)
    by_lr = {lr: [t for t in trials if t.params["train.lr"] == lr] for lr in (0.003, 1e-6, 1e9)}
    assert all(by_lr.values()), f"seed 3 must sample every learning rate: {[t.params for t in trials]}"
    # a trial that learns nothing, after one that learned, is stopped by SIGTERM: it saves and exits 75
    first_complete = min(t.number for t in trials if t.state.name == "COMPLETE")
    bad = [t for t in by_lr[1e-6] if t.number > first_complete]
    assert bad and all(t.state.name == "PRUNED" for t in bad), [(t.number, t.state) for t in trials]
    for trial in bad:
        log = (folder / "logs" / f"trial-{trial.number:04d}.log").read_text()
        saved = re.search(r"stopped by SIGTERM at step (\d+); checkpoint saved", log)
        assert saved and f"trial {trial.number}: pruned; it saved a checkpoint at step {saved.group(1)} and exited " \
                          "75" in output, log[-2000:]
        assert int(saved.group(1)) < 30  # stopped before the end of its training
    # a diverging trial is recorded failed with its error line, and the sweep went on
    for trial in by_lr[1e9]:
        assert trial.state.name == "FAIL" and trial.user_attrs["exit_code"] == 5
        assert trial.user_attrs["error"].startswith("non-finite loss or gradient norm at step")
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert complete and all(t.params["train.lr"] == 0.003 for t in complete)
    # a complete trial's value is its last evaluation on the validation split
    for trial in complete:
        val = [line for line in map(json.loads, (folder / f"trial-{trial.number:04d}" / "metrics.jsonl")
                                    .read_text().splitlines()) if line["split"] == "val"]
        assert trial.value == val[-1]["accuracy"] and trial.intermediate_values[len(val)] == trial.value


def test_the_summary_and_runs_list_the_trials_best_first_with_their_values_and_the_best_ones_train_command(
        six_trials):
    folder, output = six_trials
    trials = study_trials(folder)
    best = max((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    table = run_cli("runs", str(folder)).stdout
    rows = [line.split() for line in table.splitlines()]
    assert rows[0][:5] == ["trial", "state", "accuracy", "train.label_smoothing", "train.lr"]
    assert rows[1][:2] == [f"trial-{best.number:04d}", "complete"] and len(rows) == 7
    values = [float(row[2]) for row in rows[1:] if row[1] == "complete"]
    assert values == sorted(values, reverse=True)
    assert table in output  # the sweep's summary shows the same table
    # the line that ends a trial gives the wall time of its row: the run's own time (metrics.jsonl), over its starts
    walls = {row[0]: row[-1] for row in rows[1:]}
    ended = re.findall(r"^trial (\d+): (?:complete|pruned)[,;] .* \((\d[\dhms.]*)\)$", output, re.MULTILINE)
    assert len(ended) == sum(t.state.name in ("COMPLETE", "PRUNED") for t in trials) > 1, output
    assert all(took == walls[f"trial-{int(number):04d}"] for number, took in ended), (ended, walls)
    line = next(line for line in output.splitlines() if line.startswith("train it again: "))
    command = line.removeprefix("train it again: ").split()
    assert command[:3 + len(DATA)] == ["accel-train", "train", "fashion_mnist_cnn", *DATA]
    assert f"train.lr={best.params['train.lr']}" in command
    assert f"train.label_smoothing={best.params['train.label_smoothing']!r}" in command
    assert (folder / "curves.png").stat().st_size > 0 and (folder / "parameters.png").stat().st_size > 0


def test_a_trial_folder_is_a_normal_run_evaluated_by_eval_and_a_pruned_one_resumes_by_hand(six_trials):
    folder, _ = six_trials
    trials = study_trials(folder)
    complete = next(t for t in trials if t.state.name == "COMPLETE")
    run = folder / f"trial-{complete.number:04d}"
    evaluated = json.loads(run_cli("eval", str(run)).stdout)
    final_test = [line for line in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                  if line["split"] == "test"][-1]
    assert evaluated["accuracy"] == final_test["accuracy"] and evaluated["num_samples"] == 200
    pruned = next(t for t in trials if t.state.name == "PRUNED")
    resumed = folder / f"trial-{pruned.number:04d}"
    stopped_at = max(train_steps(resumed))
    run_cli("train", str(resumed), "resume=auto")
    steps = train_steps(resumed)
    assert steps == sorted(set(steps)) and steps[-1] == 30 and stopped_at < 30


def test_a_sweep_whose_every_trial_fails_ends_saying_no_trial_completed_and_exits_1(tmp_path):
    folder = tmp_path / "fm"
    result = run_cli("sweep", "fashion_mnist_cnn", "--metric", "accuracy", "--trials", "2", "--seed", "3",
                     "train.lr=loguniform(1e8,1e9)", *DATA, f"output_dir={folder}", check=False)  # each diverges
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len([line for line in lines if re.match(r"trial \d: failed \(exit 5\): non-finite loss", line)]) == 2
    assert lines[-1] == "no trial completed" and not any(line.startswith("best: ") for line in lines), lines[-5:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("accel-train: error:")]
    assert errors == [f"accel-train: error: sweep: none of the 2 trial(s) completed, so the sweep has no result; see "
                      f"each trial's error above and its log in {folder / 'logs'}"], result.stderr
    assert [t.state.name for t in study_trials(folder)] == ["FAIL", "FAIL"]


def test_a_sweep_killed_mid_trial_resumes_that_trial_at_2_processes_and_ends_with_exactly_n_trials(
        six_trials, tmp_path):
    folder = tmp_path / "fm"
    launch = (f"{PYTHON} -m accelerate.commands.launch --config_file {PROFILES / 'multi_gpu.yaml'} --num_processes 2 "
              f"--main_process_port {free_port()}")
    command = [PYTHON, "-m", "accel_train", *SWEEP, "--trials", "2", "--launch", launch, f"output_dir={folder}",
               "checkpoint.at_epoch_end=false"]
    log = tmp_path / "sweep.log"
    sweep = start(command, log)
    run = folder / "trial-0000"
    wait_for(lambda: "trial 0: evaluation 2 " in log.read_text(), log, sweep)
    sweep.kill()  # SIGKILL: the sweep says nothing; its trial gets SIGTERM from the kernel, saves and exits 75
    sweep.wait()
    trial_log = folder / "logs" / "trial-0000.log"
    wait_for(lambda: "checkpoint saved" in trial_log.read_text(), trial_log, timeout=120)
    first = run_cli(*command[3:], timeout=600).stdout
    assert re.search(r"^trial 0: train.label_smoothing=\S+ train.lr=0.003 \(resumed\)", first, re.MULTILINE), first
    starts = [json.loads(line) for line in (run / "starts.jsonl").read_text().splitlines()]
    saved = int(re.search(r"stopped by SIGTERM at step (\d+)", (folder / "logs" / "trial-0000.log").read_text())[1])
    assert [(s["step"], s["world_size"]) for s in starts] == [(0, 2), (saved, 2)]
    steps = train_steps(run)
    assert steps == sorted(set(steps)) and steps[-1] == 30  # its metrics.jsonl goes on; no step trained twice
    trials = study_trials(folder)
    assert len(trials) == 2 and all(t.state.is_finished() for t in trials)
    # the same seed samples the same values: this sweep's first trial is the 6-trial sweep's first trial
    fixture = study_trials(six_trials[0])
    assert trials[0].params == fixture[0].params


def test_the_same_seed_samples_the_same_values_at_random_and_by_tpe_and_another_seed_others():
    optuna = pytest.importorskip("optuna")
    from accel_train.sweep.space import parse_space
    from accel_train.sweep.study import new_trial

    parameters, _ = parse_space(["train.lr=loguniform(1e-4,1e-1)", "train.batch_size=choice(64,128,256)",
                                 "model.latent_size=int(2,32)"])

    def sampled(seed: int) -> list[dict]:
        study = optuna.create_study(direction="maximize")
        values = []
        for number in range(6):  # 2 at random, then TPE from the trials so far
            trial = new_trial(study, parameters, seed, startup_trials=2)
            values.append(trial.params)
            study.tell(trial, trial.params["train.lr"] * 10 + number / 100)
        return values

    assert sampled(5) == sampled(5)
    assert all(a != b for a, b in zip(sampled(5), sampled(6)))


BAD = {
    "an unknown distribution": (["train.lr=logunifrom(1e-4,1e-1)"],
                                "unknown distribution 'logunifrom' in train.lr=logunifrom(1e-4,1e-1); choose one of "
                                "uniform"),
    "a key that does not exist": (["train.learning_rate=loguniform(1e-4,1e-1)"],
                                  "unknown config key 'train.learning_rate'; valid keys here: train.epochs"),
    "low above high": (["train.lr=loguniform(0.1,0.001)"], "low (0.1) must be below high (0.001)"),
    "low equal to high": (["train.label_smoothing=uniform(0.1,0.1)"], "low (0.1) must be below high (0.1)"),
    "a float range for an integer key": (["train.batch_size=uniform(32,256)"],
                                         "train.batch_size takes integers; search it with int(...), logint(...)"),
    "a value the key refuses": (["train.label_smoothing=uniform(0,1.5)"], "train.label_smoothing: must be below 1"),
    "a metric the task never reports": (["train.lr=loguniform(1e-4,1e-1)", "--metric", "f1"],
                                        "--metric f1 is not an evaluation metric of task=classification; it reports "
                                        "accuracy, top5, loss"),
    "resume given": (["train.lr=loguniform(1e-4,1e-1)", "resume=auto"], "resume is the sweep's to set"),
    "a launch command that is not there": (["train.lr=loguniform(1e-4,1e-1)", "--launch", "acelerate launch"],
                                           "acelerate is not a command found on PATH"),
}


@pytest.mark.floors
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_exit_2_before_any_trial(case, tmp_path, capsys):
    from accel_train.cli import main

    arguments, expected = BAD[case]
    arguments = arguments if "--metric" in arguments else [*arguments, "--metric", "accuracy"]
    with pytest.raises(SystemExit) as stopped:
        main(["sweep", "fashion_mnist_cnn", "--trials", "2", *arguments, f"output_dir={tmp_path / 'fm'}"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "fm").exists()


def test_a_changed_search_space_against_an_existing_study_is_one_line_and_the_study_is_untouched(six_trials, capsys):
    from accel_train.cli import main

    folder, _ = six_trials
    journal = (folder / "study.journal").read_bytes()
    changed = [*SWEEP, "--trials", "8", f"output_dir={folder}"]
    changed[changed.index(SPACE[1])] = "train.label_smoothing=uniform(0,0.2)"
    with pytest.raises(SystemExit) as stopped:
        main(changed)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    assert (f"{folder} holds a study of another search (search train.label_smoothing=uniform(0,0.1) "
            "train.lr=choice(0.003,1.0e-06,1000000000.0) there, train.label_smoothing=uniform(0,0.2)") in err
    assert (folder / "study.journal").read_bytes() == journal


def test_without_optuna_the_sweep_gives_the_install_command(tmp_path, capsys, monkeypatch):
    from accel_train.cli import main

    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna raises ImportError
    with pytest.raises(SystemExit) as stopped:
        main(["sweep", "fashion_mnist_cnn", "--trials", "2", "--metric", "accuracy", "train.lr=loguniform(1e-4,1e-1)",
              f"output_dir={tmp_path / 'fm'}"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "pip install 'accel-train[sweep]'" in err and err.count("\n") == 1
    assert not (tmp_path / "fm").exists()


def test_parameters_png_shows_a_choices_values_in_the_order_the_command_gave_them():
    """choice(64,128,256) reads 64, 128, 256 along its axis (not as text sorts them: 128, 256, 64), each trial at
    its value's place."""
    from accel_train.run.plots import draw_parameters

    trials = [{"state": "complete", "value": value, "params": {"train.batch_size": size}}
              for size, value in ((256, 0.8), (64, 0.7), (128, 0.9))]
    figure = draw_parameters(trials, [("train.batch_size", False, (64, 128, 256))], "accuracy")
    axes = figure.axes[0]
    assert [label.get_text() for label in axes.get_xticklabels()] == ["64", "128", "256"]
    placed = {tuple(point) for collection in axes.collections[:1] for point in collection.get_offsets().tolist()}
    assert placed == {(2.0, 0.8), (0.0, 0.7), (1.0, 0.9)}


def test_a_sweep_in_object_storage_stopped_mid_trial_goes_on_from_the_store_on_another_machine(object_store, tmp_path):
    url = object_store.url("sweeps/fm")
    command = [PYTHON, "-m", "accel_train", *SWEEP, "--trials", "2", f"output_dir={url}",
               "checkpoint.at_epoch_end=false"]
    log = tmp_path / "sweep.log"
    sweep = start(command, log, env={"ACCEL_TRAIN_STAGING": str(tmp_path / "machine-a")})
    wait_for(lambda: "trial 0: evaluation 2 " in log.read_text(), log, sweep)
    sweep.send_signal(signal.SIGTERM)  # the trial saves; the sweep uploads all it has before it ends
    assert sweep.wait(timeout=120) == 75, log.read_text()[-3000:]
    assert not list((tmp_path / "machine-a").rglob("study.journal")), "the stopped machine's staging is left"
    second = run_cli(*command[3:], env={"ACCEL_TRAIN_STAGING": str(tmp_path / "machine-b")}, timeout=600).stdout
    assert re.search(r"^trial 0: train.label_smoothing=\S+ train.lr=\S+ \(resumed\)", second, re.MULTILINE), second
    assert f": {url}/trial-0000, log {url}/logs/trial-0000.log" in second, second  # named as the user gave them
    copy = tmp_path / "copy"
    object_store.fs().get(f"{object_store.bucket}/sweeps/fm/", str(copy), recursive=True)
    starts = [json.loads(line) for line in (copy / "trial-0000" / "starts.jsonl").read_text().splitlines()]
    assert len(starts) == 2 and starts[1]["step"] > 0, starts  # trial 0 resumed from its checkpoint in the store
    steps = train_steps(copy / "trial-0000")
    assert steps == sorted(set(steps)) and steps[-1] == 30
    trials = study_trials(copy)
    assert len(trials) == 2 and all(t.state.is_finished() for t in trials)
    listed = run_cli("runs", url).stdout
    assert "trial-0000" in listed and "trial-0001" in listed, listed
