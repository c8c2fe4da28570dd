"""Reading run folders back: the summary of one run, the table of many, the config keys two runs differ in.

Everything here is read from a run's own config.yaml and metrics.jsonl (no torch import), so a run that
is still going, or that died, can be looked at like a finished one.
"""

from __future__ import annotations

import json
from itertools import takewhile
from pathlib import Path

from accel_train.config import flatten
from accel_train.run.layout import read_config, read_lines, read_micro_batch_changes, read_starts

START_FACTS = ("started", "host", "command")  # config.yaml's run.* facts of one start, different every time
# Measured, not computed: they differ between identical runs. data_wait: the share of training time spent waiting
# for the next batch, on the process that waited longest.
TIMING = ("samples_per_s", "data_wait", "elapsed_s", "time")


def eval_metrics(line: dict) -> dict:
    return {k: v for k, v in line.items() if k not in ("split", "epoch", "step", *TIMING)}


def headline_metric(config: dict, eval_lines: list[dict]) -> tuple[str | None, str]:
    """The metric that ranks a run: checkpoint.best_metric when set, else accuracy, else loss; and its mode."""
    checkpoint = config.get("checkpoint") or {}
    if checkpoint.get("best_metric"):
        return checkpoint["best_metric"], checkpoint.get("best_mode", "max")
    reported = {key for line in eval_lines for key in eval_metrics(line)}
    for name, mode in (("accuracy", "max"), ("loss", "min")):
        if name in reported:
            return name, mode
    return (sorted(reported)[0], "max") if reported else (None, "max")


def summarize(folder: Path, name: str | None = None) -> dict:
    """One run: how it ran, how long, how fast, and its best and final evaluations."""
    config, lines = read_config(folder), read_lines(folder)
    run = config.get("run") or {}
    train = [line for line in lines if line["split"] == "train"]
    evals = [line for line in lines if line["split"] != "train"]
    selecting = [line for line in evals if line["split"] == "val"] or evals  # with no val split: the test lines
    metric, mode = headline_metric(config, evals)
    scored = [line for line in selecting if isinstance(line.get(metric), (int, float))]
    best = (max if mode == "max" else min)(scored, key=lambda line: line[metric]) if scored else None
    final = next((line for line in reversed(evals) if line["split"] == "test"), evals[-1] if evals else None)
    starts = read_starts(folder)
    return {
        "name": name or folder.name, "folder": str(folder), "recipe": run.get("recipe"),
        "world_size": run.get("world_size"), "mixed_precision": run.get("mixed_precision"),
        "steps": lines[-1]["step"] if lines else 0, "epochs": lines[-1]["epoch"] + 1 if lines else 0,
        "metric": metric, "mode": mode,
        "best": None if best is None else {"split": best["split"], "step": best["step"], "value": best[metric]},
        "final": None if final is None else {"split": final["split"], "step": final["step"],
                                             "metrics": eval_metrics(final)},
        "wall_s": next((line["elapsed_s"] for line in reversed(lines) if "elapsed_s" in line), None),
        **dict(zip(("samples_per_s", "data_wait"),
                   training_throughput(train, (config.get("train") or {}).get("batch_size")))),
        "skipped_steps": sum(line.get("skipped_steps", 0) for line in train),  # non-finite, on_nonfinite=skip
        "starts": len(starts), "restarts": sum(1 for start in starts if start.get("launcher_restart")),
        "world_size_changes": [{"step": start["step"], "from": start["checkpoint_world_size"],
                                "to": start["world_size"]} for start in starts
                               if start.get("checkpoint_world_size") not in (None, start.get("world_size"))],
        "micro_batch_changes": [{key: change[key] for key in ("step", "from", "to", "processes")}
                                for change in read_micro_batch_changes(folder)],
    }


def named_processes(processes: list[int], world_size: int | None) -> str:
    """`the process` at world size 1, else `process 1` or `processes 1, 2`."""
    if world_size == 1:
        return "the process"
    return f"process{'es' if len(processes) > 1 else ''} {', '.join(map(str, processes))}"


def ran_out(processes: list[int], world_size: int | None) -> str:
    """Who ran out of memory, as the summary says it."""
    return "ran out of memory" if world_size == 1 else f"{named_processes(processes, world_size)} ran out of memory"


def training_throughput(train_lines: list[dict], batch_size: int | None) -> tuple[float | None, float | None]:
    """Samples per second over the whole run, evaluation and checkpoint time left out: every train line's rate
    weighted by the steps it covers (the total samples over the total time); and the share of that time spent
    waiting for data (None where a train line has no data_wait)."""
    steps = seconds = waited = 0.0
    previous, waits = 0, True
    for line in train_lines:
        rate, covered = line.get("samples_per_s"), line["step"] - previous
        previous = line["step"]
        if isinstance(rate, (int, float)) and rate > 0 and covered > 0 and batch_size:
            steps, seconds = steps + covered, seconds + covered * batch_size / rate
            waits = waits and "data_wait" in line
            waited += covered * batch_size / rate * line.get("data_wait", 0.0)
    if not seconds:
        return None, None
    return steps * batch_size / seconds, waited / seconds if waits else None


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"


def number(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def columns(rows: list) -> str:
    """Rows of text cells in fixed-width columns, two spaces apart (the first row is the header)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def table(summaries: list[dict]) -> str:
    """The runs side by side, one row each, in fixed-width columns."""
    header = ["run", "recipe", "procs", "precision", "steps", "metric", "best (step)", "final", "wall", "samples/s",
              "restarts"]
    rows = [header]
    for s in summaries:
        best = f"{number(s['best']['value'])} ({s['best']['step']})" if s["best"] else "-"
        final = number(s["final"]["metrics"].get(s["metric"])) if s["final"] else "-"
        speed = f"{s['samples_per_s']:.0f}" if s["samples_per_s"] else "-"
        rows.append([s["name"], Path(str(s["recipe"])).stem if s["recipe"] else "-", number(s["world_size"]),
                     s["mixed_precision"] or "-", str(s["steps"]), s["metric"] or "-", best, final,
                     duration(s["wall_s"]), speed, str(s["restarts"])])
    return columns(rows)


def config_diff(a: Path, b: Path) -> list[tuple[str, object, object]]:
    """(key, value in a, value in b) for every config key, and every recorded fact of the launch (run.*), that
    differs between two runs; output_dir and the facts of each start (time, host, command), which always do, are
    left out."""
    first, second = flatten(read_config(a)), flatten(read_config(b))
    missing = "(unset)"
    keys = sorted((set(first) | set(second)) - {"output_dir", *(f"run.{fact}" for fact in START_FACTS)})
    return [(key, first.get(key, missing), second.get(key, missing)) for key in keys
            if first.get(key, missing) != second.get(key, missing)]


def diff_table(a: str, b: str, differences: list[tuple[str, object, object]]) -> str:
    if not differences:
        return f"{a} and {b} have the same config"
    rows = [("key", a, b), *((key, json.dumps(x), json.dumps(y)) for key, x, y in differences)]
    return columns(rows)


def run_names(folders: list[Path]) -> list[str]:
    """Short names that still tell the runs apart: their paths below the folder they share."""
    if len(folders) == 1:
        return [folders[0].resolve().name]
    resolved = [folder.resolve() for folder in folders]
    shared = takewhile(lambda parts: len(set(parts)) == 1, zip(*(f.parts for f in resolved)))
    common = Path(*(parts[0] for parts in shared))
    return [str(f.relative_to(common)) if f != common else f.name for f in resolved]
