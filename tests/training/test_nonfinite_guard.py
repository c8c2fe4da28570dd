"""Contracts of the non-finite guard that every recipe shares: a NaN or inf on any process stops every process at
that step (exit 5) with nothing saved or evaluated past it, or with train.on_nonfinite=skip leaves that step's
weights untouched; and gradient clipping. Faults come from tests/support/faults.py (PROBE_NONFINITE in the launched
probe)."""

import math
import time

import pytest
import torch

from accel_train import hooks
from accel_train.run.checkpoint_files import list_checkpoints
from support.commands import launch, run_probe, train_in_process
from support.locations import PROBE
from support.runs import read_metrics

TERMS = {"loss", "reconstruction_loss", "kl"}
# 97 samples in batches of 20: a ragged last batch that splits evenly across neither 2 nor 3 processes
SYNTHETIC = ["data.synthetic=true", "data.train_subset=48", "data.eval_subset=97", "train.eval_batch_size=20",
             "model.hidden_size=32", "model.latent_size=4", "train.plot=false"]
TINY_RUN = [*SYNTHETIC, "train.batch_size=12", "train.log_every_steps=1"]


def saved_steps(out) -> list[int]:
    return [meta["step"] for _, meta in list_checkpoints(out / "checkpoints")]


def weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


# A checkpoint after every step: what was saved shows exactly where the run stopped.
EVERY_STEP = ["checkpoint.every_steps=1", "checkpoint.keep_last=10"]


def test_nonfinite_loss_on_one_process_stops_every_process_at_that_step(tmp_path):
    # Process 1's loss turns NaN before backward: the NaN crosses the gradient all-reduce, as in life.
    started = time.monotonic()
    result = launch(2, "train", "mnist_vae", f"output_dir={tmp_path}", *TINY_RUN, *EVERY_STEP, "train.epochs=3",
                    script=PROBE, env={"PROBE_NONFINITE": "3:1"}, timeout=120, check=False)
    assert time.monotonic() - started < 60, "the processes did not stop together"
    assert result.returncode != 0
    reports = [line for line in result.stderr.splitlines() if line.startswith("accel-train: error:")]
    assert len(reports) == 1, result.stderr[-3000:]
    assert "non-finite" in reports[0] and "at step 3" in reports[0]
    assert "process 1: loss=nan" in reports[0] and "process 0: loss=" in reports[0] and "kl=" in reports[0]
    train_lines = read_metrics(tmp_path, "train")
    assert [line["step"] for line in train_lines] == [1, 2]  # terms averaged over both processes, then the stop
    assert all(TERMS <= set(line) for line in train_lines)
    assert saved_steps(tmp_path) == [1, 2] and not (tmp_path / "model.safetensors").exists()


def test_a_nonfinite_loss_on_one_process_with_finite_gradients_stops_every_process_at_that_step(tmp_path):
    # Only process 1's loss value is NaN; its gradients stay finite, so the gradient all-reduce carries nothing
    # non-finite to process 0: it learns of the step through the guard's own reduction alone. Without that
    # reduction the processes disagree (one stops, the other trains on): collective_timeout_s bounds the wait.
    started = time.monotonic()
    result = launch(2, "train", "mnist_vae", f"output_dir={tmp_path}", *TINY_RUN, *EVERY_STEP,
                    "train.collective_timeout_s=20", script=PROBE, env={"PROBE_NONFINITE": "2:1:value"}, timeout=120,
                    check=False)
    assert time.monotonic() - started < 60, "the processes did not stop together"
    assert result.returncode != 0
    reports = [line for line in result.stderr.splitlines() if line.startswith("accel-train: error:")]
    assert len(reports) == 1, result.stderr[-3000:]
    assert "non-finite" in reports[0] and "at step 2" in reports[0], reports[0]
    process_1 = reports[0].split("process 1: ")[1]
    assert process_1.startswith("loss=nan") and "grad_norm=nan" not in process_1 and "grad_norm=inf" not in process_1
    assert [line["step"] for line in read_metrics(tmp_path, "train")] == [1]
    assert saved_steps(tmp_path) == [1] and not (tmp_path / "model.safetensors").exists()


def test_an_inf_gradient_with_a_finite_loss_stops_every_process_too(tmp_path):
    result = launch(2, "train", "mnist_cnn", f"output_dir={tmp_path}", *TINY_RUN, *EVERY_STEP, script=PROBE,
                    env={"PROBE_NONFINITE": "2:1:grad"}, timeout=120, check=False)
    assert result.returncode != 0
    (report,) = [line for line in result.stderr.splitlines() if line.startswith("accel-train: error:")]
    assert "at step 2" in report and "process 1: loss=" in report and "process 1: loss=nan" not in report
    assert "grad_norm=inf" in report or "grad_norm=nan" in report, report
    assert saved_steps(tmp_path) == [1] and not (tmp_path / "model.safetensors").exists()


def test_nonfinite_stop_exits_5_and_saves_nothing_after_the_step_before(tmp_path):
    result = run_probe("train", "mnist_cnn", f"output_dir={tmp_path}", *TINY_RUN, *EVERY_STEP,
                       env={"PROBE_NONFINITE": "2:0"}, check=False)
    assert result.returncode == 5, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("accel-train: error: non-finite loss or gradient norm at step 2")
    assert saved_steps(tmp_path) == [1] and not (tmp_path / "model.safetensors").exists()


# 4 steps, a train line at the last only: the non-finite step 2 falls between train lines, right before a
# checkpoint (a save every step) or an evaluation (every 2 steps), and only the guard's check there stops it.
@pytest.mark.parametrize("boundary", [["checkpoint.every_steps=1", "checkpoint.keep_last=10"],
                                      ["train.eval_every_steps=2", "checkpoint.at_epoch_end=false"]],
                         ids=["checkpoint", "evaluation"])
def test_a_nonfinite_step_between_train_lines_stops_the_run_before_the_next_checkpoint_or_evaluation(
        tmp_path, boundary):
    from accel_train import hooks
    from accel_train.errors import NonFiniteError
    from support.faults import NonFinite

    with pytest.raises(NonFiniteError) as stopped, hooks.added(NonFinite(2, 0)):  # the loss of step 2 in this process
        train_in_process("mnist_cnn", f"output_dir={tmp_path}", *SYNTHETIC, "train.batch_size=12", "train.max_steps=4",
                         "train.log_every_steps=100", *boundary)
    assert "at step 2" in str(stopped.value) and "every process stopped without applying" in str(stopped.value)
    assert saved_steps(tmp_path) == ([1] if "checkpoint.every_steps=1" in boundary else [])
    assert read_metrics(tmp_path, "test") == [] and not (tmp_path / "model.safetensors").exists()


def test_on_nonfinite_skip_leaves_the_weights_of_the_skipped_step_untouched_and_trains_on(tmp_path):
    result = run_probe("train", "mnist_vae", f"output_dir={tmp_path}", *TINY_RUN, *EVERY_STEP, "train.max_steps=3",
                       "train.on_nonfinite=skip", env={"PROBE_NONFINITE": "2:0"})
    assert result.stderr.count("step skipped on every process") == 1
    lines = {line["step"]: line for line in read_metrics(tmp_path, "train")}
    assert "loss" not in lines[2]  # a skipped step contributes nothing to the averages
    assert math.isfinite(lines[3]["loss"]) and (tmp_path / "model.safetensors").is_file()
    step = {meta["step"]: folder for folder, meta in list_checkpoints(tmp_path / "checkpoints")}
    before, skipped, after = (weights(step[n]) for n in (1, 2, 3))
    assert all(torch.equal(before[name], skipped[name]) for name in before)
    assert any(not torch.equal(skipped[name], after[name]) for name in before)


@pytest.mark.parametrize("variable, value", [("PROBE_NONFINITE", "2"), ("PROBE_CRASH_AFTER_SAVE", "two")])
def test_a_malformed_fault_injection_value_is_one_line_not_a_traceback(variable, value):
    result = run_probe("train", "mnist_cnn", "data.synthetic=true", env={variable: value}, check=False)
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert result.stderr.startswith(f"{variable}={value}: expected")


def test_clip_grad_norm_returns_the_norm_before_clipping_and_0_leaves_gradients_alone():
    from accelerate import Accelerator

    from accel_train.training.guard import clip_gradients

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 1, bias=False)
    for max_norm, expected_after in [(0.0, 10.0), (1.0, 1.0)]:
        model.weight.grad = torch.tensor([[6.0, 8.0, 0.0]])
        assert clip_gradients(accelerator, model, max_norm).item() == pytest.approx(10.0)
        assert model.weight.grad.norm().item() == pytest.approx(expected_after, rel=1e-5)


class EveryLossIsNaN(hooks.Hooks):
    """Every training forward pass's loss becomes NaN: a run that cannot apply one step."""

    def after_forward(self, phase, step, model, batch, outputs):
        return {**outputs, "loss": outputs["loss"] * math.nan} if phase == "train" else outputs


def test_on_nonfinite_skip_counts_the_skipped_steps_in_the_train_lines_and_the_summary(tmp_path, capsys):
    from support.faults import NonFinite

    with hooks.added(NonFinite(2, 0)):
        train_in_process("mnist_cnn", f"output_dir={tmp_path}", *TINY_RUN, "train.max_steps=3",
                         "train.on_nonfinite=skip")

    assert [line.get("skipped_steps", 0) for line in read_metrics(tmp_path, "train")] == [0, 1, 0]
    assert ("  skipped    1 of 3 steps, non-finite: no process applied them (train.on_nonfinite=skip; the warnings "
            "above name them)") in capsys.readouterr().out.splitlines()


def test_a_run_whose_every_step_was_skipped_as_nonfinite_exits_5_not_done(tmp_path):
    from accel_train.errors import NonFiniteError

    with pytest.raises(NonFiniteError) as stopped, hooks.added(EveryLossIsNaN()):
        train_in_process("mnist_cnn", f"output_dir={tmp_path}", *TINY_RUN, "train.max_steps=3",
                         "train.on_nonfinite=skip")

    assert stopped.value.exit_code == 5
    assert str(stopped.value) == ("every one of the run's 3 steps was skipped as non-finite (train.on_nonfinite=skip): "
                                  "no step changed the weights, which are still the initial ones. Lower train.lr, set "
                                  "train.clip_grad_norm, or look for NaN or inf in the data")
    assert not (tmp_path / "model.safetensors").exists()
