"""Contracts of running out of device memory while training: with train.micro_batch_size=auto every process
halves the micro-batch and redoes the step from the same samples, the same global batch; where that cannot help, the
run stops in one line. On CPU, the faults of tests/support/faults.py (PROBE_OOM_AT, PROBE_EVAL_OOM in the launched
probe) raise torch's out-of-memory error where a device would have run out."""

import json
import time
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file

from accel_train import hooks
from accel_train.run.checkpoint_files import list_checkpoints
from accel_train.run.layout import read_micro_batch_changes, read_starts
from accel_train.run.summaries import summarize
from support.commands import evaluate_in_process, launch, train_in_process
from support.faults import OutOfMemoryAt
from support.locations import PROBE
from support.runs import assert_same_run, crash_after_checkpoint_then_resume, read_metrics

# 72 samples, a global batch of 24: 3 optimizer steps an epoch, 6 in all; 101 test samples in eval batches of 50.
# SGD without clipping: a gradient off by a factor (a chunk's loss not weighted by its share) moves the weights by as
# much, where Adam and clipping would hide it.
RUN = ["mnist_cnn", "data.synthetic=true", "data.train_subset=72", "data.eval_subset=101", "model.dropout=false",
       "train.batch_size=24", "train.eval_batch_size=50", "train.epochs=2", "train.log_every_steps=1",
       "train.optimizer=sgd", "train.lr=0.05", "train.plot=false"]
RAN_OUT_TRAINING = "ran out of cpu memory at step"


def test_one_process_running_out_makes_every_process_redo_the_step_with_half_the_micro_batch(tmp_path):
    """2 processes of 12 samples a step, micro_batch_size=auto (12 fits the search): from step 3 on, process 1 runs out
    with more than 6 samples a pass, and process 0 with more than 12 samples an evaluation pass."""
    out, reference = tmp_path / "run", tmp_path / "reference"
    started = time.monotonic()
    # collective_timeout_s: a process left waiting for another fails the run in 20 s instead of hanging
    result = launch(2, "train", *RUN, "train.micro_batch_size=auto", "checkpoint.every_steps=2",
                    "train.collective_timeout_s=20", f"output_dir={out}", script=PROBE,
                    env={"PROBE_OOM_AT": "3:1:6", "PROBE_EVAL_OOM": "0:12"}, timeout=180)
    assert time.monotonic() - started < 120
    warnings = [line for line in result.stderr.splitlines() if "ran out of cpu memory" in line]
    assert warnings == [
        "accel-train: warning: process 1 ran out of cpu memory at step 3 with 12 sample(s) per micro-batch; continuing "
        "with 6 (train.accumulation_steps 1 -> 2, the same global batch)",
        "accel-train: warning: process 0 ran out of cpu memory evaluating 25 sample(s) per process at once; evaluating "
        "12 at a time from now on (the same metrics)"], result.stderr[-3000:]
    # recorded: the start's micro-batch and the halving in starts.jsonl, the summary, the checkpoints after it
    assert [start["micro_batch_size"] for start in read_starts(out)] == [12]
    change = {"step": 3, "from": 12, "to": 6, "processes": [1]}
    assert [{key: line[key] for key in change} for line in read_micro_batch_changes(out)] == [change]
    assert summarize(out)["micro_batch_changes"] == [change]
    assert "memory     process 1 ran out of memory at step 3: 12 -> 6 samples per micro-batch" in result.stdout
    saved = {meta["step"]: meta["config"]["train"] for _, meta in list_checkpoints(out / "checkpoints")}
    assert {step: (train["micro_batch_size"], train["accumulation_steps"]) for step, train in saved.items()} == {
        4: (6, 2), 6: (6, 2)}
    # the same optimization as 6 samples a pass from the start (1 process, accumulation 4), within N x B's tolerance
    train_in_process(*RUN, "train.micro_batch_size=6", f"output_dir={reference}")
    ours, theirs = (load_file(str(folder / "model.safetensors")) for folder in (out, reference))
    for name, weights in theirs.items():
        assert (ours[name] - weights).norm() / weights.norm() <= 1e-5, name
    losses = [[line["loss"] for line in read_metrics(folder, "train")] for folder in (out, reference)]
    assert len(losses[0]) == 6 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    # evaluation in smaller chunks: the metrics of the same weights evaluated whole, by one process
    final = read_metrics(out, "test")[-1]
    whole = evaluate_in_process(str(out), out / "model.safetensors")
    assert final["num_samples"] == whole["num_samples"] == 101 and final["correct"] == whole["correct"]
    assert final["loss"] == pytest.approx(whole["loss"], rel=1e-6)


def test_a_resume_continues_with_the_halved_micro_batch_and_equals_the_uninterrupted_run(tmp_path, capsys):
    # 2 epochs of 3 steps of 12 samples, as RUN's of 24 (the search and the halving are the same at any size)
    run = [*RUN, "data.train_subset=36", "data.eval_subset=20", "train.batch_size=12", "train.micro_batch_size=auto",
           "checkpoint.every_steps=2"]
    with hooks.added(OutOfMemoryAt(3, 0, 6)):  # 1 process of 12 samples a step; from step 3 on, more than 6 run out
        train_in_process(*run, f"output_dir={tmp_path / 'reference'}")
        crash_after_checkpoint_then_resume(4, *run, f"output_dir={tmp_path / 'resumed'}")
    assert_same_run(tmp_path / "resumed", tmp_path / "reference")
    captured = capsys.readouterr()
    assert captured.err.count(RAN_OUT_TRAINING) == 2  # the reference and the run that crashed; not the resumed one
    assert "6 samples per process per forward pass (in chunks of the 12 loaded), as the checkpoint ran" in captured.out
    assert [start["micro_batch_size"] for start in read_starts(tmp_path / "resumed")] == [12, 6]


@contextmanager
def optimizer_runs_out():
    """Every optimizer step raises the device's out-of-memory error (torch's own global hook before a step)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def out_of_memory(optimizer, args, kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    handle = register_optimizer_step_pre_hook(out_of_memory)
    try:
        yield
    finally:
        handle.remove()


@pytest.mark.parametrize("overrides, fault, words", [
    # a fixed micro-batch keeps stopping, now in one line that names the setting which would have gone on
    (["train.micro_batch_size=6"], lambda: hooks.added(OutOfMemoryAt(2, 0, 3)),
     ["ran out of cpu memory with 6 sample(s) per micro-batch", "set train.micro_batch_size=auto"]),
    # auto, with no size small enough: 24, 12, 6, 3 and 1 sample(s) a pass all run out at step 2
    (["train.micro_batch_size=auto"], lambda: hooks.added(OutOfMemoryAt(2, 0)),
     ["the process ran out of cpu memory at step 2 with 1 sample(s) per micro-batch, the smallest"]),
    # the optimizer step: its state does not depend on the micro-batch
    (["train.micro_batch_size=auto"], optimizer_runs_out,
     ["ran out of cpu memory in the optimizer step, which a smaller micro-batch does not help"]),
], ids=["fixed micro-batch", "auto below 1", "optimizer step"])
def test_running_out_where_a_smaller_micro_batch_is_not_taken_or_does_not_help_stops_in_one_line(
        tmp_path, capsys, overrides, fault, words):
    from accel_train import cli

    with pytest.raises(SystemExit) as stop, fault():
        cli.main(["train", *RUN, "train.max_steps=3", *overrides, f"output_dir={tmp_path}"])
    stderr = capsys.readouterr().err
    assert stop.value.code == 2, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("accel-train: error:")]
    assert len(errors) == 1 and stderr.rstrip().endswith(errors[0]) and "Traceback" not in stderr, stderr
    assert all(word in errors[0] for word in words), errors[0]
    halvings = [json.loads(line) for line in (tmp_path / "starts.jsonl").read_text().splitlines()[1:]]
    assert [(line["from"], line["to"]) for line in halvings] == ([(24, 12), (12, 6), (6, 3), (3, 1)]
                                                                 if "smallest" in words[0] else [])
