"""Features that hook into the training loop at named points instead of being inlined in it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from accelerate import Accelerator

from accel_train.config import Config, save_config
from accel_train.distributed import run_info

METRICS_FILE = "metrics.jsonl"


@dataclass
class RunState:
    """What hooks may read (and `should_stop`, which they may set) while training runs."""

    config: Config
    accelerator: Accelerator
    steps_per_epoch: int
    total_steps: int
    epoch: int = 0
    step: int = 0  # optimizer steps taken
    should_stop: bool = False
    last_eval: dict = field(default_factory=dict)
    resumed_metrics_lines: Optional[int] = None  # lines of metrics.jsonl the resumed checkpoint had seen

    @property
    def output_dir(self) -> Path:
        return Path(self.config.output_dir)


class Hook:
    def on_train_start(self, run: RunState) -> None: ...
    def on_log(self, run: RunState, logs: dict) -> None: ...
    def on_step_end(self, run: RunState) -> None: ...
    def on_eval(self, run: RunState, metrics: dict) -> None: ...
    def on_train_end(self, run: RunState) -> None: ...


class Hooks:
    def __init__(self, hooks: list[Hook]) -> None:
        self.hooks = hooks

    def fire(self, event: str, *args: Any) -> None:
        for hook in self.hooks:
            getattr(hook, event)(*args)


class TrainMeter:
    """Accumulates train terms on the device; averages them over all processes only when a line is due."""

    def __init__(self, accelerator: Accelerator, global_batch: int) -> None:
        self.accelerator, self.global_batch = accelerator, global_batch
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.steps, self.started = 0, time.perf_counter()
        self.last_update = self.started

    def update(self, terms: dict[str, torch.Tensor]) -> None:
        for name, value in terms.items():
            value = value.detach().float()
            self.sums[name] = self.sums[name] + value if name in self.sums else value
        self.steps += 1
        self.last_update = time.perf_counter()

    def exclude_time_since_last_step(self) -> None:
        """Keep evaluation (or checkpointing) out of samples_per_s."""
        self.started += time.perf_counter() - self.last_update

    def compute(self) -> dict[str, float]:
        names = sorted(self.sums)
        logs = {}
        if names:  # every step since the last line may have been skipped (train.on_nonfinite=skip)
            local_means = torch.stack([self.sums[name] for name in names]) / self.steps
            logs = dict(zip(names, self.accelerator.reduce(local_means, reduction="mean").tolist()))
        elapsed = time.perf_counter() - self.started
        logs["samples_per_s"] = self.steps * self.global_batch / elapsed if elapsed > 0 else float("nan")
        self._reset()
        return logs


class RunFolder(Hook):
    """Writes config.yaml (resolved config + launch facts) and metrics.jsonl into output_dir.

    A resumed run keeps the lines its checkpoint had seen and appends, so metrics.jsonl reads as if the
    run had never stopped (lines written after that checkpoint, by the run that died, are dropped).
    """

    def on_train_start(self, run: RunState) -> None:
        run.output_dir.mkdir(parents=True, exist_ok=True)
        save_config(run.config, run.output_dir / "config.yaml", run_info(run.accelerator))
        path = run.output_dir / METRICS_FILE
        if run.resumed_metrics_lines is not None and path.is_file():
            kept = path.read_text().splitlines(keepends=True)[:run.resumed_metrics_lines]
            path.write_text("".join(kept))
            self.metrics = open(path, "a", buffering=1)
        else:
            self.metrics = open(path, "w", buffering=1)

    def on_log(self, run: RunState, logs: dict) -> None:
        self._write({"split": "train", "epoch": run.epoch, "step": run.step, **logs})

    def on_eval(self, run: RunState, metrics: dict) -> None:
        self._write({"split": "eval", "epoch": run.epoch, "step": run.step, **metrics})

    def on_train_end(self, run: RunState) -> None:
        self.metrics.close()

    def _write(self, line: dict) -> None:
        self.metrics.write(json.dumps(line) + "\n")


class Console(Hook):
    """A tqdm bar over optimizer steps with the latest train terms, and one line per evaluation."""

    def __init__(self, progress_bar: bool) -> None:
        self.progress_bar = progress_bar
        self.bar = None

    def on_train_start(self, run: RunState) -> None:
        from tqdm.auto import tqdm

        info = run_info(run.accelerator)
        print(f"training {run.config.model.name} on {run.config.data.name}: {info['world_size']} process(es), "
              f"{info['device']}, mixed precision {info['mixed_precision']}, {run.total_steps} steps", flush=True)
        if self.progress_bar:
            # disable=None: no bar when stderr is not a terminal (CI logs), eval lines still print.
            self.bar = tqdm(total=run.total_steps, unit="step", dynamic_ncols=True, disable=None)

    def on_log(self, run: RunState, logs: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in logs.items()}, refresh=False)

    def on_step_end(self, run: RunState) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_eval(self, run: RunState, metrics: dict) -> None:
        shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        (self.bar.write if self.bar is not None else print)(f"epoch {run.epoch} step {run.step} eval: {shown}")

    def on_train_end(self, run: RunState) -> None:
        if self.bar is not None:
            self.bar.close()
        summary = ", ".join(f"{k} {run.last_eval[k]:.4f}" for k in ("accuracy", "loss") if k in run.last_eval)
        print(f"done: {run.step} steps; final eval {summary}; config, metrics and model.safetensors in "
              f"{run.output_dir}", flush=True)


def default_hooks(config: Config, accelerator: Accelerator, task_hooks: Sequence[Hook] = ()) -> Hooks:
    from accel_train.checkpoint import Checkpointer

    # Only the main process prints and writes run files; checkpointing is collective, so it runs on every
    # process, and last, so a checkpoint includes the lines the other hooks just logged.
    main_only = [RunFolder(), Console(config.train.progress_bar), *task_hooks] if accelerator.is_main_process else []
    return Hooks([*main_only, Checkpointer(config, accelerator)])
