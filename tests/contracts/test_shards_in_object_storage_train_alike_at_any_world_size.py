"""Contracts of training from shards in object storage at any world size.

Fashion-MNIST, written by `accel-train shard` to an S3 store (moto behind the counting, fault-injecting proxy of
support/object_store.py, reached by every launched process through AWS_ENDPOINT_URL), trains at 1, 2 and 3
processes on the same global batches of sample ids at every step, at the same LR, to the same weights within the
N x B tolerance, and evaluates exactly its test split; a run stopped by SIGTERM in the middle of an epoch at 2
processes and resumed at 3 (resume=auto, another machine's empty cache, from the store) continues the same batches
at the same LRs to the same weights; and each sample's random crop and flip is a function of (seed, epoch, sample id)
alone: alike at every world size and after the resume, anew for another seed and another epoch.

The runs go through tests/launched_probe.py: its `batches` recorder gives the ids of the shard samples each process
read (support.recorders.RecordedShardSamples: data.num_workers=0, so the reads happen in the process), its `inputs`
recorder a digest of each input the model received, its `step_lr` the LR of every step. The model has no dropout
(its masks are drawn per process). 480 training samples in about 24 shards of about 20, in blocks of about 5, so each
epoch's permutation of the shards and the windows of 8 shards it is shuffled within show in the batches; 101 test
samples split evenly across neither 2 nor 3 processes.
"""

import collections
import json
import signal

import pytest
from safetensors.torch import load_file

from accel_train import hooks
from accel_train.run.layout import read_starts
from support import recorders
from support.commands import launch, run_cli, run_probe, start_launch, train_in_process, wait_for
from support.locations import PROBE, needs_fashion_mnist
from support.runs import read_metrics

pytestmark = needs_fashion_mnist

TRAIN, TEST, BATCH, STEPS_PER_EPOCH, EPOCHS = 480, 101, 96, 5, 2
STOP_STEP = 3  # mid-epoch 0: the stopped run waits after it, and agrees on the signal at its evaluation
RUN = ["fashion_mnist_cnn", "data.name=shards", "data.num_workers=0", "data.augment=true", "model.dropout=false",
       f"train.batch_size={BATCH}", "train.eval_batch_size=96", f"train.epochs={EPOCHS}", "train.schedule=cosine",
       "train.warmup_steps=2", "train.log_every_steps=1", f"train.eval_every_steps={STOP_STEP}", "train.plot=false",
       "seed=1"]


def ranks(probes, processes: int) -> list[dict]:
    return [json.loads((probes / f"rank{rank}.json").read_text()) for rank in range(processes)]


@pytest.fixture(scope="module")
def shards_url(module_object_store, tmp_path_factory):
    """Fashion-MNIST's first 480 training and 101 test images, written by `accel-train shard` to the store."""
    url = module_object_store.url("fashion_mnist")
    images = tmp_path_factory.mktemp("fashion_mnist")  # where the recipe unpacks Debian's Fashion-MNIST
    run_cli("shard", "fashion_mnist_cnn", f"data.root={images}", f"data.train_subset={TRAIN}",
            f"data.eval_subset={TEST}", f"output={url}", "shard_mb=0.045", "block_mb=0.01")
    return url


@pytest.fixture(scope="module")
def runs(shards_url, tmp_path_factory):
    """{processes: (output_dir, each process's records)} of the same run at 1, 2 and 3 processes, and "resumed":
    (output_dir, records, the stopped run's output) of the run stopped at 2 processes and resumed at 3. Each run
    starts with an empty cache of its own: every one reads the store."""
    root = tmp_path_factory.mktemp("world_sizes")
    found = {}

    def args(name: str, output_dir: str | None = None) -> list[str]:
        return ["train", *RUN, f"data.root={shards_url}", f"data.cache_dir={root / f'cache-{name}'}",
                f"output_dir={root / (output_dir or name)}"]

    for processes in (1, 2, 3):
        name, probes = f"procs{processes}", root / f"probe{processes}"
        if processes == 1:
            run_probe(*args(name), env={"PROBE_DIR": str(probes), "PROBE_INPUTS": "1"}, timeout=300)
        else:
            launch(processes, *args(name), script=PROBE, env={"PROBE_DIR": str(probes), "PROBE_INPUTS": "1"},
                   timeout=300)
        found[processes] = (root / name, ranks(probes, processes))

    # Stopped at 2: every process waits after step 5 until the launcher forwards SIGTERM, sent once step 4's line
    # is written; the processes agree on it at step 5's evaluation, save and exit 75.
    out, log = root / "stopped", root / "stopped.log"
    job = start_launch(2, *args("stopped"), log=log, script=PROBE,
                       env={"PROBE_WAIT_FOR_SIGNAL": f"stopped:{STOP_STEP}"})
    wait_for(lambda: (out / "metrics.jsonl").is_file() and any(
        line["step"] == STOP_STEP - 1 for line in read_metrics(out, "train")), job, log, timeout=240)
    job.send_signal(signal.SIGTERM)
    job.wait(timeout=120)
    stopped = log.read_text()
    assert f"stopped by SIGTERM at step {STOP_STEP}; checkpoint saved" in stopped, stopped[-3000:]
    probes = root / "probe-resumed"  # continued on "another machine": an empty cache, every block from the store
    launch(3, *args("resumed", output_dir="stopped"), "resume=auto", script=PROBE,
           env={"PROBE_DIR": str(probes), "PROBE_INPUTS": "1"}, timeout=300)
    found["resumed"] = (out, ranks(probes, 3))
    return found


def global_batches(records: list[dict]) -> list[list[int]]:
    """The sample ids of each global batch: with split batches, process r reads slice r of each."""
    return [sum(slices, []) for slices in zip(*(record["batches"] for record in records))]


def draws(records: list[dict]) -> dict:
    """{(epoch, sample id): digest of the input the model received for it}, from every process."""
    seen = {}
    for record in records:
        assert len(record["batches"]) == len(record["inputs"])
        for ids, (epoch, inputs) in zip(record["batches"], record["inputs"]):
            assert len(ids) == len(inputs)
            for sample, (_, digest) in zip(ids, inputs):
                assert (epoch, sample) not in seen, f"sample {sample} read twice in epoch {epoch}"
                seen[epoch, sample] = digest
    return seen


def test_shards_in_object_storage_train_the_same_global_batches_at_1_2_and_3_processes(runs):
    orders = {processes: global_batches(runs[processes][1]) for processes in (1, 2, 3)}
    assert len(orders[1]) == STEPS_PER_EPOCH * EPOCHS and all(len(batch) == BATCH for batch in orders[1])
    assert orders[2] == orders[1], "2 processes trained other global batches than 1"
    assert orders[3] == orders[1], "3 processes trained other global batches than 1"
    epochs = [sum(orders[1][epoch * STEPS_PER_EPOCH:(epoch + 1) * STEPS_PER_EPOCH], []) for epoch in range(EPOCHS)]
    assert all(sorted(epoch) == list(range(TRAIN)) for epoch in epochs), "an epoch is every training sample once"
    assert epochs[0] != epochs[1], "the second epoch repeated the first one's order"
    assert epochs[0] != list(range(TRAIN)), "the samples were not shuffled"


def test_shards_in_object_storage_train_at_the_same_lr_to_the_same_losses_and_weights_at_1_2_and_3_processes(runs):
    """Within float reduction order: the losses of every step within 1e-5 (relative; 1e-6 measured), the weights
    within 1e-4 in every tensor. Real images and AdamW, whose step normalises each coordinate's gradient, carry the
    order of the all-reduce's sums into the coordinates whose gradients are smallest: 1e-5 measured after these 10
    steps in the worst tensor (a conv bias), 1e-7 in most. A process reading one other sample moves them by 1e-3."""
    reference_lr = runs[1][1][0]["step_lr"]
    assert [step for step, _ in reference_lr] == list(range(1, STEPS_PER_EPOCH * EPOCHS + 1))
    one = load_file(str(runs[1][0] / "model.safetensors"))
    for processes in (2, 3):
        assert all(record["step_lr"] == reference_lr for record in runs[processes][1]), processes
        losses = [[line["loss"] for line in read_metrics(runs[n][0], "train")] for n in (1, processes)]
        assert len(losses[0]) == STEPS_PER_EPOCH * EPOCHS and losses[1] == pytest.approx(losses[0], rel=1e-5)
        many = load_file(str(runs[processes][0] / "model.safetensors"))
        assert many.keys() == one.keys()
        for name, tensor in one.items():
            relative = (many[name] - tensor).norm() / tensor.norm()
            assert relative <= 1e-4, f"{name}: {processes} processes differ from 1 by {relative:.2e} (relative)"


def test_evaluation_from_shards_in_object_storage_counts_every_test_sample_once_at_1_2_and_3_processes(runs):
    evaluations = {processes: read_metrics(runs[processes][0], "test") for processes in (1, 2, 3)}
    assert [line["step"] for line in evaluations[1]] == [3, 5, 6, 9, 10]
    for processes, lines in evaluations.items():
        assert [line["num_samples"] for line in lines] == [TEST] * 5, processes
        assert [line["correct"] for line in lines] == [line["correct"] for line in evaluations[1]], processes
        assert [line["loss"] for line in lines] == pytest.approx([line["loss"] for line in evaluations[1]],
                                                                 rel=1e-5), processes


def test_a_shards_run_stopped_mid_epoch_at_2_processes_resumes_at_3_from_the_store_like_the_uninterrupted_run(runs):
    (out, resumed), reference = runs["resumed"], runs[2]
    starts = [(start["world_size"], start["checkpoint_world_size"], start["step"]) for start in read_starts(out)]
    assert starts == [(2, None, 0), (3, 2, STOP_STEP)]
    assert global_batches(resumed) == global_batches(reference[1])[STOP_STEP:], \
        "the resumed run trained other global batches than the uninterrupted one"
    for record in resumed:
        assert record["step_lr"] == reference[1][0]["step_lr"][STOP_STEP:], "another LR than the uninterrupted run"
    weights, uninterrupted = (load_file(str(folder / "model.safetensors")) for folder in (out, reference[0]))
    for name, tensor in uninterrupted.items():
        relative = (weights[name] - tensor).norm() / tensor.norm()
        assert relative <= 1e-5, f"{name}: the resumed run differs by {relative:.2e} (relative)"
    final = [read_metrics(folder, "test")[-1] for folder in (out, reference[0])]
    assert final[0]["num_samples"] == final[1]["num_samples"] == TEST and final[0]["correct"] == final[1]["correct"]


@pytest.fixture(scope="module")
def another_seed(shards_url, tmp_path_factory):
    """The first epoch of the same run with seed 2, in this process: {(epoch, sample id): digest}."""
    tmp = tmp_path_factory.mktemp("seed2")
    record = collections.defaultdict(list)
    with hooks.added(recorders.Run(record), recorders.Inputs(record["inputs"])):
        train_in_process(*RUN, f"data.root={shards_url}", f"data.cache_dir={tmp / 'cache'}", "seed=2",
                         f"train.max_steps={STEPS_PER_EPOCH}", f"output_dir={tmp / 'run'}")
    return draws([record])


def test_each_shard_samples_augmentation_is_drawn_alike_at_1_2_and_3_processes_and_after_a_resume(runs):
    """Every sample's random crop and flip is a function of (seed, epoch, sample id): the input the model receives
    for it is the same bit for bit however the run is split or interrupted."""
    reference = draws(runs[1][1])
    assert len(reference) == EPOCHS * TRAIN
    for name in (2, 3):
        ours = draws(runs[name][1])
        differ = sorted(key for key in reference if ours.get(key) != reference[key])
        assert ours.keys() == reference.keys() and not differ, f"{name} processes: (epoch, id) {differ[:10]} differ"
    resumed = draws(runs["resumed"][1])
    assert len(resumed) == EPOCHS * TRAIN - STOP_STEP * BATCH
    differ = sorted(key for key in resumed if resumed[key] != reference.get(key))
    assert not differ, f"after the resume at 3: (epoch, id) {differ[:10]} drew otherwise"


def test_each_shard_samples_augmentation_is_drawn_anew_for_another_seed_and_another_epoch(runs, another_seed):
    reference = draws(runs[1][1])
    same_seed = sum(another_seed[0, sample] == reference[0, sample] for sample in range(TRAIN))
    same_epoch = sum(reference[0, sample] == reference[1, sample] for sample in range(TRAIN))
    assert len(another_seed) == TRAIN and same_seed < TRAIN / 4, f"seeds 1 and 2 drew {same_seed} of {TRAIN} alike"
    assert same_epoch < TRAIN / 4, f"epochs 0 and 1 drew {same_epoch} of {TRAIN} samples alike"
