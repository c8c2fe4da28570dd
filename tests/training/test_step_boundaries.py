"""Contracts of the loop's step boundaries, checked in-process (fast): when the host reads the device, when a
checkpoint is saved, where a resumed run continues, what of metrics.jsonl it keeps."""

import dataclasses
import json
import re
import sys
from collections import Counter

import pytest
import torch

from accel_train import hooks
from accel_train.config import load_config
from accel_train.data.in_memory import PerSampleImages
from accel_train.run.checkpoint import Checkpoints
from accel_train.run.folder import lines_up_to
from accel_train.run.place import RunPlace
from accel_train.run.resume import resume_position
from accel_train.state import Progress, ResumePoint
from support.commands import train_in_process
from support.runs import read_metrics

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")
# Samplers draw batch indices on the host by design (a CPU generator, never a device value).
HOST_BY_DESIGN = ("torch/utils/data/", "accelerate/data_loader.py")


class Where(hooks.Hooks):
    """The optimizer step the loop is in (the last one taken), and whether it is evaluating: from a step's first
    evaluation forward pass to the next training micro-batch."""

    def __init__(self) -> None:
        self.step, self.evaluating = 0, False

    def optimizer_stepped(self, progress, terms, skipped, lr):
        self.step = progress.step

    def after_forward(self, phase, step, model, batch, outputs):
        self.evaluating = self.evaluating or phase == "eval"
        return outputs

    def micro_batch_loaded(self, progress, batch):
        self.evaluating = False


@pytest.fixture
def host_reads(monkeypatch):
    """Counts host reads of tensor values per optimizer step; evaluation is counted apart (it may read)."""
    where = Where()
    reads = Counter()

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if not any(part in caller for part in HOST_BY_DESIGN):
                reads["eval" if where.evaluating else where.step] += 1
            return original(self, *args, **kwargs)
        return read

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    with hooks.added(where):
        yield reads


# Every feature that runs inside a step, on the device data path and on the file-backed one (DataLoader workers).
STEP_FEATURES = {
    "stop": ["train.on_nonfinite=stop"],
    "skip": ["train.on_nonfinite=skip"],
    "ema, mixup, cutmix, accumulation, a varying LR": [
        "train.ema_decay=0.9", "train.mixup_alpha=0.2", "train.cutmix_alpha=1.0", "train.accumulation_steps=2",
        "train.schedule=cosine", "train.warmup_steps=3"],
    "DataLoader workers, ema": ["data.on_device=false", "data.num_workers=2", "data.augment=true",
                                "train.ema_decay=0.9"],
}


@pytest.mark.parametrize("features", STEP_FEATURES.values(), ids=STEP_FEATURES.keys())
def test_a_training_step_reads_nothing_from_the_device_except_at_log_steps(host_reads, tmp_path, features):
    from accel_train import api

    # 10 steps per epoch: an epoch end (evaluation follows) at step 10, which is not a log step; batches of 4 (what
    # a step reads from the device does not depend on their size)
    config = load_config("mnist_cnn", ["data.synthetic=true", "data.train_subset=40", "data.eval_subset=20",
                                       "train.batch_size=4", "train.max_steps=17", "train.log_every_steps=4",
                                       "train.progress_bar=false", "checkpoint.at_epoch_end=false",
                                       "train.clip_grad_norm=1.0", "train.plot=false", *features,
                                       f"output_dir={tmp_path}"])
    host_reads.clear()
    api.train(config)
    log_steps, epoch_ends = {4, 8, 12, 16, 17}, {10, 17}
    per_step = {step: count for step, count in host_reads.items() if step != "eval" and step > 0}
    assert set(per_step) <= log_steps | epoch_ends, f"host reads outside log steps and epoch ends: {per_step}"
    # A log step: one read for the guard's decision, one for the averaged train terms; an epoch end: the decision.
    assert all(count <= (2 if step in log_steps else 1) for step, count in per_step.items()), per_step
    assert host_reads["eval"] > 0  # the counter works: evaluation reads its metrics


def config_with(**checkpoint) -> Checkpoints:
    overrides = [f"checkpoint.{key}={value}" for key, value in checkpoint.items()]
    config = load_config("mnist_cnn", overrides)
    return Checkpoints(config, None, RunPlace.open(config.output_dir, patience_s=1))  # scheduling needs no processes


def saved_steps(checkpoints: Checkpoints, steps: int, last: int | None = None) -> list[int]:
    """The steps checkpoints are due at in a run of 10 steps an epoch, its `last` step the run's end."""
    progress = Progress(steps_per_epoch=10, total_steps=100)
    due = []
    for progress.step in range(1, steps + 1):
        if checkpoints.due(progress, last=progress.step == last):
            due.append(progress.step)
    return due


def test_saves_fall_every_n_steps_and_after_each_epochs_evaluation():
    every_4 = config_with(every_steps=4, at_epoch_end="false")
    assert saved_steps(every_4, 30) == [4, 8, 12, 16, 20, 24, 28]  # not at the epoch ends 10, 30 that it misses
    assert saved_steps(every_4, 30, last=29) == [4, 8, 12, 16, 20, 24, 28, 29]  # the run's end, whatever the step
    at_epoch_end = config_with(at_epoch_end="true")
    assert saved_steps(at_epoch_end, 30) == [10, 20, 30]
    assert saved_steps(at_epoch_end, 30, last=7) == [7, 10, 20, 30]  # early stopping, or max_steps mid-epoch
    never = config_with(at_epoch_end="false")
    assert saved_steps(never, 30, last=10) == []


@pytest.mark.parametrize("meta, position", [
    ({"epoch": 1, "batches_done_in_epoch": 4, "steps_per_epoch": 10, "evaluated": False}, (1, 4)),  # mid-epoch
    ({"epoch": 1, "batches_done_in_epoch": 10, "steps_per_epoch": 10, "evaluated": True}, (2, 0)),  # epoch done
    ({"epoch": 0, "batches_done_in_epoch": 3, "steps_per_epoch": 10, "evaluated": True}, (0, 3)),  # max_steps end
])
def test_resume_continues_at_the_batch_after_the_checkpoint(meta, position):
    assert resume_position(meta) == position


def metrics_lines(*lines) -> list[str]:
    return [json.dumps({"split": split, "step": step}) + "\n" for split, step in lines]


def test_a_resumed_metrics_file_keeps_the_lines_its_checkpoint_had_seen():
    written = metrics_lines(("train", 4), ("train", 8), ("eval", 10), ("train", 12), ("eval", 12), ("train", 16))
    assert lines_up_to(written, ResumePoint(step=10, evaluated=True)) == written[:3]
    assert lines_up_to(written, ResumePoint(step=10, evaluated=False)) == written[:2]  # its eval came after the save
    assert lines_up_to(written, ResumePoint(step=12, evaluated=False)) == written[:4]
    assert lines_up_to(written, ResumePoint(step=9)) == written[:2]
    cut_short = [*written[:2], '{"split": "tra']  # the run that died was writing a line
    assert lines_up_to(cut_short, ResumePoint(step=30)) == written[:2]
    no_newline = written[0].rstrip("\n")
    assert lines_up_to([no_newline], ResumePoint(step=30)) == [written[0]]


def test_the_train_meter_state_round_trips_bit_for_bit():
    from accelerate import Accelerator

    from accel_train.training.meter import TrainMeter

    accelerator = Accelerator(cpu=True)
    meter = TrainMeter(accelerator, global_batch=8)
    for value in (0.1, 0.7, 1 / 3):
        meter.update({"loss": torch.tensor(value), "kl": torch.tensor(2 * value)}, skipped=torch.tensor(0.0))
    meter.update({"loss": torch.tensor(float("nan")), "kl": torch.tensor(1.0)}, skipped=torch.tensor(1.0))
    state = json.loads(json.dumps(meter.state_dict()))  # as the checkpoint stores it
    restored = TrainMeter(accelerator, global_batch=8)
    restored.load_state_dict(state)
    for m in (meter, restored):
        m.update({"loss": torch.tensor(0.25), "kl": torch.tensor(0.5)}, skipped=torch.tensor(0.0))
    ours, theirs = meter.compute(), restored.compute()
    assert (ours["loss"], ours["kl"]) == (theirs["loss"], theirs["kl"])
    assert ours["loss"] == pytest.approx((0.1 + 0.7 + 1 / 3 + 0.25) / 4)  # the skipped NaN step is left out


def test_a_checkpoint_restores_every_stateful_part_by_name_and_one_of_the_previous_layout_too(tmp_path):
    from accel_train.run.resume import read_loop_state

    meta = {"step": 12, "epoch": 1, "metrics": {"accuracy": 0.5}}
    progress = Progress(steps_per_epoch=10, total_steps=30, step=12, last_eval={"accuracy": 0.5})
    saved = {"progress": progress.state_dict(), "meter": {"names": ["loss"], "sums": [1.5], "counted": 2.0},
             "selection": {"best": None, "early_stop": None, "stopped": False}}
    (tmp_path / "loop_state_0.json").write_text(json.dumps(saved))
    assert read_loop_state(tmp_path, 0, meta) == json.loads(json.dumps(saved))
    restored = Progress(steps_per_epoch=10, total_steps=30)
    restored.load_state_dict(read_loop_state(tmp_path, 0, meta)["progress"])
    assert (restored.step, restored.last_eval) == (12, {"accuracy": 0.5})
    assert restored.elapsed_before_s == pytest.approx(saved["progress"]["elapsed_s"])
    # The other layout read: the meter's sums at the top level of loop_state, the progress in checkpoint.json.
    (tmp_path / "loop_state_0.json").write_text(json.dumps({**saved["meter"], "selection": saved["selection"],
                                                            "elapsed_s": 7.5}))
    assert read_loop_state(tmp_path, 0, meta) == {
        "meter": saved["meter"], "selection": saved["selection"],
        "progress": {"step": 12, "last_eval": {"accuracy": 0.5}, "elapsed_s": 7.5}}


def test_samples_per_s_counts_training_time_only_not_evaluation_or_checkpoints():
    from accelerate import Accelerator

    from accel_train.training.meter import TrainMeter

    clock = {"now": 100.0}
    meter = TrainMeter(Accelerator(cpu=True), global_batch=32, clock=lambda: clock["now"])
    for _ in range(4):  # 4 steps of 0.5 s each
        clock["now"] += 0.5
        meter.update({"loss": torch.tensor(1.0)}, skipped=torch.tensor(0.0))
        with meter.paused():  # an evaluation and a checkpoint: 10 s that trained nothing
            clock["now"] += 2.5
    assert meter.compute()["samples_per_s"] == pytest.approx(4 * 32 / 2.0)


class Moved(hooks.Hooks):
    """The process's clock (time.perf_counter, which the meter reads) runs `lost` seconds ahead: each evaluation
    batch and each checkpoint moves it on by `cost` seconds. Nothing sleeps."""

    def __init__(self, monkeypatch, cost: float) -> None:
        import time

        self.lost, self.cost, self.saved_at = 0.0, cost, []
        perf_counter = time.perf_counter
        monkeypatch.setattr(time, "perf_counter", lambda: perf_counter() + self.lost)

    def after_forward(self, phase, step, model, batch, outputs):
        self.lost += self.cost if phase == "eval" else 0
        return outputs

    def checkpoint_saving(self, progress):
        self.lost += self.cost
        self.saved_at.append(progress.step)


def test_samples_per_s_of_a_training_run_leaves_out_its_evaluations_and_checkpoints(tmp_path, monkeypatch):
    """The loop, not only the meter: every evaluation (one batch) and every checkpoint of this run costs 1000 s on the
    meter's clock, and each train line's interval holds both. A line that counted them would report at most 4 steps
    x 12 samples / 1000 s."""
    moved = Moved(monkeypatch, cost=1000)
    # 8 steps per epoch, 2 epochs: train lines at 4, 8, 12, 16; evaluations at 3, 6, 8, 9, 12, 15, 16; saves every 2
    with hooks.added(moved):
        train_in_process("mnist_cnn", "data.synthetic=true", "data.train_subset=96", "data.eval_subset=12",
                         "train.batch_size=12", "train.eval_batch_size=12", "train.epochs=2",
                         "train.log_every_steps=4", "train.eval_every_steps=3", "checkpoint.every_steps=2",
                         "train.plot=false", f"output_dir={tmp_path}")
    lines, saved_at = read_metrics(tmp_path, "train"), moved.saved_at
    evaluated_at = [line["step"] for line in read_metrics(tmp_path, "test")]
    assert [line["step"] for line in lines] == [4, 8, 12, 16]
    for start in (0, 4, 8, 12):  # what happens at a line's step comes after the line: it counts towards the next
        assert any(start <= step < start + 4 for step in evaluated_at), (start, evaluated_at)
        assert any(start <= step < start + 4 for step in saved_at), (start, saved_at)
    assert all(line["samples_per_s"] > 1.0 for line in lines), [line["samples_per_s"] for line in lines]


def test_data_wait_is_the_share_of_training_time_spent_waiting_for_batches():
    from accelerate import Accelerator

    from accel_train.training.meter import TrainMeter

    clock = {"now": 100.0}
    meter = TrainMeter(Accelerator(cpu=True), global_batch=32, clock=lambda: clock["now"])

    def batches():
        for _ in range(4):
            clock["now"] += 1.5  # the loader takes 1.5 s a batch
            yield "batch"

    for _ in meter.timed(batches()):
        clock["now"] += 0.5  # the step computes for 0.5 s
        meter.update({"loss": torch.tensor(1.0)}, skipped=torch.tensor(0.0))
        with meter.paused():  # an evaluation: neither training nor waiting
            clock["now"] += 10
    logs = meter.compute()
    assert logs["data_wait"] == pytest.approx(1.5 / 2.0) and logs["samples_per_s"] == pytest.approx(4 * 32 / 8.0)
    assert meter.compute()["data_wait"] == 0.0  # the next line counts from there


def test_a_run_that_waits_for_data_says_so_in_its_lines_its_summary_and_one_warning_naming_the_knob(
        tmp_path, monkeypatch, capsys):
    """Every sample of the file-backed path costs 1 s on the meter's clock (the clock is moved, nothing sleeps):
    nearly all of each train line's time is waiting. Evaluation samples cost it too, and must not count."""
    moved = Moved(monkeypatch, cost=0)

    class SlowSamples(torch.utils.data.Dataset):
        def __init__(self, samples) -> None:
            self.samples = samples

        def __len__(self) -> int:
            return len(self.samples)

        def __getitem__(self, index):
            moved.lost += 1
            return self.samples[index]

    class EverySampleSlow(hooks.Hooks):
        """The file-backed path's samples (what make_loader would serve: PerSampleImages), each 1 s late."""

        def data_built(self, data, split):
            return dataclasses.replace(data, dataset=SlowSamples(PerSampleImages(data.dataset)))

    with hooks.added(moved, EverySampleSlow()):
        train_in_process("mnist_cnn", "data.synthetic=true", "data.train_subset=96", "data.eval_subset=12",
                         "train.batch_size=12", "train.eval_batch_size=12", "train.epochs=1", "train.log_every_steps=2",
                         "data.on_device=false", "data.num_workers=0", "train.plot=false", "train.progress_bar=false",
                         f"output_dir={tmp_path}")
    waits = [line["data_wait"] for line in read_metrics(tmp_path, "train")]
    assert len(waits) == 4 and all(0.9 < wait <= 1.0 for wait in waits), waits  # 12 s of waiting a step
    printed = capsys.readouterr()
    warnings = [line for line in printed.err.splitlines() if "waiting for data" in line]
    assert len(warnings) == 1 and re.match(r"accel-train: warning: (9\d|100)% of the training time up to step 2 was "
                                           "spent waiting for data", warnings[0]), printed.err
    assert warnings[0].endswith("CPU cores per process here)") and "(data_wait in metrics.jsonl); set " \
        "data.on_device=true (the dataset moves to the device once, augmented a batch at a time), or raise " \
        "data.num_workers (now 0; " in warnings[0], warnings[0]
    assert re.search(r"samples/s while training, (9\d|100)% of it waiting for data", printed.out), printed.out


def test_batches_for_a_gpu_come_from_pinned_memory_and_reach_it_without_blocking(monkeypatch):
    """A blocking copy to the device waits for every kernel queued before it: the host would stop at each batch."""
    import accelerate.data_loader
    from torch.utils.data import TensorDataset

    from accel_train.config import DataConfig
    from accel_train.data import Data, make_loader
    from accel_train.distributed.accelerator import make_accelerator

    data = Data(TensorDataset(torch.zeros(8, 1, 2, 2), torch.zeros(8, dtype=torch.long)), 2, (1, 2, 2))
    settings = DataConfig(num_workers=0)
    assert make_loader(data, settings, 4, True, torch.device("cuda")).pin_memory  # made, not iterated: no GPU here
    copies = []
    original = accelerate.data_loader.send_to_device
    monkeypatch.setattr(accelerate.data_loader, "send_to_device", lambda batch, device, **options: (
        copies.append(options), original(batch, device, **options))[1])
    accelerator = make_accelerator(seed=0)
    next(iter(accelerator.prepare(make_loader(data, settings, 4, True, accelerator.device))))
    assert copies and all(options.get("non_blocking") for options in copies), copies


def test_the_weights_average_lives_on_the_models_device_and_updates_without_moving_anything(monkeypatch):
    """The meta device stands in for a GPU: a counter kept on the CPU would be copied to the device at each update."""
    from types import SimpleNamespace

    from accel_train.training.ema import WeightsEMA

    device = torch.device("meta")
    accelerator = SimpleNamespace(device=device, distributed_type="NO", unwrap_model=lambda model: model)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).to(device)
    ema = WeightsEMA(accelerator, model, decay=0.9)
    moved = []
    original = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: (
        moved.append(self.device), original(self, *args, **kwargs))[1])
    for _ in range(3):
        ema.update(model)
    assert {tensor.device for tensor in ema.averaged.state_dict().values()} == {device}  # the counter too
    assert moved == [], moved


def test_the_lr_schedule_stays_where_it_was_on_a_skipped_step_and_its_state_round_trips():
    from accel_train.config import TrainConfig
    from accel_train.training.optim import build_optimizer, build_scheduler

    cfg = TrainConfig(schedule="cosine", warmup_steps=2, lr=0.1, epochs=2)
    model = torch.nn.Linear(2, 1)
    scheduler = build_scheduler(cfg, build_optimizer(cfg, model), steps_per_epoch=5)
    applied = []
    for skipped in (0.0, 1.0, 0.0, 1.0, 1.0, 0.0):
        applied.append(float(scheduler.get_last_lr()[0]))
        scheduler.step(torch.tensor(skipped))
    factor = scheduler.factor
    assert applied == [0.1 * factor(position) for position in (0, 1, 1, 2, 2, 2)]
    restored = build_scheduler(cfg, build_optimizer(cfg, torch.nn.Linear(2, 1)), steps_per_epoch=5)
    restored.load_state_dict(scheduler.state_dict())
    assert float(restored.get_last_lr()[0]) == float(scheduler.get_last_lr()[0]) == 0.1 * factor(3)
    # A checkpoint of an earlier version holds LambdaLR's state, which counted every step: it goes on from there.
    earlier = build_scheduler(cfg, build_optimizer(cfg, torch.nn.Linear(2, 1)), steps_per_epoch=5)
    earlier.load_state_dict({"base_lrs": [0.1, 0.1], "last_epoch": 4, "_step_count": 5, "_last_lr": [0.0, 0.0],
                             "lr_lambdas": [dict(vars(factor))]})
    assert float(earlier.get_last_lr()[0]) == 0.1 * factor(4)


def test_the_loop_alone_moves_the_lr_schedule_even_on_a_micro_step_accelerate_would_not_sync():
    """Accelerate's scheduler wrapper, stepped with the optimizer, drops a call on a micro-step it does not sync (and
    may count it in the scheduler's private `_step_count`, which AppliedStepsLR does not keep): our Accelerator passes
    every call through, and the schedule moves by what the loop tells it."""
    from accel_train.config import TrainConfig
    from accel_train.distributed.accelerator import make_accelerator
    from accel_train.training.optim import build_optimizer, build_scheduler

    accelerator = make_accelerator(seed=0)
    cfg = TrainConfig(schedule="cosine", lr=0.1, epochs=1)
    model = torch.nn.Linear(2, 1)
    optimizer = build_optimizer(cfg, model)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, build_scheduler(cfg, optimizer, 5))
    accelerator.gradient_accumulation_steps = 2
    try:
        with accelerator.accumulate(model):  # the first of two micro-batches: no sync
            pass
        assert not accelerator.sync_gradients
        scheduler.step(torch.tensor(0.0))
        scheduler.step(torch.tensor(1.0))  # a skipped step: the schedule stays
        assert int(scheduler.scheduler.applied) == 1
        assert float(scheduler.get_last_lr()[0]) == 0.1 * scheduler.scheduler.factor(1)
    finally:
        with accelerator.accumulate(model):  # the second: Accelerate's state back in step for the next test
            pass
        accelerator.gradient_accumulation_steps = 1
