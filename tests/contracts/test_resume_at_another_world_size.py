"""Contracts of a resume at another world size: a checkpoint saved by 2 processes continues at 3 and at 1.

A run is a function of its config, not of its machines: the data order is a function of (seed, epoch), the
batch is global and the LR schedule counts optimizer steps, so a run stopped in the middle of an epoch and
continued at another world size trains the same global batches at the same LRs as the uninterrupted run, and
its weights and metrics.jsonl lines agree within the tolerance of the N x B contract (float reduction order).
The model has neither dropout nor BatchNorm (the per-process parts that cannot be the same across world sizes).
train.micro_batch_size=4 makes the accumulation steps differ at every world size (3 at 2 processes, 2 at 3,
6 at 1); train lines every 4 steps put the stop (after the checkpoint of step 5) in the middle of a line, so
the first line after the resume averages steps of the old processes and of the new ones; and Accelerate counted
3 micro-batches into the epoch, a count the new accumulation steps (2, 6) do not divide.
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from accel_train.run.layout import read_starts
from accel_train.run.summaries import TIMING
from support.commands import PYTHON, command_env, launch
from support.locations import PROBE, REPO
from support.runs import metrics_lines_before, newest_checkpoint_step, read_metrics

STOP_STEP, TOTAL_STEPS, MICRO_BATCH = 5, 12, 4  # 4 steps per epoch: step 5 is 1 into epoch 1
RUN = ["train", "mnist_cnn", "data.synthetic=true", "data.train_subset=96", "data.eval_subset=50",
       "model.dropout=false", "train.batch_size=24", f"train.micro_batch_size={MICRO_BATCH}", "train.epochs=3",
       "train.schedule=cosine", "train.warmup_steps=2", "train.log_every_steps=4", "checkpoint.every_steps=5",
       "checkpoint.keep_last=5", "train.plot=false"]


def probe_run(root, name: str, processes: int, *args: str, env: dict | None = None, check: bool = True):
    out, records = root / name, root / f"{name}-records"
    result = launch(processes, *RUN, f"output_dir={out}", *args, script=PROBE, check=check, timeout=240,
                    env={"PROBE_DIR": str(records), **(env or {})})
    return out, records, result


def ranks(records, processes: int) -> list[dict]:
    return [json.loads((records / f"rank{rank}.json").read_text()) for rank in range(processes)]


def global_batches(records, processes: int) -> list[list[int]]:
    """The sample ids of each optimizer step: every process's micro-batches of that step, together."""
    per_rank = [rank["batches"] for rank in ranks(records, processes)]
    accumulation = 24 // processes // MICRO_BATCH
    steps = len(per_rank[0]) // accumulation
    return [sorted(index for batches in per_rank for batch in batches[step * accumulation:(step + 1) * accumulation]
                   for index in batch) for step in range(steps)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted 2-process run; one stopped by a crash right after the checkpoint of step 5, continued at 3
    processes and, from a copy, at 1: {name: (output_dir, records, result)}."""
    root = tmp_path_factory.mktemp("world_size")
    found = {"uninterrupted": probe_run(root, "uninterrupted", 2)}
    crashed = probe_run(root, "stopped", 2, env={"PROBE_CRASH_AFTER_SAVE": str(STOP_STEP)}, check=False)
    assert crashed[2].returncode != 0 and newest_checkpoint_step(crashed[0]) == STOP_STEP, crashed[2].stderr[-3000:]
    shutil.copytree(crashed[0], root / "at1")
    found["before"] = metrics_lines_before(crashed[0], STOP_STEP)
    found[3] = probe_run(root, "stopped", 3, "resume=auto")
    found[1] = probe_run(root, "at1", 1, "resume=auto")
    return found


@pytest.mark.parametrize("processes", [3, 1])
def test_a_resume_at_another_world_size_trains_the_same_global_batches_at_the_same_lr(runs, processes):
    reference = global_batches(runs["uninterrupted"][1], 2)
    resumed = global_batches(runs[processes][1], processes)
    assert len(reference) == TOTAL_STEPS and all(len(batch) == 24 for batch in reference + resumed)
    assert resumed == reference[STOP_STEP:], f"{processes} processes: other samples than the uninterrupted run"
    lrs = [rank["step_lr"] for rank in ranks(runs[processes][1], processes)]
    reference_lr = ranks(runs["uninterrupted"][1], 2)[0]["step_lr"]
    assert [step for step, _ in reference_lr] == list(range(1, TOTAL_STEPS + 1))
    for lr in lrs:  # every process, every step
        assert lr == reference_lr[STOP_STEP:], f"{processes} processes: another LR than the uninterrupted run"


@pytest.mark.parametrize("processes", [3, 1])
def test_a_resume_at_another_world_size_ends_with_the_weights_and_metrics_of_the_uninterrupted_run(runs, processes):
    out, reference = runs[processes][0], runs["uninterrupted"][0]
    resumed_weights, weights = (load_file(str(folder / "model.safetensors")) for folder in (out, reference))
    for name, tensor in weights.items():
        relative = (resumed_weights[name] - tensor).norm() / tensor.norm()
        assert relative <= 1e-5, f"{name}: resumed at {processes} differs by {relative:.2e} (relative)"
    resumed_lines, reference_lines = ([{k: v for k, v in line.items() if k not in TIMING}
                                       for split in ("train", "test") for line in read_metrics(folder, split)]
                                      for folder in (out, reference))
    assert [line["step"] for line in resumed_lines] == [line["step"] for line in reference_lines] == \
        [4, 8, 12, 4, 8, 12]
    for ours, theirs in zip(resumed_lines, reference_lines):
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            assert ours[key] == (pytest.approx(value, rel=1e-5, abs=1e-7) if isinstance(value, float) else value), \
                f"{processes} processes: step {theirs['step']} {theirs['split']} {key}"
    # The lines up to the stop are the stopped run's own, kept as they were written.
    assert (out / "metrics.jsonl").read_text().startswith("".join(runs["before"]))


@pytest.mark.parametrize("processes", [3, 1])
def test_a_resume_at_another_world_size_says_both_world_sizes_and_records_them(runs, processes):
    out, _, result = runs[processes]
    said = f"resumed at {processes} process(es) from a checkpoint of 2"
    assert any(line.startswith("training mnist_cnn") and said in line for line in result.stdout.splitlines()), \
        result.stdout[:2000]
    summary = result.stdout.split("\ndone: ")[-1]
    assert f"resumed    at {processes} process(es) from a checkpoint of 2, at step {STOP_STEP}" in summary, summary
    starts = read_starts(out)
    assert [(start["world_size"], start["checkpoint_world_size"], start["step"]) for start in starts] == \
        [(2, None, 0), (processes, 2, STOP_STEP)]


def test_the_documented_proof_resumes_a_run_stopped_at_2_processes_at_3_and_at_1_like_the_uninterrupted_run(
        tmp_path):
    """examples/resume_at_another_world_size.sh, as docs/checkpoints.md gives it, on synthetic data of
    Fashion-MNIST's shape (30 steps per epoch, 2 epochs; SIGTERM once step 15 is logged). Float reduction order
    compounds over the tens of steps after the resume: uninterrupted runs at 2 and at 3 processes differ by about
    1e-3 (relative) here too, against 0.1 and more for a resume that trains other batches."""
    result = subprocess.run(
        ["bash", "examples/resume_at_another_world_size.sh", str(tmp_path / "proof"), "data.synthetic=true",
         "data.train_subset=2880", "data.eval_subset=96", "train.log_every_steps=1"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env=command_env({"STOP_AFTER_STEP": "15", "PATH": f"{Path(PYTHON).parent}:{os.environ['PATH']}"}))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = re.findall(r"^2 -> (\d) processes \(resumed at step (\d+)\): weights differ by (\S+) \(relative, whole "
                       r"model; (\S+) in the worst tensor\); train losses by at most (\S+) over (\d+) lines",
                       result.stdout, re.MULTILINE)
    assert [processes for processes, *_ in found] == ["3", "1"], result.stdout[-3000:]
    print(f"\n{chr(10).join(line for line in result.stdout.splitlines() if line.startswith('2 -> '))}")
    for processes, step, whole, worst, losses, lines in found:
        assert 15 < int(step) < 60 and int(lines) == 60, (processes, step, lines)  # stopped before the end
        assert float(whole) <= 2e-3 and float(losses) <= 1e-4, (processes, whole, worst, losses)
