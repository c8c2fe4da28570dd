"""The run folder (output_dir): checked before any work, and one owner of its config.yaml and metrics.jsonl."""

from __future__ import annotations

import json
import shlex
import socket
import sys
from contextlib import contextmanager
from datetime import datetime
from itertools import takewhile
from pathlib import Path

from accel_train.config import CONFIG_FILE, Config, save_config
from accel_train.distributed.environment import launcher_environment
from accel_train.errors import UserError, writing
from accel_train.run.layout import (
    CLASSES_FILE,
    CURVES_FILE,
    METRICS_FILE,
    MICRO_BATCH_CHANGE,
    STARTS_FILE,
    checkpoints_dir,
    held_results,
)
from accel_train.run.place import RunPlace
from accel_train.run.resume import resume_folder
from accel_train.state import Observer, Progress, ResumePoint, State


@contextmanager
def refusals_leave_no_folder(place: RunPlace):
    """A run refused before it wrote anything (weights that do not fit, a loader setting refused once the data is
    known) leaves no empty output_dir behind: the folders made for it are removed again where still empty (rmdir
    removes nothing else), deepest first. A run folder in a store leaves no staging after any refusal or failure (the
    store holds what the run committed; the next start pulls it)."""
    folder = place.folder
    made = [path for path in takewhile(lambda path: not path.exists(), [folder, *folder.parents])]
    try:
        yield
    except UserError:
        place.discard()
        for path in made:
            try:
                path.rmdir()
            except OSError:  # not empty: something was written there, or another process is using it
                break
        raise


def check_output_dir(config: Config, place: RunPlace) -> None:
    """Before any data loads: output_dir is a folder this process can write, and a run's results already there
    are continued (resume=auto), never silently overwritten (HF Trainer refuses a non-empty output_dir too)."""
    folder = place.make_folder(config.output_dir)
    continues = config.resume == "auto" or (config.resume is not None and resume_folder(
        config, place).resolve().parent == checkpoints_dir(folder).resolve())
    held = held_results(folder)
    if held and not continues:
        how = "add resume=auto to continue it" if config.resume is None else \
            f"resume={config.resume} is not one of its checkpoints, so its results would be overwritten"
        if launcher_environment().restart:
            raise UserError(f"the launcher restarted the processes after a failure (--max_restarts), but resume is not "
                            f"auto, so this restart would overwrite output_dir={config.output_dir}: launch with "
                            "resume=auto so that restarts continue from the newest checkpoint")
        raise UserError(f"output_dir={config.output_dir} already holds a run ({', '.join(held)}): {how}, or pass a "
                        "new output_dir (delete this one to start over)")


def now() -> str:
    """The wall clock as the run's files record it: ISO 8601 to the second, with the UTC offset."""
    return datetime.now().astimezone().isoformat(timespec="seconds")


def command_line() -> str:
    """This process's command line, as a shell would take it (`python -m accel_train` for the module)."""
    program = Path(sys.argv[0]).name
    return shlex.join([*(["python", "-m", "accel_train"] if program == "__main__.py" else [program]), *sys.argv[1:]])


def lines_up_to(lines: list[str], point: ResumePoint) -> list[str]:
    """The lines of metrics.jsonl that a checkpoint had seen: up to its step, with that step's eval line only if
    the checkpoint followed the evaluation. A line cut short by a crash ends the file there."""
    kept = []
    for text in lines:
        try:
            line = json.loads(text)
        except ValueError:
            break
        after_the_save = line["step"] == point.step and line["split"] != "train" and not point.evaluated
        if line["step"] > point.step or after_the_save:
            break
        kept.append(text if text.endswith("\n") else text + "\n")
    return kept


class RunFolder(Observer):
    """config.yaml (the resolved config and how the run was launched), metrics.jsonl and starts.jsonl, on the main
    process.

    A run resumed from one of its own checkpoints keeps the lines that checkpoint had seen and appends, so
    metrics.jsonl reads as if the run had never stopped (lines the run that died wrote after it are dropped).
    starts.jsonl is the run's history instead: every start adds a line and none is dropped, so restarts show; so does
    every halving of the micro-batch after running out of memory (micro_batch_size=auto).
    """

    def on_train_start(self, state: State) -> None:
        config, start = state.config, state.start
        self.folder, self.place = state.place.folder, state.place
        path = self.folder / METRICS_FILE
        started, host = now(), socket.gethostname()
        with writing(self.folder, "writing config.yaml and metrics.jsonl"):
            save_config(config, self.folder / CONFIG_FILE,
                        {"started": started, "host": host, "command": command_line(), **state.launch})
            if state.data.classes is not None:
                (self.folder / CLASSES_FILE).write_text(json.dumps(state.data.classes, indent=1) + "\n")
            continued = start.in_output_dir and path.is_file()
            if continued:
                path.write_text("".join(lines_up_to(path.read_text().splitlines(keepends=True), start)))
            self.metrics = open(path, "a" if continued else "w", buffering=1)
            line = {"time": started, "host": host, "step": state.progress.step,
                    "world_size": state.launch["world_size"], "launcher_restart": state.restart[0],
                    "checkpoint_world_size": start.saved_world_size,
                    "micro_batch_size": micro_batch_size(config, state.launch["world_size"])}
            # History is kept wherever the run continues, even when no checkpoint was there to resume from.
            keep = start.in_output_dir or config.resume == "auto"
            with open(self.folder / STARTS_FILE, "a" if keep else "w") as starts:
                starts.write(json.dumps(line) + "\n")
        self._sync()

    def on_log(self, state: State, logs: dict) -> None:
        self._write({"split": "train", "epoch": state.progress.epoch, "step": state.progress.step, **logs},
                    state.progress)

    def on_micro_batch_change(self, state: State, change: dict) -> None:
        with writing(self.folder / STARTS_FILE, "writing starts.jsonl"), open(self.folder / STARTS_FILE, "a") as starts:
            starts.write(json.dumps({"time": now(), **change, "event": MICRO_BATCH_CHANGE}) + "\n")
        self._sync()

    def on_eval(self, state: State, metrics: dict, split: str) -> None:
        self._write({"split": split, "epoch": state.progress.epoch, "step": state.progress.step, **metrics},
                    state.progress)

    def on_train_end(self, state: State) -> None:
        from accel_train.run.plots import plot_runs

        self.metrics.close()
        if not state.config.train.plot:
            return
        with writing(self.folder / CURVES_FILE, "drawing curves.png"):
            plot_runs([self.folder], self.folder / CURVES_FILE, [self.folder.name])

    def _write(self, line: dict, progress: Progress) -> None:
        """A line with when it was written: the wall clock, and the run's seconds over all its resumes."""
        when = {"time": now(), "elapsed_s": round(progress.elapsed_s(), 3)}
        with writing(self.metrics.name, "writing metrics.jsonl"):
            self.metrics.write(json.dumps({**line, **when}) + "\n")
        self._sync()

    def _sync(self) -> None:
        """A run folder in a store gets the new lines within SYNC_EVERY_S (and before each checkpoint commits)."""
        self.place.sync_soon()


def micro_batch_size(config: Config, world_size: int) -> int:
    """Samples a process per forward pass: as given, as micro_batch_size=auto found it or a resume restored it, or
    from the accumulation steps."""
    train = config.train
    if isinstance(train.micro_batch_size, int):
        return train.micro_batch_size
    return train.batch_size // world_size // train.accumulation_steps
