"""data.num_workers=auto: the DataLoader workers a training run gets, chosen from a measurement on the machine (a
micro-batch loaded in the main process against a training micro-step), said in one line and written into the
run's config; the measurement leaves the run as it was."""

import pytest
import torch
import yaml
from safetensors.torch import load_file

import accel_train.training.feeding as feeding
from accel_train.distributed.devices import dataloader_workers
from accel_train.training.feeding import workers_to_feed
from support.commands import train_in_process
from support.locations import USER_RECIPE
from support.runs import read_metrics


def test_auto_takes_no_worker_where_loading_costs_a_step_at_most_a_twentieth():
    assert workers_to_feed(load_s=0.001, step_s=0.1, cores=8) == 0
    assert workers_to_feed(load_s=0.005, step_s=0.1, cores=8) == 0
    assert workers_to_feed(load_s=0.0051, step_s=0.1, cores=8) == 1


def test_auto_takes_the_fewest_workers_that_keep_the_step_fed_with_a_fifth_to_spare_at_most_the_cores():
    assert workers_to_feed(load_s=0.05, step_s=0.1, cores=8) == 1  # 1.2 x 0.5
    assert workers_to_feed(load_s=0.1, step_s=0.1, cores=8) == 2  # 1.2 x 1
    assert workers_to_feed(load_s=0.3, step_s=0.1, cores=8) == 4  # 1.2 x 3 = 3.6
    assert workers_to_feed(load_s=10.0, step_s=0.1, cores=3) == 3


# Samples transformed one by one (data.on_device=false: workers serve them), a model with BatchNorm and torch's own
# dropout: a measurement that moved its statistics or the random streams would change the run
RUN = ["data.on_device=false", "model.name=bn_cnn", "train.keyed_dropout=false", "train.batch_size=8",
       "train.max_steps=3", "train.eval_batch_size=10", "train.plot=false", "data.train_subset=48"]


def chosen_workers(output_dir) -> int | str:
    return yaml.safe_load((output_dir / "config.yaml").read_text())["data"]["num_workers"]


@pytest.mark.parametrize(("load_s", "step_s", "workers"), [(1e-4, 0.1, 0), (1.0, 0.1, "cores")])
def test_a_run_with_auto_takes_the_workers_its_measurement_gives_and_says_so_in_one_line(
        load_s, step_s, workers, tmp_path, monkeypatch, caplog):
    measured = []
    monkeypatch.setattr(feeding, "measured_seconds", lambda *args: measured.append(args) or (load_s, step_s))
    train_in_process(USER_RECIPE, *RUN, "data.num_workers=auto", f"output_dir={tmp_path}")
    expected = dataloader_workers("auto") if workers == "cores" else workers
    assert len(measured) == 1 and chosen_workers(tmp_path) == expected
    said = [record.getMessage() for record in caplog.records if "data.num_workers=auto" in record.getMessage()]
    assert len(said) == 1 and f"auto: {expected} DataLoader worker(s)" in said[0], said


def test_a_number_of_workers_given_is_kept_and_nothing_is_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(feeding, "measured_seconds", lambda *args: pytest.fail("measured a given data.num_workers"))
    train_in_process(USER_RECIPE, *RUN, "data.num_workers=1", f"output_dir={tmp_path}")
    assert chosen_workers(tmp_path) == 1


def test_the_measurement_leaves_the_run_as_a_given_number_of_workers_trains_it(tmp_path):
    """Measured for real: the model's weights, BatchNorm statistics and torch's random streams (its dropout) are
    where they were, so the run trains as one with no measurement, bit for bit."""
    train_in_process(USER_RECIPE, *RUN, "data.num_workers=auto", f"output_dir={tmp_path / 'auto'}")
    chosen = chosen_workers(tmp_path / "auto")
    assert isinstance(chosen, int) and 0 <= chosen <= dataloader_workers("auto")
    train_in_process(USER_RECIPE, *RUN, f"data.num_workers={chosen}", f"output_dir={tmp_path / 'given'}")
    runs = [tmp_path / "auto", tmp_path / "given"]
    for split in ("train", "test"):
        values = [[{key: line[key] for key in ("step", "loss", *(("accuracy",) if split == "test" else ()))}
                   for line in read_metrics(run, split)] for run in runs]
        assert values[0] and values[0] == values[1]
    weights = [load_file(str(run / "model.safetensors")) for run in runs]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
