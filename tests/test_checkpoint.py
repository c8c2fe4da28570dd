"""Contracts of checkpoints and resume, with 2 processes through the shipped multi_gpu profile (gloo on CPU).

One uninterrupted run is the reference. A run stopped in any way (a crash right after a checkpoint at an
epoch boundary or mid-epoch, SIGTERM, a killed worker, a damaged newest checkpoint) and continued with
resume=auto must reproduce its metrics.jsonl line for line (samples_per_s aside) and its final weights, and
the EMA of the weights, bit for bit. Dropout, random crop/flip, MixUp/CutMix and the EMA stay on, so the
restored RNG state has to give the same masks, the resumed epoch the same crops and mixes, and the restored
average the same weights; train lines every 3 steps and checkpoints every 4 put most resume points in
the middle of a line's steps, so the restored partial sums have to give the same averages.
"""

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
from test_launch_paths import accelerate, torchrun

from accel_train.checkpoint import list_checkpoints, to_keep
from accel_train.runs import read_starts
from conftest import (
    PROBE,
    PROFILES,
    PYTHON,
    REPO,
    assert_same_run,
    free_port,
    launch,
    read_metrics,
    run_cli,
    start,
    start_launch,
)

STEPS_PER_EPOCH, TOTAL_STEPS = 10, 30
WEIGHTS = ("model.safetensors", "model_ema.safetensors")
RUN = ["train", "mnist_cnn", "data.synthetic=true", "data.augment=true", "data.train_subset=240", "data.eval_subset=50",
       "train.batch_size=24", "train.epochs=3", "train.log_every_steps=3", "train.ema_decay=0.9",
       "train.mixup_alpha=0.4", "train.cutmix_alpha=1.0",
       "checkpoint.every_steps=4", "checkpoint.keep_last=2", "checkpoint.best_metric=accuracy"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    launch(2, *RUN, f"output_dir={out}")
    return out


def checkpoints(out: Path) -> list[tuple[Path, dict]]:
    return list_checkpoints(out / "checkpoints")


def wait_for(condition, process: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"exited {process.returncode} too early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out:\n{log.read_text()[-3000:]}"
        time.sleep(0.02)


def test_checkpoints_keep_the_newest_and_the_best_and_describe_themselves(reference):
    kept = {meta["step"]: (folder, meta) for folder, meta in checkpoints(reference)}
    evals = read_metrics(reference, "test")
    best = max(evals, key=lambda line: line["accuracy"])["step"]  # the earliest of equals
    # 9 saves (every 4 steps and at each epoch end); the newest 2 remain, plus the best evaluated one
    assert set(kept) == {28, 30, best}
    assert not list((reference / "checkpoints").glob(".*")), "no partial folder is left behind"
    folder, meta = kept[30]
    assert (meta["epoch"], meta["batches_done_in_epoch"], meta["evaluated"], meta["world_size"]) == (2, 10, True, 2)
    assert meta["metrics"] == {k: v for k, v in evals[-1].items() if k not in ("split", "epoch", "step", "elapsed_s")}
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


def test_sigterm_to_a_single_process_exits_75_after_saving(tmp_path):
    log = tmp_path / "log"
    job = start([PYTHON, "-m", "accel_train", *RUN, f"output_dir={tmp_path}"], log)
    wait_for(lambda: (tmp_path / "metrics.jsonl").is_file() and read_metrics(tmp_path, "train"), job, log)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 75, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text()
    assert checkpoints(tmp_path)[-1][1]["step"] < TOTAL_STEPS


def test_a_killed_worker_fails_the_job_within_60_s_and_earlier_checkpoints_resume_exactly(reference, tmp_path):
    log = tmp_path / "log"
    job = start_launch(2, *RUN, f"output_dir={tmp_path}", "train.collective_timeout_s=30", log=log)
    wait_for(lambda: checkpoints(tmp_path), job, log)
    worker = psutil.Process(job.pid).children()[-1]
    worker.kill()  # SIGKILL: no handler, no checkpoint, like the OOM killer
    killed = time.monotonic()
    job.wait(timeout=60)
    assert job.returncode != 0 and time.monotonic() - killed < 60
    print(f"\nkilled worker, no restarts: the job ended {time.monotonic() - killed:.1f} s later")
    launch(2, *RUN, f"output_dir={tmp_path}", "resume=auto")
    assert_same_run(tmp_path, reference, WEIGHTS)


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
    job = start([*SELF_HEALING[launcher](), *RUN, f"output_dir={tmp_path}", "resume=auto"], log)
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
    named = file if damage == "truncated" else "UnpicklingError"  # the size check, or the unpickler's error
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
    ("model.name=resnet18", ["another run", "model.name=mnist_cnn", "model.name=resnet18"]),
    ("data.image_size=32", ["does not fit", "classifier.1.weight", "shape"]),
])
def test_a_checkpoint_of_another_model_is_refused_in_one_line(reference, tmp_path, override, words):
    newest = checkpoints(reference)[-1][0]
    result = run_cli(*RUN, f"output_dir={tmp_path}", f"resume={newest}", override, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("accel-train: error:")]
    assert all(word in error for word in words), error


def test_the_exported_model_loads_into_the_plain_model_without_accelerate(reference):
    code = ("import sys\nfrom safetensors.torch import load_file\nfrom accel_train.models import MnistCNN\n"
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

    from accel_train.checkpoint import _load
    from accel_train.config import TrainConfig
    from accel_train.models import MnistCNN
    from accel_train.optim import build_optimizer, build_scheduler

    folder = shutil.copytree(checkpoints(reference)[-1][0], tmp_path / "checkpoint")
    marker = tmp_path / "code-ran"
    torch.save({"state": _RunsCode(marker)}, folder / "optimizer.bin")  # a pickle that calls a function on load
    accelerator = Accelerator(cpu=True)
    model = MnistCNN(10, (1, 28, 28))
    optimizer = build_optimizer(TrainConfig(), model)
    accelerator.prepare(model, optimizer, build_scheduler(TrainConfig(), optimizer, STEPS_PER_EPOCH))
    damage, error = _load(accelerator, folder)
    # Refused, and not taken for damage: the file is whole, it names a function the unpickler does not allow.
    assert damage is None and error is not None and "UnpicklingError" in error, (damage, error)
    assert not marker.exists()
