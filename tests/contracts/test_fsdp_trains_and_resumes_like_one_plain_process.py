"""Contracts of the FSDP profile (accelerate_configs/fsdp.yaml: FSDP2, full sharding, full state dicts).

Accelerate forms FSDP on GPUs only; on a machine without one the profile trains with DDP and says so. These
tests run on CPU, so most take the FSDP path through tests/launched_probe.py (PROBE_FSDP_ON_CPU), which only
makes the Accelerator choose FSDP with the plugin the profile describes: Accelerate's FSDP2 prepare (torch's
fully_shard over a gloo group), the loop, sharded optimizer steps, checkpoints and the export are real. What
they do not cover: NCCL, GPU memory savings, and FSDP's bf16 mixed-precision policy (run in fp32 here).
"""

import pytest
import yaml
from safetensors.torch import load_file

from accel_train.run.summaries import TIMING
from accel_train.workloads.models import MnistCNN
from support.commands import evaluate_in_process, launch, train_in_process
from support.locations import PROBE
from support.runs import assert_resumed_from, metrics_lines_before, newest_checkpoint_step, read_metrics

# 96 samples = 4 steps of 24 per epoch, 2 epochs; 101 eval samples split evenly across neither 2 nor 3.
# Dropout off: AdamW's first steps move a weight by about lr * sign(gradient), so with dropout's near-zero gradients
# the reductions' rounding grows to 4.7e-5 over 8 steps (DDP alike, measured), beyond this test's 1e-5.
RUN = ["mnist_cnn", "data.synthetic=true", "data.train_subset=96", "data.eval_subset=101", "model.dropout=false",
       "train.batch_size=24", "train.eval_batch_size=50", "train.epochs=2", "train.log_every_steps=1",
       "train.clip_grad_norm=1.0", "checkpoint.every_steps=2", "train.plot=false"]
FP32 = ("--mixed_precision", "no")


def fsdp(*args: str, processes: int = 2, **kwargs):
    return launch(processes, "train", *RUN, *args, profile="fsdp.yaml", script=PROBE, launcher_args=FP32,
                  env={"PROBE_FSDP_ON_CPU": "1", **kwargs.pop("env", {})}, **kwargs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    train_in_process(*RUN, f"output_dir={root / 'plain'}")
    fsdp(f"output_dir={root / 'fsdp'}")
    return root


def test_two_fsdp_processes_train_like_one_plain_process(runs):
    assert yaml.safe_load((runs / "fsdp" / "config.yaml").read_text())["run"]["distributed_type"] == "FSDP"
    plain, sharded = (load_file(str(runs / name / "model.safetensors")) for name in ("plain", "fsdp"))
    assert plain.keys() == sharded.keys()  # the plain model's names: no FSDP prefixes
    for name, weights in plain.items():
        relative = (sharded[name] - weights).norm() / weights.norm()
        assert relative <= 1e-5, f"{name}: FSDP differs from 1 process by {relative:.2e} (relative)"
    losses = [[line["loss"] for line in read_metrics(runs / name, "train")] for name in ("plain", "fsdp")]
    assert len(losses[1]) == 8 and losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_the_fsdp_export_loads_into_the_plain_model_and_evaluates_the_same(runs):
    weights = load_file(str(runs / "fsdp" / "model.safetensors"))
    MnistCNN(10, (1, 28, 28)).load_state_dict(weights)  # strict: every name and shape
    evaluated = evaluate_in_process(*RUN[:1], runs / "fsdp", *RUN[1:])
    final = read_metrics(runs / "fsdp", "test")[-1]
    assert evaluated["correct"] == final["correct"] and evaluated["num_samples"] == 101
    assert evaluated["loss"] == pytest.approx(final["loss"], rel=1e-6)


def test_fsdp_resume_after_a_crash_mid_epoch_equals_the_uninterrupted_run(runs, tmp_path):
    out = tmp_path / "resumed"
    crashed = fsdp(f"output_dir={out}", env={"PROBE_CRASH_AFTER_SAVE": "6"}, check=False)
    # It died once the checkpoint of step 6 was committed (not at start-up, which would leave nothing to resume)
    assert crashed.returncode != 0 and newest_checkpoint_step(out) == 6, crashed.stderr[-3000:]
    assert [line["step"] for line in read_metrics(out, "train")][:6] == list(range(1, 7))
    before = metrics_lines_before(out, 6)
    resumed = fsdp(f"output_dir={out}", "resume=auto")
    assert_resumed_from(out, 6, before)
    assert f"resuming from {out / 'checkpoints' / 'step-00000006'}: step 6" in resumed.stdout, resumed.stdout
    lines = [[{k: v for k, v in line.items() if k not in TIMING}
              for line in read_metrics(folder, "train")] for folder in (out, runs / "fsdp")]
    assert lines[0] == lines[1]
    resumed, uninterrupted = (load_file(str(folder / "model.safetensors")) for folder in (out, runs / "fsdp"))
    for name, weights in uninterrupted.items():
        assert (resumed[name] - weights).norm() <= 1e-6 * weights.norm(), name


def test_an_fsdp_checkpoint_of_2_processes_resumes_at_3_like_the_uninterrupted_run(runs, tmp_path):
    """Full state dicts are the same tensors at any world size: 3 processes shard them anew (uneven shards)."""
    out = tmp_path / "resized"
    crashed = fsdp(f"output_dir={out}", env={"PROBE_CRASH_AFTER_SAVE": "6"}, check=False)
    assert crashed.returncode != 0 and newest_checkpoint_step(out) == 6, crashed.stderr[-3000:]
    resumed = fsdp(f"output_dir={out}", "resume=auto", processes=3)
    assert "3 process(es), resumed from a checkpoint of 2 process(es)" in resumed.stdout, resumed.stdout[-3000:]
    losses = [[line["loss"] for line in read_metrics(folder, "train")] for folder in (out, runs / "fsdp")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    resized, uninterrupted = (load_file(str(folder / "model.safetensors")) for folder in (out, runs / "fsdp"))
    for name, weights in uninterrupted.items():
        relative = (resized[name] - weights).norm() / weights.norm()
        assert relative <= 1e-5, f"{name}: resumed at 3 differs by {relative:.2e} (relative)"


def test_fsdp_with_micro_batch_size_auto_searches_the_sharded_model_and_trains_like_one_plain_process(runs, tmp_path):
    """What a process holds under FSDP is its shard: the search runs once the model is sharded, each size tried by
    both processes together (its passes are collectives), and finds what fits (here: 6 samples, the injected limit)."""
    out = tmp_path / "auto"
    result = fsdp(f"output_dir={out}", "train.micro_batch_size=auto", env={"PROBE_OOM_ABOVE": "6"})
    assert "train.micro_batch_size=auto: 6 samples per process fit in cpu memory, the model sharded over 2 (FSDP); " \
           "train.accumulation_steps=2" in result.stdout, result.stdout[-3000:]
    losses = [[line["loss"] for line in read_metrics(folder, "train")] for folder in (out, runs / "plain")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_the_fsdp_profile_on_a_machine_without_gpu_says_it_trains_with_ddp(tmp_path):
    result = launch(2, "train", *RUN, "train.max_steps=1", f"output_dir={tmp_path}", profile="fsdp.yaml",
                    launcher_args=FP32)
    assert "Accelerate runs FSDP on GPUs only" in result.stderr
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["run"]["distributed_type"] == "MULTI_CPU"
