"""What a person watching a run sees on the main process: a progress bar (or progress lines without a terminal),
a line per evaluation and checkpoint, one warning when the steps wait for data, and a summary at the end."""

from __future__ import annotations

import logging
import time

from accel_train.console import bar_disabled
from accel_train.data import slow_input_advice
from accel_train.run.layout import TRACKERS_DIR, results_of
from accel_train.run.summaries import duration, ran_out, summarize
from accel_train.state import Observer, Progress, State, across_world_sizes
from accel_train.storage import join

logger = logging.getLogger(__name__)

SLOW_INPUT_SHARE = 0.3  # a train line whose data_wait is above this says which knob feeds the steps faster


class Console(Observer):
    """A tqdm bar over optimizer steps (epoch, loss, lr, samples/s), one line per evaluation, a summary at the end.

    Where stderr is not a terminal (CI, SLURM logs) there is no bar; one progress line every train.progress_every_s
    seconds takes its place. The loss shown is the latest train line's: the console never reads the device.
    """

    def __init__(self) -> None:
        self.bar, self.latest, self.epoch_shown = None, {}, None
        self.said_slow_input = False  # the knob for this data path is said once

    def on_train_start(self, state: State) -> None:
        from tqdm.auto import tqdm

        progress, train = state.progress, state.config.train
        self.progress_every_s = train.progress_every_s
        logger.info(f"{headline(state)}, {progress.total_steps} steps")
        if train.progress_bar:
            # no bar when stderr is not a terminal (the progress lines below take its place) or our lines are silenced
            self.epoch_shown = progress.step // progress.steps_per_epoch
            self.bar = tqdm(total=progress.total_steps, initial=progress.step, unit="step", dynamic_ncols=True,
                            disable=bar_disabled(logger), desc=f"epoch {self.epoch_shown}")
            if self.bar.disable:
                self.bar = None
            elif callable(self.bar.dynamic_ncols):  # tqdm asks it the terminal's width at every refresh
                self.bar.dynamic_ncols = leaving_room_for_an_echo(self.bar.dynamic_ncols)
        self.clock = self.printed_at = time.perf_counter()
        self.first_step = progress.step

    def on_log(self, state: State, logs: dict) -> None:
        self.latest = logs
        if self.bar is not None:
            self.bar.set_postfix_str(progress_terms(logs), refresh=False)
        if logs.get("data_wait", 0.0) > SLOW_INPUT_SHARE and not self.said_slow_input:
            self.said_slow_input = True
            logger.warning(f"{logs['data_wait']:.0%} of the training time up to step {state.progress.step} was spent "
                           f"waiting for data (data_wait in metrics.jsonl); "
                           f"{slow_input_advice(state.config.data, state.data)}")

    def on_step_end(self, state: State) -> None:
        progress = state.progress
        if self.bar is not None:
            if self.epoch_shown != progress.epoch:
                self.epoch_shown = progress.epoch
                self.bar.set_description(f"epoch {progress.epoch}", refresh=False)
            self.bar.update(1)
        elif self.progress_every_s and time.perf_counter() - self.printed_at >= self.progress_every_s:
            self.printed_at = time.perf_counter()
            logger.info(self.progress_line(progress))

    def progress_line(self, progress: Progress) -> str:
        done = progress.step - self.first_step
        seconds = time.perf_counter() - self.clock
        left = (progress.total_steps - progress.step) * seconds / done if done else None
        terms = progress_terms(self.latest)
        return (f"epoch {progress.epoch} step {progress.step}/{progress.total_steps} "
                f"({100 * progress.step / progress.total_steps:.0f}%){', ' + terms if terms else ''}; "
                f"{duration(progress.elapsed_s())} elapsed, {duration(left)} left")

    def on_eval(self, state: State, metrics: dict, split: str) -> None:
        logger.info(f"epoch {state.progress.epoch} step {state.progress.step} {split}: {shown(metrics)}")

    def on_train_end(self, state: State) -> None:
        self.close()
        logger.info(summary_block({**summarize(state.place.folder), "folder": state.config.output_dir},
                                  results(state), watch(state)))

    def close(self) -> None:
        """The bar is left as it stands, and what follows (the summary, a stop or error line) starts a line."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def headline(state: State) -> str:
    """What is trained, on what, by how many processes, where; a resume at another world size; a restart."""
    config, launch = state.config, state.launch
    change = state.start.world_size_change(launch["world_size"])
    restart, max_restarts = state.restart
    return (f"training {config.model.name} on {config.data.name}: {launch['world_size']} process(es), "
            f"{f'{change}, ' if change else ''}{launch['device']}, mixed precision {launch['mixed_precision']}"
            f"{f', restart {restart} of at most {max_restarts} by the launcher' if restart else ''}")


def results(state: State) -> list[str]:
    """The files the finished run left in its output_dir (a best model only once there was one)."""
    config = state.config
    listed = results_of(ema=bool(config.train.ema_decay), best=bool(config.checkpoint.best_metric),
                        curves=config.train.plot, classes=state.data.classes is not None,
                        checkpoints=bool(config.checkpoint.at_epoch_end or config.checkpoint.every_steps),
                        tracking=bool(state.trackers))
    return [name for name in listed if (state.place.folder / name.rstrip("/")).exists()]


def watch(state: State) -> str | None:
    """How to watch the run's curves live, where a tracker offers a command for it."""
    logs = join(state.config.output_dir, TRACKERS_DIR)
    return f"tensorboard --logdir {logs}" if "tensorboard" in state.trackers else None


def leaving_room_for_an_echo(terminal_size):
    """A bar 2 columns short of the terminal: the terminal echoes Ctrl-C as "^C" after the bar, and on a full-width
    bar that echo wraps to a new line, so tqdm then clears that line and leaves a stale copy of the bar above."""
    def size(stream) -> tuple[int | None, int | None]:
        columns, rows = terminal_size(stream)
        return (max(1, columns - 2) if columns else columns), rows

    return size


def summary_block(summary: dict, files: list[str], watch: str | None) -> str:
    """What a user wants to know when a run ends: how long, how fast, how good, and where its files are."""
    folder = summary["folder"]
    speed = f"{summary['samples_per_s']:.0f} samples/s while training" if summary["samples_per_s"] else "no train line"
    if summary["data_wait"] is not None:
        speed += f", {summary['data_wait']:.0%} of it waiting for data"
    lines = [f"done: {summary['steps']} steps, {summary['epochs']} epoch(s), {summary['world_size']} process(es), "
             f"mixed precision {summary['mixed_precision']}",
             f"  wall time  {duration(summary['wall_s'])} ({speed})"]
    if summary["best"]:
        best = summary["best"]
        lines.append(f"  best       {best['split']} {summary['metric']} {best['value']:.4f} at step {best['step']}")
    if summary["final"]:
        final = summary["final"]
        lines.append(f"  final      {final['split']} {shown(final['metrics'])} (step {final['step']})")
    if summary.get("skipped_steps"):
        lines.append(f"  skipped    {summary['skipped_steps']} of {summary['steps']} steps, non-finite: no process "
                     "applied them (train.on_nonfinite=skip; the warnings above name them)")
    if summary["restarts"]:
        lines.append(f"  restarts   {summary['restarts']} by the launcher after a process failed; each resumed from "
                     "the newest checkpoint (starts.jsonl)")
    for change in summary["world_size_changes"]:
        lines.append(f"  resumed    {across_world_sizes(change['to'], change['from'])}, at step {change['step']} "
                     "(starts.jsonl)")
    for change in summary["micro_batch_changes"]:
        lines.append(f"  memory     {ran_out(change['processes'], summary['world_size'])} at step {change['step']}: "
                     f"{change['from']} -> {change['to']} samples per micro-batch, the same global batch "
                     "(starts.jsonl)")
    lines.append(f"  files      {folder}/: {', '.join(files)}")
    if watch:
        lines.append(f"  watch      {watch}")
    return "\n".join(lines)


def progress_terms(logs: dict) -> str:
    """What the bar and the progress lines show of the latest train line: the loss, the LR and the speed."""
    shown_as = {"loss": "loss {:.4f}", "lr": "lr {:.3g}", "samples_per_s": "{:.0f} samples/s"}
    return ", ".join(text.format(logs[key]) for key, text in shown_as.items() if key in logs)


def shown(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
