"""Reading and comparing run folders: metrics.jsonl, the weights, the checkpoints and starts.jsonl; and the
crash-then-resume that many contracts compare with an uninterrupted run."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from accel_train.run.summaries import TIMING
from support.commands import train_in_process


def read_metrics(output_dir: Path, split: str) -> list[dict]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["split"] == split]


def metrics_without_timing(output_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in line.items() if key not in TIMING} for line in lines]


def assert_same_run(out: Path, reference: Path, weights: tuple[str, ...] = ("model.safetensors",)) -> None:
    """metrics.jsonl line for line (timings aside) and every weights file bit for bit."""
    assert metrics_without_timing(out) == metrics_without_timing(reference)
    assert_same_weights(out, reference, weights)


def assert_same_weights(out: Path, reference: Path, weights: tuple[str, ...] = ("model.safetensors",)) -> None:
    """Every weights file bit for bit."""
    import torch
    from safetensors.torch import load_file

    for name in weights:
        ours, theirs = load_file(str(Path(out) / name)), load_file(str(Path(reference) / name))
        assert ours.keys() == theirs.keys(), name
        assert all(torch.equal(ours[key], theirs[key]) for key in ours), name


def crash_after_checkpoint_then_resume(step: int, recipe: str, *overrides: str, resume: str = "auto",
                                       between: Callable[[], None] | None = None) -> None:
    """Train in this process, fail once the checkpoint of `step` is committed (the loop learns it at its next save,
    or at the end: saves are written in the background), then train again with resume=auto (or the checkpoint
    `resume` names), as a user would after a crash; `between()` runs between the two.

    The second run must have started where that checkpoint left off (assert_resumed_from)."""
    from accel_train import hooks
    from support.faults import Crash, RaiseAfterSave

    with pytest.raises(Crash), hooks.added(RaiseAfterSave(step)):
        train_in_process(recipe, *overrides)
    if between is not None:
        between()
    out = Path(next(arg.split("=", 1)[1] for arg in overrides if arg.startswith("output_dir=")))
    if resume == "auto":
        resumed_from = newest_checkpoint_step(out)
        assert resumed_from == step, f"the newest checkpoint is of step {resumed_from}, not {step}"
    else:
        resumed_from = json.loads((Path(resume) / "checkpoint.json").read_text())["step"]
    before = metrics_lines_before(out, resumed_from)
    train_in_process(recipe, *overrides, f"resume={resume}")
    assert_resumed_from(out, resumed_from, before)


def newest_checkpoint_step(out: Path) -> int:
    """The step of the checkpoint resume=auto takes: the newest save, by checkpoint.json's serial."""
    saved = [json.loads(meta.read_text()) for meta in (Path(out) / "checkpoints").glob("*/checkpoint.json")]
    assert saved, f"no checkpoint in {out}/checkpoints"
    return max(saved, key=lambda meta: meta["serial"])["step"]


def metrics_lines_before(out: Path, step: int) -> list[str]:
    """metrics.jsonl's lines of steps before `step`, as written: a resume from `step` keeps them byte for byte."""
    written = (Path(out) / "metrics.jsonl").read_text().splitlines(keepends=True)
    return lines_before(written, step)


def lines_before(written: list[str], step: int) -> list[str]:
    """The metrics.jsonl lines (as written, with their ends) of steps before `step`."""
    return [line for line in written if json.loads(line)["step"] < step]


def assert_resumed_from(out: Path, step: int, before: list[str]) -> None:
    """The last start of the run in `out` began at `step` (starts.jsonl), and kept the lines `before` it.

    A resume that silently started again from step 0 rewrites metrics.jsonl and can reproduce an uninterrupted
    run line for line and bit for bit: comparing with that run alone cannot tell."""
    started = json.loads((Path(out) / "starts.jsonl").read_text().splitlines()[-1])["step"]
    assert started == step, f"the resumed run started at step {started}, not at its checkpoint's {step}"
    kept = (Path(out) / "metrics.jsonl").read_text().splitlines(keepends=True)[:len(before)]
    assert kept == before, "the resumed run rewrote the lines of metrics.jsonl written before its checkpoint"
