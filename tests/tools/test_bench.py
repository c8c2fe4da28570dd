"""Contract of `accel-train bench`: it runs end to end and leaves well-formed bench.json / bench.md.

The numbers are not checked: timings belong to the bench, not to tests."""

import json
import math

import pytest
import torch

from support.commands import run_cli
from support.locations import needs_fashion_mnist
from support.runs import read_metrics

TINY = ["data.synthetic=true", "data.train_subset=64", "data.eval_subset=16", "train.batch_size=8",
        "train.eval_batch_size=16", "data.num_workers=1"]


def test_bench_quick_writes_json_and_markdown_with_every_section(tmp_path):
    result = run_cli("bench", "--quick", "--steps", "2", "--processes", "2", "fashion_mnist_fast", *TINY,
                     f"output_dir={tmp_path}", timeout=600)
    bench = json.loads((tmp_path / "bench.json").read_text())
    numbers = [bench["overhead"]["ratio"], bench["input_pipeline"]["ratio"], bench["flops"]["achieved_tflops"],
               bench["flops"]["peak_tflops"], bench["flops"]["utilisation"], bench["cli_help_s"]]
    assert all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in numbers), numbers
    one, two, mixed = bench["scaling"]
    assert (one["processes"], two["processes"], mixed["processes"]) == (1, 2, 2)
    assert one["status"] == two["status"] == "ok" and one["efficiency"] == 1.0
    assert two["samples_per_s"] > 0 and two["epoch_s"] > 0
    # the share of step time spent waiting for data, the figure train lines carry, for every training row
    waits = [bench["overhead"]["ours_data_wait"], *(row["data_wait"] for row in (one, two, mixed))]
    assert all(isinstance(wait, float) and 0 <= wait <= 1 for wait in waits), waits
    assert mixed["mixed_precision"] == "bf16" and mixed["status"] == "ok"  # measured on CPU too (autocast)
    assert {"cpu", "cpu_cores", "torch", "accelerate"} <= set(bench["machine"])
    assert set(bench["targets"]) == {"overhead_ratio", "input_pipeline_ratio", "cli_help_s"}
    markdown = (tmp_path / "bench.md").read_text()
    assert markdown in result.stdout
    for heading in ("overhead", "input pipeline", "scaling efficiency", "waiting for data", "utilisation",
                    "accel-train --help"):
        assert heading in markdown
    tables = [line for line in markdown.splitlines() if line.startswith("|")]
    assert all(line.count("|") == tables[0].count("|") for line in tables[:5])  # first table: 4 columns each row


@needs_fashion_mnist
def test_bench_shards_reads_the_same_images_six_ways_and_counts_the_bytes_each_took_from_the_store(object_store,
                                                                                                  tmp_path):
    """`accel-train bench --shards s3://...`: one epoch of the same 600 Fashion-MNIST images from shards in the store
    with a cold and a warm cache, from an ImageFolder tree, from shards of the recipe's data as PNG files and as raw
    pixels on local disk, and through webdataset's loader. The cold epoch takes every block of the training shards
    from the store once, the warm one nothing, webdataset every shard whole."""
    from accel_train.data.shards.dataset import read_index
    from accel_train.storage import Store

    url = object_store.url("bench")
    result = run_cli("bench", "--shards", url, "fashion_mnist_cnn", f"data.root={tmp_path / 'fashion_mnist'}",
                     "data.train_subset=600", "data.eval_subset=100", "train.batch_size=50", "data.num_workers=1",
                     f"output_dir={tmp_path / 'bench'}", timeout=600)
    bench = json.loads((tmp_path / "bench" / "bench_shards.json").read_text())
    rows = {row["source"]: row for row in bench["rows"]}
    stored = "shards of the recipe's data as {} on local disk, warm cache, the recipe's transforms"
    assert list(rows) == ["shards from the store, cold cache", "shards from the store, warm cache",
                          "ImageFolder tree on local disk", stored.format("PNG files (images=as_given)"),
                          stored.format("raw pixels (images=raw)"), "webdataset's own loader over the same shards"]
    assert all(row["samples_per_s"] > 0 and row["samples"] > 0 for row in rows.values())
    index = read_index(Store(url), "train")
    assert index.samples == bench["train_samples"] == 600
    blocks = sum(shard.end - shard.offsets[0] for shard in index.shards)
    assert [row["store_bytes"] for row in rows.values()] == [blocks, 0, 0, 0, 0, index.bytes]
    assert (tmp_path / "bench" / "bench_shards.md").read_text() in result.stdout
    # its scratch (the ImageFolder tree, local shards, caches) went with it: only the results stay
    assert sorted(path.name for path in (tmp_path / "bench").iterdir()) == ["bench_shards.json", "bench_shards.md"]


def test_bench_shards_refuses_a_window_too_short_to_time_rather_than_report_it():
    """Batches the workers made before the clock started would count as read in no time (532,650 samples/s)."""
    from accel_train.errors import UserError
    from accel_train.tools.bench_shards import _timed

    batches = [(torch.zeros(8, 1, 4, 4), torch.zeros(8))] * 12
    assert _timed(iter(batches), None, workers=1)[1] == 10 * 8
    with pytest.raises(UserError, match="9 batch\\(es\\) to time after the 2 of warm-up, fewer than the 16 a window "
                                        "needs with 2 DataLoader worker"):
        _timed(iter(batches[:11]), None, workers=2)


def test_bench_saves_times_a_synchronous_save_and_a_background_one_into_the_store(object_store):
    url = object_store.url("saves")
    result = run_cli("bench", "--saves", "--saves-into", url, "mnist_cnn")
    lines = result.stdout.splitlines()
    synchronous = [line for line in lines if line.startswith("synchronous save (save_state, flushed, uploaded): ")]
    background = [line for line in lines if line.startswith("background save: training blocked ")]
    assert len(synchronous) == len(background) == 1, result.stdout[-2000:]
    assert "% of the synchronous save; the run's first save " in background[0]
    assert "written and uploaded in " in background[0] and "(medians of 3)" in background[0]
    uploaded = {path.split("/")[2] for path in object_store.fs().find(f"{object_store.bucket}/saves")}
    assert {"sync-0", "sync-1", "sync-2", "background"} <= uploaded, uploaded  # both ways reached the store


def test_bench_saves_into_without_saves_is_one_line_instead_of_the_whole_bench_ignoring_it(tmp_path):
    result = run_cli("bench", "--saves-into", str(tmp_path / "saves"), check=False)
    assert result.returncode == 2 and result.stdout == "", result.stdout[-2000:]
    assert result.stderr.strip() == (f"accel-train: error: bench: --saves-into {tmp_path / 'saves'} goes with --saves "
                                     "(the save benchmark); add --saves, or leave it out")


def test_bench_runs_the_model_at_the_recipes_image_size_on_the_models_device_in_the_plain_loop_and_the_flop_count():
    """STL-10's 96 px images resized to data.image_size, as training sees them: the overhead ratio and the FLOP/s
    compare the same work. Every input the model gets is on its parameters' device (on a GPU: the GPU)."""
    from torchvision.models import ResNet

    from accel_train.config import load_config
    from accel_train.tools.bench import flops, plain_loop

    config = load_config("stl10_resnet18", ["data.synthetic=true", "data.train_subset=8", "data.image_size=64",
                                            "data.augment=false", "train.batch_size=4", "train.log_every_steps=1",
                                            "train.warmup_steps=0"])
    seen = set()

    def record(module, args):
        if isinstance(module, ResNet):
            seen.add((tuple(args[0].shape[1:]), args[0].device == next(module.parameters()).device))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        plain_loop(config)
        assert seen == {((3, 64, 64), True)}, seen
        seen.clear()
        flops(config, samples_per_s=1.0, peak_tflops=1.0, quick=True, log=print)
        assert seen == {((3, 64, 64), True)}, seen
    finally:
        handle.remove()


def test_bench_saves_steps_the_model_where_prepare_put_it():
    """On a GPU, accelerator.prepare has moved the model there: the step that makes the optimizer's state feeds it
    inputs on that device, not the CPU's. The meta device stands in for the GPU here."""
    from accel_train.tools.bench_saves import first_step
    from accel_train.workloads.models import MnistCNN

    model = MnistCNN(10, (3, 32, 32)).to("meta")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first_step(model, optimizer, 32)
    assert all(state["momentum_buffer"].device.type == "meta" for state in optimizer.state.values())


def test_the_overhead_run_on_synthetic_data_is_one_epoch_so_no_evaluation_or_checkpoint_falls_inside_a_window(
        tmp_path):
    """The plain loop it is compared with neither evaluates nor saves: FakeData's 512 images (4 steps of 128) would
    put an epoch's end, its evaluation and its checkpoint, inside each timed window of ours."""
    run_cli("bench", "--overhead", "--quick", "--steps", "2", "fashion_mnist_fast", "data.synthetic=true",
            "train.batch_size=128", "data.eval_subset=16", "data.num_workers=1", f"output_dir={tmp_path}", timeout=600)
    run = tmp_path / "runs" / "overhead_0"
    assert [line["step"] for line in read_metrics(run, "train")] == [2, 4, 6, 8]
    evaluated = [line["step"] for split in ("val", "test") for line in read_metrics(run, split)]
    assert evaluated and set(evaluated) == {8}, evaluated  # at the run's end only


@pytest.mark.processes  # machine_info: platform.processor() runs uname -p
def test_bench_hub_times_hugging_faces_example_loop_and_ours_on_the_same_model_and_data(tmp_path, capsys):
    """The numbers are not judged (docs/performance.md has them); both loops run, on the same hf: model and data."""
    from accel_train import cli
    from support.hub import COLOURS, as_parquet_repository, colour_dataset, tiny_vit

    model = tiny_vit(tmp_path / "vit", list(COLOURS))
    data = as_parquet_repository(colour_dataset({"train": (tuple(COLOURS), 8), "validation": (("red",), 2)}),
                                 tmp_path / "data")
    cli.main(["bench", "--hub", "--quick", "--steps", "1", f"model.name=hf:{model}", f"data.name=hf:{data}",
              "train.batch_size=4", "data.num_workers=0", f"output_dir={tmp_path / 'bench'}"])

    result = json.loads((tmp_path / "bench" / "bench_hub.json").read_text())
    assert result["ours_samples_per_s"] > 0 and result["example_samples_per_s"] > 0
    assert result["ratio"] == pytest.approx(result["ours_samples_per_s"] / result["example_samples_per_s"])
    assert (result["model"], result["data"], result["image_size"]) == (f"hf:{model}", f"hf:{data}", 16)
    assert capsys.readouterr().out.splitlines()[-1].startswith("bench --hub: accel-train ")


@pytest.mark.processes  # machine_info: platform.processor() runs uname -p
def test_bench_dropout_times_keyed_and_torchs_dropout_eager_and_compiled(tmp_path):
    """The numbers are not judged (docs/performance.md has them): each row ran, keyed and torch's alike."""
    from accel_train import cli

    cli.main(["bench", "--dropout", "--quick", "--steps", "1", f"output_dir={tmp_path}"])
    rows = json.loads((tmp_path / "bench_dropout.json").read_text())["rows"]
    assert [(row["workload"].split(" (")[0], row["compiled"]) for row in rows] == [
        ("demo CNN", False), ("demo CNN", True), ("ViT-B-sized blocks", False), ("ViT-B-sized blocks", True)]
    assert all(row["keyed_samples_per_s"] > 0 and row["torch_samples_per_s"] > 0 for row in rows)
