"""Contracts across world sizes, launched through the shipped multi_gpu profile (a gloo group on CPU).

Training at several world sizes is in test_equivalence.py and test_launch_paths.py."""

import pytest

from conftest import evaluate_in_process, last_json_line, launch, train_in_process

SUBSET = ["data.synthetic=true", "data.train_subset=96", "data.eval_subset=997"]  # 997 divides by neither 2 nor 3


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


@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=pytest.mark.floors), 3])
def test_eval_is_exact_at_any_world_size(trained, plain_eval, processes):
    result = last_json_line(launch(processes, "eval", *EVAL, f"checkpoint={trained}").stdout)
    assert result["num_samples"] == plain_eval["num_samples"] == 997
    assert result["correct"] == plain_eval["correct"]
    assert result["loss"] == pytest.approx(plain_eval["loss"], rel=1e-5)


def test_a_global_batch_that_does_not_split_across_processes_is_refused_naming_the_nearest_valid_ones():
    from types import SimpleNamespace

    from accel_train.distributed import per_process_batch
    from accel_train.errors import UserError

    three, four = SimpleNamespace(num_processes=3), SimpleNamespace(num_processes=4)
    with pytest.raises(UserError, match="train.batch_size=64 does not split evenly across 3 processes; use a "
                                        "multiple of 3, e.g. 63 or 66$"):
        per_process_batch(64, three, "train.batch_size")
    with pytest.raises(UserError, match="e.g. 4$"):  # no smaller multiple than the process count itself
        per_process_batch(2, four, "train.batch_size")
    assert per_process_batch(66, three, "train.batch_size") == 22
