"""Contracts of checkpoints and resume, with 2 processes through the shipped multi_gpu profile (gloo on CPU).

One uninterrupted run is the reference. A run stopped in any way (a crash right after a checkpoint at an
epoch boundary or mid-epoch, SIGTERM, a killed worker, a damaged newest checkpoint) and continued with
resume=auto must reproduce its metrics.jsonl line for line (samples_per_s aside) and its final weights, and
the EMA of the weights, bit for bit. Dropout, random crop/flip, MixUp/CutMix and the EMA stay on, so the
restored RNG state has to give the same masks, the resumed epoch the same crops and mixes, and the restored
average the same weights; train lines every 3 steps and checkpoints every 4 put most resume points in
the middle of a line's steps, so the restored partial sums have to give the same averages.
"""

import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from accel_train.run.checkpoint_files import list_checkpoints, read_meta, to_keep
from accel_train.run.layout import read_starts
from accel_train.run.summaries import TIMING
from support.commands import (
    FRESH_LAUNCHER,
    PYTHON,
    accelerate,
    free_port,
    launch,
    run_cli,
    start,
    start_launch,
    torchrun,
    train_in_process,
    wait_for,
)
from support.locations import PROBE, PROFILES, REPO
from support.runs import (
    assert_resumed_from,
    assert_same_run,
    assert_same_weights,
    metrics_lines_before,
    metrics_without_timing,
    read_metrics,
)

STEPS_PER_EPOCH, TOTAL_STEPS = 10, 30
WEIGHTS = ("model.safetensors", "model_ema.safetensors")
# torch's own dropout masks (train.keyed_dropout=false), drawn from each process's stream: exact resume then needs
# every process's random state restored, the harder case (keyed masks need none: their own contract tests)
RUN = ["train", "mnist_cnn", "data.synthetic=true", "data.augment=true", "data.train_subset=240", "data.eval_subset=50",
       "train.batch_size=24", "train.epochs=3", "train.log_every_steps=3", "train.ema_decay=0.9",
       "train.mixup_alpha=0.4", "train.cutmix_alpha=1.0", "train.keyed_dropout=false",
       "checkpoint.every_steps=4", "checkpoint.keep_last=2", "checkpoint.best_metric=accuracy", "train.plot=false"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, through the probe: its recorders (reference_records) change nothing it computes."""
    base = tmp_path_factory.mktemp("reference")
    launch(2, *RUN, f"output_dir={base / 'run'}", script=PROBE, env={"PROBE_DIR": str(base / "records")})
    return base / "run"


@pytest.fixture(scope="module")
def reference_records(reference):
    return [json.loads((reference.parent / "records" / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_dropout_draws_differ_per_process(reference_records):
    # Each process reseeds with its rank after prepare: the same random state on both would draw the same masks
    # wherever torch's streams draw them (train.keyed_dropout=false, dropout a model draws in its forward), and halve
    # dropout's effect.
    states = [records["dropout"] for records in reference_records]
    assert len(states[0]) == len(states[1]) == TOTAL_STEPS and len(set(states[0])) == TOTAL_STEPS
    assert all(ours != theirs for ours, theirs in zip(*states))


def test_a_train_line_averages_the_loss_over_its_steps_and_over_the_processes(reference, reference_records):
    losses = [[loss for loss, skipped in records["meter"]] for records in reference_records]
    lines, since = read_metrics(reference, "train"), 0
    assert [line["step"] for line in lines] == list(range(3, TOTAL_STEPS + 1, 3))
    for line in lines:  # log_every_steps=3
        steps = range(since, line["step"])
        expected = sum(losses[rank][step] for rank in (0, 1) for step in steps) / (2 * len(steps))
        assert line["loss"] == pytest.approx(expected, rel=1e-6), line
        since = line["step"]


def checkpoints(out: Path) -> list[tuple[Path, dict]]:
    return list_checkpoints(out / "checkpoints")


def test_checkpoints_keep_the_newest_and_the_best_and_describe_themselves(reference):
    kept = {meta["step"]: (folder, meta) for folder, meta in checkpoints(reference)}
    evals = read_metrics(reference, "test")
    best = max(evals, key=lambda line: line["accuracy"])["step"]  # the earliest of equals
    # 9 saves (every 4 steps and at each epoch end); the newest 2 remain, plus the best evaluated one
    assert set(kept) == {28, 30, best}
    assert not list((reference / "checkpoints").glob(".*")), "no partial folder is left behind"
    folder, meta = kept[30]
    assert (meta["epoch"], meta["batches_done_in_epoch"], meta["evaluated"], meta["world_size"]) == (2, 10, True, 2)
    assert meta["metrics"] == {k: v for k, v in evals[-1].items() if k not in ("split", "epoch", "step", *TIMING)}
    saved_config = yaml.safe_load((reference / "config.yaml").read_text())
    saved_config.pop("run")
    assert meta["config"] == saved_config
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "random_states_1.pkl"} \
        <= set(meta["files"])
    assert all((folder / name).stat().st_size == size for name, size in meta["files"].items())


@pytest.mark.floors
def test_crashes_after_checkpoints_at_an_epoch_end_and_mid_interval_then_resume_equal_the_uninterrupted_run(
        reference, tmp_path):
    # Step 10 ends epoch 0 (its checkpoint follows the evaluation); step 16 is mid-epoch 1 and the first of the
    # three steps of the train line at 18, so that line averages one step from before the crash and two after.
    for crash_after in (10, 16):
        crashed = launch(2, *RUN, f"output_dir={tmp_path}", "resume=auto", script=PROBE,
                         env={"PROBE_CRASH_AFTER_SAVE": str(crash_after)}, check=False)
        assert crashed.returncode != 0 and checkpoints(tmp_path)[-1][1]["step"] == crash_after, crashed.stderr[-3000:]
    result = launch(2, *RUN, f"output_dir={tmp_path}", "resume=auto")
    assert "step 16, epoch 1, 6 batches of it done" in result.stdout
    assert_same_run(tmp_path, reference, WEIGHTS)


def test_sigterm_to_the_launcher_saves_and_ends_the_job_though_restarts_are_allowed_and_resume_equals_one_run(
        reference, tmp_path):
    log = tmp_path / "log"
    # The self-healing launch line: a preemption must still end the job, not be restarted as a failure.
    job = start_launch(2, *RUN, f"output_dir={tmp_path}", "resume=auto", log=log, launcher_args=("--max_restarts", "3"))
    wait_for(lambda: (tmp_path / "metrics.jsonl").is_file() and read_metrics(tmp_path, "train"), job, log)
    job.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    job.wait(timeout=60)
    # The workers exit 75 (see README); accelerate launch / torchrun report their own signal as exit 1.
    assert job.returncode != 0
    stopped = re.search(r"stopped by SIGTERM at step (\d+); checkpoint saved", log.read_text())
    assert stopped, log.read_text()[-3000:]
    print(f"\nSIGTERM to the launcher: checkpoint saved and the job ended {time.monotonic() - signalled:.1f} s later")
    step = int(stopped.group(1))
    assert 1 <= step < TOTAL_STEPS
    assert checkpoints(tmp_path)[-1][1]["step"] == step
    assert [start["launcher_restart"] for start in read_starts(tmp_path)] == [0], "the launcher restarted the run"
    launch(2, *RUN, f"output_dir={tmp_path}", "resume=auto")
    assert [(start["step"], start["launcher_restart"]) for start in read_starts(tmp_path)] == [(0, 0), (step, 0)]
    assert_same_run(tmp_path, reference, WEIGHTS)


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_a_single_process_saves_a_checkpoint_at_the_step_it_names_and_exits_75(tmp_path, sent):
    log = tmp_path / "log"
    # No periodic checkpoints: the one found can only be the signal's.
    job = start([PYTHON, "-m", "accel_train", *RUN, f"output_dir={tmp_path}", "checkpoint.every_steps=null",
                 "checkpoint.at_epoch_end=false"], log)
    wait_for(lambda: (tmp_path / "metrics.jsonl").is_file() and read_metrics(tmp_path, "train"), job, log)
    job.send_signal(sent)
    assert job.wait(timeout=60) == 75, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text and f"{sent.name} received by process 0" in text
    step = int(re.search(rf"stopped by {sent.name} at step (\d+); checkpoint saved", text).group(1))
    assert [meta["step"] for _, meta in checkpoints(tmp_path)] == [step] and step < TOTAL_STEPS


def test_a_second_signal_during_the_save_does_not_cut_the_checkpoint_short(tmp_path):
    # Process 0 gets SIGTERM at step 5, then SIGINT as the save that the processes agreed on begins (a launcher
    # forwarding Ctrl-C again): the processes still save that step whole and exit 75 (the launcher's summary
    # lists the first to exit, and the other only if it exited before the launcher stopped it).
    result = launch(2, *RUN, f"output_dir={tmp_path}", "checkpoint.every_steps=null", "checkpoint.at_epoch_end=false",
                    script=PROBE, env={"PROBE_SIGNALS_AT": "5"}, check=False, timeout=120)
    stopped = re.search(r"stopped by SIGTERM at step (\d+); checkpoint saved", result.stdout + result.stderr)
    assert result.returncode != 0 and stopped, result.stderr[-3000:]
    ((folder, meta),) = checkpoints(tmp_path)
    assert meta["step"] == int(stopped.group(1)) >= 5
    assert all((folder / name).stat().st_size == size for name, size in meta["files"].items())
    assert "exitcode  : 75" in result.stderr and "KeyboardInterrupt" not in result.stderr


@pytest.mark.fresh_interpreters  # signals or inspects the processes themselves (psutil)
def test_ctrl_c_before_training_starts_exits_130_in_silence(tmp_path):
    log = tmp_path / "log"
    job = start([PYTHON, "-m", "accel_train", *RUN, f"output_dir={tmp_path}"], log)
    process = psutil.Process(job.pid)
    # torch loads inside the command's error handling, long before training starts: signal while it loads.
    wait_for(lambda: any("libtorch" in m.path for m in process.memory_maps()), job, log, timeout=60)
    job.send_signal(signal.SIGINT)
    assert job.wait(timeout=60) == 130, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text() and not (tmp_path / "checkpoints").exists()


@pytest.mark.fresh_interpreters  # signals or inspects the processes themselves (psutil)
def test_a_hung_process_fails_the_others_at_collective_timeout_s(tmp_path):
    # The collective timeout alone (its own contract): without the watchdog, which would name the stopped process
    # at half of it (distributed/test_a_stuck_process_is_named.py).
    log, timeout_s = tmp_path / "log", 5
    job = start_launch(2, *RUN, f"output_dir={tmp_path}", f"train.collective_timeout_s={timeout_s}",
                       "train.stuck_after_s=0", log=log)
    wait_for(lambda: (tmp_path / "metrics.jsonl").is_file() and read_metrics(tmp_path, "train"), job, log)
    worker = psutil.Process(job.pid).children()[-1]
    try:
        worker.suspend()  # SIGSTOP: alive and silent, like a deadlock or a stuck device
        hung = time.monotonic()
        # gloo's words depend on the collective the timeout hits ("Timed out waiting 5000ms for recv", "Application
        # timeout caused pair closure"): the package's one line names either
        while job.poll() is None and time.monotonic() - hung < timeout_s + 60 and \
                "process 0: a collective failed" not in log.read_text():
            time.sleep(0.05)
        noticed = time.monotonic() - hung
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):  # the launcher may have ended the group, the stopped one too
            worker.kill()
    job.wait(timeout=60)
    # The other process's clock starts when it enters the collective, which may be just before the SIGSTOP (4.997 s
    # was seen in CI): a second's slack still tells the timeout from the watchdog's half of it.
    assert job.returncode != 0 and timeout_s - 1 <= noticed < timeout_s + 30, noticed
    print(f"\nhung process, train.collective_timeout_s={timeout_s}: the others failed {noticed:.1f} s later")


def test_a_killed_worker_fails_the_job_within_60_s(tmp_path):
    # Resuming from its checkpoints is the self-healing tests' (below), which end bit for bit as one run.
    log = tmp_path / "log"
    job = start_launch(2, *RUN, f"output_dir={tmp_path}", "train.collective_timeout_s=30", log=log,
                       env=FRESH_LAUNCHER)  # its children are found with psutil
    wait_for(lambda: checkpoints(tmp_path), job, log)
    worker = psutil.Process(job.pid).children()[-1]
    worker.kill()  # SIGKILL: no handler, no checkpoint, like the OOM killer
    killed = time.monotonic()
    job.wait(timeout=60)
    assert job.returncode != 0 and time.monotonic() - killed < 60
    assert "exitcode  : -9" in log.read_text(), log.read_text()[-3000:]
    print(f"\nkilled worker, no restarts: the job ended {time.monotonic() - killed:.1f} s later")


# The documented self-healing launch lines (README "When things fail"), up to the accel-train arguments.
SELF_HEALING = {
    "accelerate launch --max_restarts 3": lambda: accelerate(
        "--config_file", PROFILES / "multi_gpu.yaml", "--num_processes", 2, "--main_process_port", free_port(),
        "--max_restarts", 3),
    "torchrun --max-restarts 3": lambda: torchrun("--nproc_per_node", 2, "--master_port", free_port(),
                                                  "--max-restarts", 3),
}


@pytest.mark.parametrize("launcher", SELF_HEALING)
def test_a_killed_worker_is_restarted_by_the_launcher_and_the_run_ends_as_if_never_interrupted(
        launcher, reference, tmp_path):
    log = tmp_path / "log"
    job = start([*SELF_HEALING[launcher](), *RUN, f"output_dir={tmp_path}", "resume=auto"], log, env=FRESH_LAUNCHER)
    wait_for(lambda: checkpoints(tmp_path), job, log)
    psutil.Process(job.pid).children()[-1].kill()  # SIGKILL, like the OOM killer; no one reruns anything
    killed = time.monotonic()
    wait_for(lambda: "restart 1 of at most 3 by the launcher" in log.read_text(), job, log)
    resumed_after = time.monotonic() - killed
    assert job.wait(timeout=240) == 0, log.read_text()[-3000:]
    starts = read_starts(tmp_path)
    assert [start["launcher_restart"] for start in starts] == [0, 1]
    assert starts[1]["step"] in {meta["step"] for _, meta in checkpoints(tmp_path)} | set(range(4, TOTAL_STEPS, 4))
    assert "restarts   1 by the launcher after a process failed" in log.read_text()
    assert_same_run(tmp_path, reference, WEIGHTS)
    print(f"\n{launcher}: worker killed; the restarted group was training again from step {starts[1]['step']} "
          f"{resumed_after:.1f} s later")


@pytest.mark.parametrize("damage, file", [("truncated", "model.safetensors"), ("garbled", "optimizer.bin")])
def test_a_damaged_newest_checkpoint_is_reported_in_one_line_and_the_previous_one_resumes(reference, tmp_path,
                                                                                          damage, file):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    (newest, _), (previous, previous_meta) = checkpoints(out)[-1], checkpoints(out)[-2]
    data = (newest / file).read_bytes()
    # truncated: the size differs from the one recorded; garbled: the same size, bytes that do not decode
    (newest / file).write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x17" * 32 + data[32:])
    result = launch(2, *RUN, f"output_dir={out}", "resume=auto")
    warnings = [line for line in result.stderr.splitlines() if "warning" in line and str(newest) in line]
    named = file  # the size check, or the content's (sha256) before anything reads it
    assert len(warnings) == 1 and "unusable" in warnings[0] and named in warnings[0], result.stderr
    assert f"resuming from {previous}: step {previous_meta['step']}" in result.stdout
    assert_same_run(out, reference, WEIGHTS)


@pytest.mark.floors
def test_a_library_error_while_loading_is_not_called_damage_and_stops_in_one_line_leaving_the_checkpoints(
        reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    before = checkpoints(out)
    result = launch(2, *RUN, f"output_dir={out}", "resume=auto", script=PROBE, env={"PROBE_LOAD_API_ERROR": "1"},
                    check=False)
    assert result.returncode != 0
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("accel-train: error:")]
    assert str(before[-1][0]) in error and "load_kwargs" in error and "not damage" in error, error
    assert "trying the previous one" not in result.stderr and "resuming from" not in result.stdout
    assert checkpoints(out) == before


@pytest.mark.parametrize("override, words", [
    ("model.name=resnet18", ["another run", "model.name=resnet18 (trained with mnist_cnn)"]),
    ("data.image_size=32", ["another run", "data.image_size=32 (trained with null)"]),
])
def test_a_checkpoint_of_another_model_is_refused_in_one_line(reference, tmp_path, override, words):
    out = shutil.copytree(reference, tmp_path / "run")
    newest = checkpoints(out)[-1][0]
    result = run_cli(*RUN, f"output_dir={out}", f"resume={newest}", override, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("accel-train: error:")]
    assert all(word in error for word in words), error


# In one process: resume=PATH, a save cut short and the steps-per-epoch refusal need no second process.
# 3 steps per epoch: the checkpoints of steps 2 and 4 are mid-epoch.
SMALL = ["mnist_cnn", "data.synthetic=true", "data.train_subset=36", "data.eval_subset=10", "train.batch_size=12",
         "train.max_steps=4", "train.log_every_steps=1", "checkpoint.every_steps=2", "checkpoint.keep_last=5",
         "train.plot=false"]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("small") / "run"
    train_in_process(*SMALL, f"output_dir={out}")
    return out


def test_resume_path_continues_from_that_checkpoint_of_its_own_folder_as_if_never_interrupted(small_run, tmp_path,
                                                                                              capsys):
    # A copy of the run: resume=PATH takes the older checkpoint of step 2 (mid-epoch), not the newest (step 4); the
    # copy's weights file goes, so the resumed run must write its own.
    out = shutil.copytree(small_run, tmp_path / "run")
    (out / "model.safetensors").unlink()
    step_2 = out / "checkpoints" / "step-00000002"
    before = metrics_lines_before(out, 2)
    train_in_process(*SMALL, f"output_dir={out}", f"resume={step_2}")
    assert f"resuming from {step_2}: step 2" in capsys.readouterr().out
    assert_resumed_from(out, 2, before)
    assert [line["step"] for line in read_metrics(out, "train")] == [1, 2, 3, 4]
    assert metrics_without_timing(out) == metrics_without_timing(small_run)
    assert_same_weights(out, small_run)


def test_a_save_cut_short_is_ignored_with_a_warning_then_removed_by_the_next_save(small_run, tmp_path, capsys):
    out = shutil.copytree(small_run, tmp_path / "run")
    cut_short = out / "checkpoints" / ".partial-step-00000005"
    cut_short.mkdir()
    (cut_short / "model.safetensors").write_bytes(b"half a file")
    train_in_process(*SMALL, f"output_dir={out}", "resume=auto", "train.max_steps=6")
    captured = capsys.readouterr()
    assert f"accel-train: warning: ignoring {cut_short}: a save that did not complete" in captured.err
    assert "resuming from" in captured.out and "step-00000004: step 4" in captured.out
    assert not cut_short.exists() and {meta["step"] for _, meta in checkpoints(out)} == {2, 3, 4, 6}  # 3: epoch end


def test_a_checkpoint_of_other_steps_per_epoch_is_refused_naming_what_changed(small_run, tmp_path):
    from accel_train.errors import UserError

    out = shutil.copytree(small_run, tmp_path / "run")
    with pytest.raises(UserError, match=r"has 3 steps per epoch, this run 4; train.batch_size or data.train_subset"):
        train_in_process(*SMALL, f"output_dir={out}", "data.train_subset=48",
                         f"resume={out / 'checkpoints' / 'step-00000002'}")


def test_the_exported_model_loads_into_the_plain_model_without_accelerate(reference):
    code = ("import sys\nfrom safetensors.torch import load_file\nfrom accel_train.workloads.models import MnistCNN\n"
            f"MnistCNN(10, (1, 28, 28)).load_state_dict(load_file({str(reference / 'model.safetensors')!r}))\n"
            "print('accelerate loaded' if 'accelerate' in sys.modules else 'plain')")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "plain"


def test_retention_keeps_the_newest_n_and_the_earliest_best():
    def saved(serial, metrics=None):
        return Path(f"c{serial}"), {"serial": serial, "metrics": metrics or {}}

    history = [saved(1), saved(2, {"accuracy": 0.5}), saved(3), saved(4, {"accuracy": 0.7}),
               saved(5, {"accuracy": 0.7}), saved(6), saved(7, {"accuracy": 0.6}), saved(8)]
    assert to_keep(history, 2, None, "max") == {Path("c7"), Path("c8")}
    assert to_keep(history, 2, "accuracy", "max") == {Path("c4"), Path("c7"), Path("c8")}
    assert to_keep(history, 1, "accuracy", "min") == {Path("c2"), Path("c8")}
    assert to_keep(history, 3, "loss", "min") == {Path("c6"), Path("c7"), Path("c8")}  # never reported: newest only


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_loading_a_checkpoint_never_runs_code_from_it(reference, tmp_path):
    from accelerate import Accelerator

    from accel_train.config import TrainConfig
    from accel_train.run.resume import load_checkpoint
    from accel_train.training.optim import build_optimizer, build_scheduler
    from accel_train.workloads.models import MnistCNN

    folder = shutil.copytree(checkpoints(reference)[-1][0], tmp_path / "checkpoint")
    marker = tmp_path / "code-ran"
    torch.save({"state": _RunsCode(marker)}, folder / "optimizer.bin")  # a pickle that calls a function on load
    accelerator = Accelerator(cpu=True)
    model = MnistCNN(10, (1, 28, 28))
    optimizer = build_optimizer(TrainConfig(), model)
    accelerator.prepare(model, optimizer, build_scheduler(TrainConfig(), optimizer, STEPS_PER_EPOCH))
    damage, error = load_checkpoint(accelerator, folder, read_meta(folder))
    # Refused, and not taken for damage: the file is whole, it names a function the unpickler does not allow.
    assert damage is None and error is not None and "a file holds a call to getattr" in error, (damage, error)
    assert not marker.exists()
