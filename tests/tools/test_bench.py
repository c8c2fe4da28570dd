"""Contract of `accel-train bench`: it runs end to end and leaves well-formed bench.json / bench.md.

The numbers are not checked: timings belong to the bench, not to tests."""

import json
import math

from support.commands import run_cli

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
