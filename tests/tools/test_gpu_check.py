"""`make gpu-check` (tools/gpu_check.py) in its CPU dry run: every row of the GPU check runs its commands here, with
tiny sizes, so that none rots between visits to a GPU; the table is printed and written as JSON."""

import json
import sys

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


def test_a_row_that_does_not_exist_is_refused_in_one_line_instead_of_a_check_that_runs_nothing(tmp_path, capsys,
                                                                                                  monkeypatch):
    import importlib.util

    import pytest

    from support.locations import REPO

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look their module up there
    spec.loader.exec_module(gpu_check)

    with pytest.raises(SystemExit) as refused:
        gpu_check.main(["--dry-run", "--out", str(tmp_path), "--only", "host_sync,fsdp"])

    assert refused.value.code == 2 and not (tmp_path / "gpu_check.json").exists()
    assert capsys.readouterr().err == (f"gpu-check: error: --only host_sync,fsdp: no row named host_sync; the rows are "
                                       f"{', '.join(ROWS)}; tools/gpu_check.py --help shows its usage\n")
