"""Contracts of a resume at another world size: a checkpoint saved by 2 processes continues at 3 and at 1.

A run is a function of its config, not of its machines: the data order is a function of (seed, epoch), the
batch is global and the LR schedule counts optimizer steps, so a run stopped in the middle of an epoch and
continued at another world size trains the same global batches at the same LRs as the uninterrupted run, and
its weights and metrics.jsonl lines agree within the tolerance of the N x B contract (float reduction order), at
fp32 on the CPU (docs/contracts.md gives the tolerances at other precisions and on GPUs).

The runs are those of the documented proof, examples/resume_at_another_world_size.sh (docs/checkpoints.md), run
once with overrides and its runs launched through tests/launched_probe.py (LAUNCH_TARGET), whose recorders write
what each process read and applied per run (PROBE_DIR_PER_RUN): uninterrupted at 2 processes; stopped at 2 by the
script's SIGTERM to the launcher once step 4's line is written, which every process waits for after step 5
(PROBE_WAIT_FOR_SIGNAL) and agrees on at that step's evaluation (train.eval_every_steps=5; step 4 is no evaluation,
so no agreement comes between), so the stop falls at a known step; continued at 3 and, from a copy, at 1. The model
has dropout (keyed by sample: the same masks at any world size) and no BatchNorm (per-process statistics).
train.micro_batch_size=4 makes the accumulation steps differ at every world size (3 at 2 processes, 2 at 3, 6 at 1);
train lines every 4 steps put the stop (step 5 of the 6 of epoch 0) in the middle of a line, so the first line after
the resume averages steps of the old processes and of the new ones; and Accelerate counted 15 micro-batches into the
epoch, a count the new accumulation steps (2, 6) do not divide.
"""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from accel_train.run.layout import read_starts
from accel_train.run.summaries import TIMING
from support.commands import PYTHON, command_env
from support.locations import PROBE, REPO
from support.runs import lines_before, read_metrics

SCRIPT = "examples/resume_at_another_world_size.sh"
STOP_STEP, TOTAL_STEPS, MICRO_BATCH = 5, 12, 4  # 6 steps per epoch: step 5 is mid-epoch 0
OVERRIDES = ["data.synthetic=true", "data.train_subset=144", "data.eval_subset=50", "train.batch_size=24",
             f"train.micro_batch_size={MICRO_BATCH}", "train.epochs=2", "train.schedule=cosine", "train.warmup_steps=2",
             "train.log_every_steps=4", f"train.eval_every_steps={STOP_STEP}", f"checkpoint.every_steps={STOP_STEP}",
             "checkpoint.keep_last=5"]


@pytest.fixture(scope="module")
def proof(tmp_path_factory):
    """The script's output folders and the probe's records, each by run: {"uninterrupted" | 3 | 1: (output_dir,
    records)}, and "result": the script's CompletedProcess."""
    root = tmp_path_factory.mktemp("world_size")
    runs, records = root / "proof", root / "records"
    result = subprocess.run(
        ["bash", SCRIPT, str(runs), *OVERRIDES], cwd=REPO, capture_output=True, text=True, timeout=600,
        env=command_env({"LAUNCH_TARGET": PROBE, "STOP_AFTER_STEP": "4", "PROBE_DIR": str(records),
                         "PROBE_DIR_PER_RUN": "1", "PROBE_WAIT_FOR_SIGNAL": f"stopped:{STOP_STEP}",
                         "PATH": f"{Path(PYTHON).parent}:{os.environ['PATH']}"}))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = {"result": result}
    for key, name in (("uninterrupted", "uninterrupted"), (3, "stopped"), (1, "stopped_then_1")):
        found[key] = (runs / name, records / name)
    return found


def ranks(records, processes: int) -> list[dict]:
    return [json.loads((records / f"rank{rank}.json").read_text()) for rank in range(processes)]


def global_batches(records, processes: int) -> list[list[int]]:
    """The sample ids of each optimizer step: every process's micro-batches of that step, together."""
    per_rank = [rank["batches"] for rank in ranks(records, processes)]
    accumulation = 24 // processes // MICRO_BATCH
    steps = len(per_rank[0]) // accumulation
    return [sorted(index for batches in per_rank for batch in batches[step * accumulation:(step + 1) * accumulation]
                   for index in batch) for step in range(steps)]


@pytest.mark.parametrize("processes", [3, 1])
def test_a_resume_at_another_world_size_trains_the_same_global_batches_at_the_same_lr(proof, processes):
    reference = global_batches(proof["uninterrupted"][1], 2)
    resumed = global_batches(proof[processes][1], processes)
    assert len(reference) == TOTAL_STEPS and all(len(batch) == 24 for batch in reference + resumed)
    assert resumed == reference[STOP_STEP:], f"{processes} processes: other samples than the uninterrupted run"
    lrs = [rank["step_lr"] for rank in ranks(proof[processes][1], processes)]
    reference_lr = ranks(proof["uninterrupted"][1], 2)[0]["step_lr"]
    assert [step for step, _ in reference_lr] == list(range(1, TOTAL_STEPS + 1))
    for lr in lrs:  # every process, every step
        assert lr == reference_lr[STOP_STEP:], f"{processes} processes: another LR than the uninterrupted run"


@pytest.mark.parametrize("processes", [3, 1])
def test_a_resume_at_another_world_size_ends_with_the_weights_and_metrics_of_the_uninterrupted_run(proof, processes):
    (out, records), reference = proof[processes], proof["uninterrupted"][0]
    resumed_weights, weights = (load_file(str(folder / "model.safetensors")) for folder in (out, reference))
    for name, tensor in weights.items():
        relative = (resumed_weights[name] - tensor).norm() / tensor.norm()
        assert relative <= 1e-5, f"{name}: resumed at {processes} differs by {relative:.2e} (relative)"
    resumed_lines, reference_lines = ([{k: v for k, v in line.items() if k not in TIMING}
                                       for split in ("train", "test") for line in read_metrics(folder, split)]
                                      for folder in (out, reference))
    assert [line["step"] for line in resumed_lines] == [line["step"] for line in reference_lines] == \
        [4, 8, 12, 5, 6, 10, 12]  # train lines, then evaluations (every 5 steps and each epoch's end)
    for ours, theirs in zip(resumed_lines, reference_lines):
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            assert ours[key] == (pytest.approx(value, rel=1e-5, abs=1e-7) if isinstance(value, float) else value), \
                f"{processes} processes: step {theirs['step']} {theirs['split']} {key}"
    # The lines up to the stop are the stopped run's own, kept as they were written (the probe read them at start).
    before = lines_before(ranks(records, processes)[0]["metrics_at_start"], STOP_STEP)
    assert before and (out / "metrics.jsonl").read_text().startswith("".join(before))


@pytest.mark.parametrize("processes", [3, 1])
def test_a_resume_at_another_world_size_says_both_world_sizes_and_records_them(proof, processes):
    out, stdout = proof[processes][0], proof["result"].stdout
    said = f"{processes} process(es), resumed from a checkpoint of 2 process(es)"
    started = [line for line in stdout.splitlines() if line.startswith("training mnist_cnn on fashion_mnist")]
    assert any(said in line for line in started), stdout[-5000:]
    summaries = stdout.split("\ndone: ")[1:]
    assert any(f"resumed    at {processes} process(es) from a checkpoint of 2, at step {STOP_STEP}" in summary
               for summary in summaries), stdout[-5000:]
    starts = read_starts(out)
    assert [(start["world_size"], start["checkpoint_world_size"], start["step"]) for start in starts] == \
        [(2, None, 0), (processes, 2, STOP_STEP)]


def test_the_documented_proof_resumes_a_run_stopped_at_2_processes_at_3_and_at_1_like_the_uninterrupted_run(proof):
    """examples/resume_at_another_world_size.sh, as docs/checkpoints.md gives it (here with the overrides above and
    the probe as its launch target): it stops the run at 2 processes with SIGTERM to the launcher once a line is
    logged (every process saves the step it stops at), continues it at 3 and at 1, and prints one comparison line
    each with the uninterrupted run."""
    stdout = proof["result"].stdout
    assert "stopped by SIGTERM at step 5; checkpoint saved" in stdout + proof["result"].stderr
    found = re.findall(r"^2 -> (\d) processes \(resumed at step (\d+)\): weights differ by (\S+) \(relative, whole "
                       r"model; (\S+) in the worst tensor\); train losses by at most (\S+) over (\d+) lines",
                       stdout, re.MULTILINE)
    assert [processes for processes, *_ in found] == ["3", "1"], stdout[-3000:]
    print(f"\n{chr(10).join(line for line in stdout.splitlines() if line.startswith('2 -> '))}")
    for processes, step, whole, worst, losses, lines in found:
        assert int(step) == STOP_STEP and int(lines) == TOTAL_STEPS // 4, (processes, step, lines)
        assert float(whole) <= 1e-5 and float(worst) <= 1e-5 and float(losses) <= 1e-5, \
            (processes, whole, worst, losses)
