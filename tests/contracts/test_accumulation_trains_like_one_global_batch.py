"""Contracts of gradient accumulation and the automatic micro-batch: train.batch_size stays the global batch of
one optimizer step, so how it is split (processes x micro-batch x accumulation steps) does not change training.
"""

import dataclasses
import json

import pytest
import yaml
from safetensors.torch import load_file

from accel_train import hooks
from support.commands import launch, train_in_process
from support.faults import OutOfMemoryAbove
from support.locations import PROBE
from support.recorders import RecordedImages
from support.runs import assert_same_run, crash_after_checkpoint_then_resume, read_metrics

# 90 samples: 3 optimizer steps of 24 per epoch, with 18 samples left over (3 micro-batches of 6 under
# accumulation 4, fewer than a step, as drop_last leaves a partial batch without accumulation). Dropout off: its masks
# are keyed alike in a split batch (test_dropout_keyed_by_sample_trains_alike_everywhere.py), but AdamW's first steps
# move each weight by about lr * sign(gradient), so near-zero gradients whose rounding differs flip a whole step:
# 4.2e-5 here with dropout on (1.6e-8 with SGD, 1.0e-6 with dropout off; measured), beyond this test's 1e-5.
SAME_GLOBAL_BATCH = ["mnist_cnn", "data.synthetic=true", "data.train_subset=90", "data.eval_subset=101",
                     "model.dropout=false", "train.batch_size=24", "train.eval_batch_size=50", "train.epochs=2",
                     "train.schedule=cosine", "train.warmup_steps=2", "train.log_every_steps=1",
                     "train.clip_grad_norm=1.0", "train.plot=false"]
SPLITS = {  # name -> (processes, overrides)
    "1 process": (1, []),
    "1 process, accumulation 4": (1, ["train.accumulation_steps=4"]),
    "2 processes, accumulation 2": (2, ["train.accumulation_steps=2"]),
}


class EveryBatchRead(hooks.Hooks):
    """The indices of every batch read from a split's in-memory dataset, train and eval."""

    def __init__(self) -> None:
        self.read = []

    def data_built(self, data, split):
        return dataclasses.replace(data, dataset=RecordedImages(data.dataset, self.read))


def batch_sizes_read(*args: str) -> set[int]:
    """Trains in this process; the sizes of the batches (train and eval) it read from its in-memory dataset."""
    recorder = EveryBatchRead()
    with hooks.added(recorder):
        train_in_process(*args)
    return {len(indices) for indices in recorder.read}


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    runs = {}
    for name, (processes, overrides) in SPLITS.items():
        out = tmp_path_factory.mktemp("split") / "run"
        if processes == 1:
            runs[name] = (out, batch_sizes_read(*SAME_GLOBAL_BATCH, *overrides, f"output_dir={out}"))
        else:
            probes = out.parent / "probe"
            launch(processes, "train", *SAME_GLOBAL_BATCH, *overrides, f"output_dir={out}", script=PROBE,
                   env={"PROBE_DIR": str(probes)})
            runs[name] = (out, [json.loads((probes / f"rank{r}.json").read_text()) for r in range(processes)])
    return runs


@pytest.mark.parametrize("name", [name for name in SPLITS if name != "1 process"])
def test_accumulation_trains_like_one_batch_of_the_same_global_size(splits, name):
    reference, run = splits["1 process"][0], splits[name][0]
    one, split = (load_file(str(folder / "model.safetensors")) for folder in (reference, run))
    for key, weights in one.items():
        relative = (split[key] - weights).norm() / weights.norm()
        assert relative <= 1e-5, f"{key}: {name} differs from 1 process by {relative:.2e} (relative)"
    lines = [read_metrics(folder, "train") for folder in (reference, run)]
    assert [line["step"] for line in lines[1]] == list(range(1, 7))  # 6 optimizer steps, one line each
    assert [line["lr"] for line in lines[1]] == [line["lr"] for line in lines[0]]
    assert [line["loss"] for line in lines[1]] == pytest.approx([line["loss"] for line in lines[0]], rel=1e-5)
    if SPLITS[name][0] == 1:  # micro-batches of 24 / 4 samples, never the whole batch
        assert 6 in splits[name][1] and 24 not in splits[name][1] and 24 in splits["1 process"][1]
    evaluated = [read_metrics(folder, "test")[-1] for folder in (reference, run)]
    assert evaluated[1]["correct"] == evaluated[0]["correct"] and evaluated[1]["num_samples"] == 101


def test_gradients_are_all_reduced_once_per_optimizer_step_not_per_micro_batch(splits):
    _, ranks = splits["2 processes, accumulation 2"]
    for rank in ranks:  # 12 micro-steps: DDP communicates after the 2nd, 4th, ... only
        assert rank["allreduce_at"] == [2, 4, 6, 8, 10, 12]


def test_resume_with_accumulation_stopped_mid_epoch_equals_the_uninterrupted_run(tmp_path):
    # 2 epochs of 3 steps as SAME_GLOBAL_BATCH's, of 12 samples in 4 micro-batches of 3 (half its samples)
    run = [*SAME_GLOBAL_BATCH, "data.train_subset=45", "data.eval_subset=20", "train.batch_size=12",
           "train.accumulation_steps=4", "checkpoint.every_steps=2"]
    train_in_process(*run, f"output_dir={tmp_path / 'reference'}")
    # step 4: mid-epoch 1, between train lines' checkpoints
    crash_after_checkpoint_then_resume(4, *run, f"output_dir={tmp_path / 'resumed'}")
    assert_same_run(tmp_path / "resumed", tmp_path / "reference")


@pytest.mark.parametrize("overrides, words", [
    (["train.accumulation_steps=5"], ["train.accumulation_steps=5 does not divide the 24 samples", "1, 2, 3, 4, 6"]),
    (["train.micro_batch_size=5"], ["train.micro_batch_size=5 does not divide", "use one of 1, 2, 3, 4, 6, 8, 12, 24"]),
    (["train.micro_batch_size=6", "train.accumulation_steps=4"], ["set one of them"]),
    (["train.micro_batch_size=lots"], ["train.micro_batch_size: expected int or auto"]),
])
def test_a_batch_that_does_not_split_into_micro_batches_is_named_in_one_line(tmp_path, overrides, words):
    from accel_train.errors import UserError

    with pytest.raises(UserError) as error:
        train_in_process(*SAME_GLOBAL_BATCH, *overrides, f"output_dir={tmp_path}")
    assert all(word in str(error.value) for word in words), str(error.value)


def test_micro_batch_auto_finds_the_largest_that_fits_and_trains_like_the_full_batch(tmp_path):
    """PROBE_OOM_ABOVE=N makes the device raise its out-of-memory error for micro-batches above N samples."""
    reference = tmp_path / "reference"
    train_in_process(*SAME_GLOBAL_BATCH, f"output_dir={reference}")
    out = tmp_path / "auto"
    result = launch(2, "train", *SAME_GLOBAL_BATCH, "train.micro_batch_size=auto", f"output_dir={out}",
                    script=PROBE, env={"PROBE_OOM_ABOVE": "5"})
    # 12 samples per process per step: 12 and 6 raise, 4 fits (the largest divisor of 12 up to 5), so 3 steps
    assert "train.micro_batch_size=auto: 4 samples per process fit" in result.stdout
    assert "train.accumulation_steps=3" in result.stdout
    saved = yaml.safe_load((out / "config.yaml").read_text())["train"]
    assert (saved["micro_batch_size"], saved["accumulation_steps"]) == (4, 3)
    one, auto = (load_file(str(folder / "model.safetensors")) for folder in (reference, out))
    for key, weights in one.items():
        assert (auto[key] - weights).norm() / weights.norm() <= 1e-5, key


def test_micro_batch_auto_says_so_when_not_even_one_sample_fits(tmp_path):
    from accel_train.errors import UserError

    with pytest.raises(UserError, match="not even 1 sample per process fits in cpu memory"), \
            hooks.added(OutOfMemoryAbove(0)):
        train_in_process(*SAME_GLOBAL_BATCH, "train.micro_batch_size=auto", f"output_dir={tmp_path}")
