"""Contracts across world sizes, launched through the shipped multi_gpu profile (a gloo group on CPU)."""

import pytest
import yaml

from conftest import last_json_line, launch, read_metrics, run_cli

SUBSET = ["data.synthetic=true", "data.train_subset=96", "data.eval_subset=997"]  # 997 divides by neither 2 nor 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    run_cli("train", "mnist_cnn", f"output_dir={out}", *SUBSET, "train.batch_size=24", "train.max_steps=4")
    return out


@pytest.mark.parametrize("processes", [1, 2, 3])
def test_eval_is_exact_at_any_world_size(trained, processes):
    # eval_batch_size=100 splits evenly across none of 3 processes and leaves a ragged last batch
    args = ["eval", "mnist_cnn", f"checkpoint={trained}", *SUBSET, "train.eval_batch_size=100"]
    reference = last_json_line(run_cli(*args).stdout)
    result = last_json_line(launch(processes, *args).stdout)
    assert result["num_samples"] == reference["num_samples"] == 997
    assert result["correct"] == reference["correct"]
    assert result["loss"] == pytest.approx(reference["loss"], rel=1e-5)


def test_two_processes_form_one_group_and_train_like_one_process_with_the_same_global_batch(tmp_path):
    common = ["mnist_cnn", *SUBSET, "model.dropout=false", "train.batch_size=24", "train.epochs=2",
              "train.log_every_steps=1", "train.schedule=exponential", "train.lr_gamma=0.5"]
    run_cli("train", *common, f"output_dir={tmp_path / 'one'}")
    result = launch(2, "train", *common, f"output_dir={tmp_path / 'two'}")
    assert "fp16 mixed precision is unavailable on CPU" in result.stderr
    run = yaml.safe_load((tmp_path / "two" / "config.yaml").read_text())["run"]
    assert (run["world_size"], run["distributed_type"], run["mixed_precision"]) == (2, "MULTI_CPU", "no")
    one, two = read_metrics(tmp_path / "one", "train"), read_metrics(tmp_path / "two", "train")
    assert [line["step"] for line in one] == [line["step"] for line in two] == list(range(1, 9))
    assert [line["lr"] for line in one] == [line["lr"] for line in two]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    eval_one, eval_two = read_metrics(tmp_path / "one", "eval")[-1], read_metrics(tmp_path / "two", "eval")[-1]
    assert eval_two["num_samples"] == eval_one["num_samples"] == 997
    assert eval_two["accuracy"] == pytest.approx(eval_one["accuracy"], abs=2 / 997)


def test_global_batch_that_does_not_split_across_processes_is_refused(tmp_path):
    result = launch(3, "train", "mnist_cnn", *SUBSET, "train.batch_size=64", f"output_dir={tmp_path}", check=False)
    assert result.returncode != 0
    assert "train.batch_size=64 does not split evenly across 3 processes" in result.stderr
    assert "63 or 66" in result.stderr
