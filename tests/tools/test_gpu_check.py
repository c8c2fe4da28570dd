"""`make gpu-check` (tools/gpu_check.py) in its CPU dry run: every row of the GPU check runs its commands here, with
tiny sizes, so that none rots between visits to a GPU; the table is printed and written as JSON."""

import json

from support.commands import PYTHON, run_command

ROWS = ["install", "demo_bf16", "demo_fp16", "torchrun_nccl", "host_syncs", "loop_overhead", "out_of_memory",
        "background_save", "compile_on_off", "fsdp", "gpu_vs_cpu", "test_suite"]
DATA_PATHS = ["on_device", "dataloader_workers", "imagefolder", "shards", "user_dataset", "ema", "mixup_cutmix",
              "accumulation", "lr_schedule", "fp16"]


def test_the_gpu_checks_dry_run_runs_every_row_on_the_cpu_and_writes_its_table_as_json(tmp_path):
    result = run_command([PYTHON, "tools/gpu_check.py", "--dry-run", "--out", str(tmp_path)], timeout=1800,
                         check=False, env={"OUT": ""})
    table = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {row["row"]: row for row in table["rows"]}
    assert list(rows) == ROWS and table["dry_run"]
    for name, row in rows.items():
        assert row["result"] == "ok", f"{name}: {row['result']}: {row['note']}"
        assert row["commands"] and row["numbers"], name  # it ran, and measured
        assert name in result.stdout  # the printed table
    # On the CPU the host-syncs row counts host reads of tensor values: none on a step that does not log, any path.
    assert rows["host_syncs"]["numbers"] == dict.fromkeys(DATA_PATHS, 0)
    assert rows["loop_overhead"]["numbers"]["bench_precision"] == "bf16"  # both loops at the launch's precision
    assert rows["test_suite"]["numbers"]["passed"] > 0 and rows["test_suite"]["numbers"]["failed"] == 0
    assert result.returncode == 0, result.stdout[-3000:]
