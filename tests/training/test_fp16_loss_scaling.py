"""Contracts of fp16 mixed precision's loss scaling: a step whose gradients overflow is skipped and counted, and
leaves the weights and the LR schedule where they were; a non-finite loss stops the run (or is skipped) as in fp32,
its gradients finite or not; gradients that overflow at every scale stop every process in one line (exit 5) instead
of halving the scale to nothing. fp16 runs here with the GradScaler Accelerate uses on a GPU, on CPU tensors
(tests/support/faults.Fp16OnCpu), in-process."""

import pytest
import torch
from accelerate.state import AcceleratorState

from accel_train import hooks
from accel_train.errors import NonFiniteError
from accel_train.run.checkpoint_files import list_checkpoints
from support.commands import train_in_process
from support.faults import Fp16OnCpu, NonFinite, OverflowFrom
from support.locations import USER_RECIPE
from support.runs import read_metrics

# 4 steps of 12 samples; a train line and a checkpoint after every step; the LR warms up over 4 steps. The model is
# the user recipe's two linear layers: the loss scaling is the same for any model, and mnist_cnn's convolutions in
# float16 take 0.1 s each on a CPU, which has no fast float16 kernels (5 s of this file's 6 s).
RUN = [USER_RECIPE, "data.synthetic=true", "data.train_subset=48", "data.eval_subset=12", "train.batch_size=12",
       "train.max_steps=4", "train.log_every_steps=1", "train.schedule=constant", "train.warmup_steps=4",
       "checkpoint.every_steps=1", "checkpoint.keep_last=10", "train.plot=false", "train.log_with=none"]


@pytest.fixture
def fp16():
    """A fresh AcceleratorState before and after: it keeps the mixed precision of the first Accelerator made."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def weights_at(out) -> dict[int, dict]:
    from safetensors.torch import load_file

    return {meta["step"]: load_file(str(folder / "model.safetensors"))
            for folder, meta in list_checkpoints(out / "checkpoints")}


def test_a_step_whose_fp16_gradients_overflow_is_skipped_counted_and_leaves_weights_and_lr_where_they_were(
        tmp_path, fp16):
    with hooks.added(Fp16OnCpu(init_scale=2.0**10), NonFinite(2, 0, "grad")):  # step 2's gradients overflow
        train_in_process(*RUN, f"output_dir={tmp_path}")
    lines = read_metrics(tmp_path, "train")
    assert [line["overflow_steps"] for line in lines] == [0, 1, 0, 0]
    assert [line["loss_scale"] for line in lines] == [2.0**10, 2.0**9, 2.0**9, 2.0**9]  # halved once
    assert "loss" not in lines[1] and all("loss" in lines[n] for n in (0, 2, 3))  # a skipped step averages nothing
    # The LR each step applied: warmup of 4 steps over the steps applied, so step 3 applies what step 2 would have.
    lrs = [line["lr"] for line in lines]
    assert lrs == pytest.approx([0.25e-3, 0.5e-3, 0.5e-3, 0.75e-3], rel=1e-12), lrs
    weights = weights_at(tmp_path)
    assert all(torch.equal(weights[1][name], weights[2][name]) for name in weights[1])
    assert any(not torch.equal(weights[2][name], weights[3][name]) for name in weights[2])


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_nonfinite_fp16_loss_with_finite_gradients_is_not_applied(tmp_path, fp16, policy):
    fault = NonFinite(2, 0, "value")  # only the loss's value is NaN: the scaler finds nothing wrong in the gradients
    with hooks.added(Fp16OnCpu(init_scale=2.0**10), fault):
        if policy == "stop":
            with pytest.raises(NonFiniteError, match="non-finite loss at step 2 .*process 0: loss=nan") as stopped:
                train_in_process(*RUN, f"output_dir={tmp_path}", "train.on_nonfinite=stop")
            assert stopped.value.exit_code == 5
            assert sorted(weights_at(tmp_path)) == [1]
            return
        train_in_process(*RUN, f"output_dir={tmp_path}", "train.on_nonfinite=skip")
    weights = weights_at(tmp_path)
    assert all(torch.equal(weights[1][name], weights[2][name]) for name in weights[1])
    lines = read_metrics(tmp_path, "train")
    assert [line["overflow_steps"] for line in lines] == [0, 0, 0, 0]  # not an overflow: the scale stays
    assert lines[2]["lr"] == lines[1]["lr"]


@pytest.mark.parametrize("limit, stopped_at, why", [
    (["train.fp16_min_loss_scale=1", "train.fp16_max_consecutive_overflows=0"], 6,
     "until the scale fell below train.fp16_min_loss_scale=1"),
    (["train.fp16_min_loss_scale=0", "train.fp16_max_consecutive_overflows=3"], 4,
     "3 steps in a row (train.fp16_max_consecutive_overflows=3)"),
], ids=["scale below the floor", "overflows in a row"])
def test_fp16_gradients_that_overflow_at_every_scale_stop_every_process_in_one_line(tmp_path, fp16, limit,
                                                                                    stopped_at, why):
    # From step 2 on every step overflows; from a scale of 16 the fifth halving takes it below 1, at step 6.
    with hooks.added(Fp16OnCpu(init_scale=16.0), OverflowFrom(2)), pytest.raises(NonFiniteError) as stopped:
        train_in_process(*RUN, f"output_dir={tmp_path}", "train.max_steps=8", *limit)
    message = str(stopped.value)
    assert stopped.value.exit_code == 5 and "\n" not in message
    assert message.startswith("fp16 loss scale collapsed: the gradients overflowed (inf/NaN with a finite loss) "
                              f"{why}, from step 2 to step {stopped_at}"), message
    assert f"every process stopped at step {stopped_at}, its weights those of step 1".lower() in message.lower()
    lines = read_metrics(tmp_path, "train")
    assert [line["step"] for line in lines] == list(range(1, stopped_at))  # the stopping step writes no line
    weights = weights_at(tmp_path)
    assert all(torch.equal(weights[1][name], weights[step][name]) for step in weights for name in weights[1])
