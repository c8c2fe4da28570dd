"""Contracts across world sizes, launched through the shipped multi_gpu profile (a gloo group on CPU).

Training at several world sizes is in contracts/test_same_training_at_any_world_size.py and
launching/test_every_launch_path_trains_like_one_process.py."""

import pytest

from support.commands import evaluate_in_process, last_json_line, launch, train_in_process
from support.locations import PROBE

# 997 divides by neither 2 nor 3
SUBSET = ["data.synthetic=true", "data.train_subset=96", "data.eval_subset=997", "train.plot=false"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    train_in_process("mnist_cnn", f"output_dir={out}", *SUBSET, "train.batch_size=24", "train.max_steps=4")
    return out


EVAL = ["mnist_cnn", *SUBSET, "train.eval_batch_size=100"]  # 100 splits evenly across no 3 processes


@pytest.fixture(scope="module")
def plain_eval(trained):
    """The checkpoint evaluated by one plain process: what every world size must reproduce."""
    return evaluate_in_process(EVAL[0], trained, *EVAL[1:])


# 1 process is the plain in-process evaluation itself
@pytest.mark.parametrize("processes", [pytest.param(2, marks=pytest.mark.floors), 3])
def test_eval_is_exact_at_any_world_size(trained, plain_eval, processes):
    evaluation = launch(processes, "eval", *EVAL, f"checkpoint={trained}")
    result = last_json_line(evaluation.stdout)
    said = f"accel-train eval: {trained}: 997 samples on {processes} process(es): loss="
    assert [line for line in evaluation.stderr.splitlines() if line.startswith(said)], evaluation.stderr[-2000:]
    assert result["num_processes"] == processes and plain_eval["num_processes"] == 1
    assert result["num_samples"] == plain_eval["num_samples"] == 997
    assert result["correct"] == plain_eval["correct"]
    assert result["loss"] == pytest.approx(plain_eval["loss"], rel=1e-5)


def test_a_launch_that_forms_no_process_group_exits_4_instead_of_evaluating_alone(trained):
    # What the eval contract rests on: N processes that each evaluate the whole set alone would agree with the
    # plain process too. Here Accelerate is not told to use the CPU, so it forms no group (see the probe).
    result = launch(2, "eval", *EVAL, f"checkpoint={trained}", script=PROBE, env={"PROBE_NO_PROCESS_GROUP": "1"},
                    check=False)
    assert result.returncode != 0 and not result.stdout.strip(), result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("accel-train: error:")]
    assert errors and all("the launcher started 2 processes but only 1 joined the run" in line for line in errors)
    workers, _, launcher = result.stderr.partition("failed (exitcode")
    assert launcher.startswith(": 4)") and "Traceback" not in workers, result.stderr[-3000:]


def test_a_global_batch_that_does_not_split_across_processes_is_refused_naming_the_batches_and_world_sizes_that_do():
    from types import SimpleNamespace

    from accel_train.errors import UserError
    from accel_train.training.accumulation import per_process_batch

    three, four = SimpleNamespace(num_processes=3), SimpleNamespace(num_processes=4)
    with pytest.raises(UserError, match="train.batch_size=64 does not split evenly across 3 processes; use a "
                                        "multiple of 3, e.g. 63 or 66, or run at a world size that splits it: "
                                        "1, 2, 4, 8, 16, 32, 64 process\\(es\\)$"):
        per_process_batch(64, three, "train.batch_size")
    with pytest.raises(UserError, match="e.g. 4, or"):  # no smaller multiple than the process count itself
        per_process_batch(2, four, "train.batch_size")
    assert per_process_batch(66, three, "train.batch_size") == 22


def test_sync_batchnorm_on_cpu_processes_says_it_is_ignored_and_on_gpus_converts_every_batchnorm(capsys):
    from types import SimpleNamespace

    import torch

    from accel_train.distributed.accelerator import maybe_sync_batchnorm

    def model():
        return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.BatchNorm2d(4))

    def processes(n, device):
        return SimpleNamespace(num_processes=n, device=torch.device(device), is_main_process=True)

    cpu_model = model()
    assert maybe_sync_batchnorm(cpu_model, True, processes(2, "cpu")) is cpu_model
    assert capsys.readouterr().out == ("model.sync_batchnorm ignored: SyncBatchNorm needs a GPU; each CPU process "
                                       "keeps its own statistics\n")
    converted = maybe_sync_batchnorm(model(), True, processes(2, "cuda"))  # converting needs no GPU
    assert [type(m).__name__ for m in converted.modules()].count("SyncBatchNorm") == 2
    assert not any(isinstance(m, torch.nn.SyncBatchNorm) for m in maybe_sync_batchnorm(model(), True,
                                                                                       processes(1, "cuda")).modules())
    assert capsys.readouterr().out == ""  # 1 process, or the switch off: nothing to say
