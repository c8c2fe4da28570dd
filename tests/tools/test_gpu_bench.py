"""`make gpu-bench` (tools/gpu_bench.py) in its CPU dry run: every row of the GPU bench runs its commands here, with
tiny sizes, so that none rots between visits to a GPU; the table is printed and written as JSON with the goals."""

import json

from support.commands import PYTHON, run_command

ROWS = ["install", "small_models", "time_to_accuracy", "resnet18_flops", "jpeg_decoding", "jpeg_end_to_end",
        "vit_b16_peer"]


def test_the_gpu_benchs_dry_run_runs_every_row_on_the_cpu_and_writes_its_numbers_and_goals_as_json(tmp_path):
    result = run_command([PYTHON, "tools/gpu_bench.py", "--dry-run", "--out", str(tmp_path)], timeout=1800,
                         check=False, env={"OUT": ""})
    table = json.loads((tmp_path / "gpu_bench.json").read_text())
    rows = {row["row"]: row for row in table["rows"]}
    assert list(rows) == ROWS and table["dry_run"] and table["goals"]["fashion_mnist_accuracy"] == 0.934
    for name, row in rows.items():
        assert row["result"] == "ok", f"{name}: {row['result']}: {row['note']}"
        assert row["commands"] and row["numbers"], name  # it ran, and measured
        assert name in result.stdout  # the printed table
    assert {"ratio_64", "ratio_256", "compiled_ratio_64"} <= set(rows["small_models"]["numbers"])
    assert 0 < rows["time_to_accuracy"]["numbers"]["accuracy"] <= 1 and rows["time_to_accuracy"]["numbers"]["curve"]
    assert rows["resnet18_flops"]["numbers"]["achieved_tflops"] > 0
    assert rows["jpeg_decoding"]["numbers"]["cpu_one_core"] > 0
    assert rows["jpeg_end_to_end"]["numbers"]["samples_per_s"] > 0
    assert rows["vit_b16_peer"]["numbers"]["ratio"] > 0
    assert result.returncode == 0, result.stdout[-3000:]
