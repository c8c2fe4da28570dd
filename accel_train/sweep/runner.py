"""The sweep: every check before any trial, then the trial a stopped sweep left running, then new trials until N
are done (complete, pruned or failed), then the summary.

One trial runs at a time, under the launch command, so a trial may use every process of the machines. The sweep
holds a lock on its folder that the trial's processes inherit: a second sweep in the same folder is refused, and
a sweep run again after a kill waits for the old trial to finish saving before it resumes it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from accel_train.config import Config
from accel_train.config.trust import TRUST_FLAG, check_code
from accel_train.errors import NothingCompleted, Preempted, UserError
from accel_train.run.place import RunPlace
from accel_train.run.summaries import duration
from accel_train.sweep import results
from accel_train.sweep.results import SWEEP_FILE
from accel_train.sweep.space import Parameter, check_space, spell
from accel_train.sweep.study import finished, new_trial, open_study, tell, unfinished
from accel_train.sweep.trial import LOGS_DIR, TrialProcess, launch_prefix, trial_folder, trial_log

logger = logging.getLogger(__name__)

LOCK_FILE = "sweep.lock"
POLL_S = 0.5
FAILED_BEFORE_GIVING_UP = 3  # failed trials with none complete: the setup is broken, not the values
OLD_TRIAL_WAIT_S = 300.0  # a killed sweep's trial saves its checkpoint before the lock is free
# What a study is a study of: a rerun that changes any of these would mix trials of two searches.
IDENTITY = ("recipe", "search", "fixed", "metric", "direction", "seed", "startup_trials", "pruner")


@dataclass
class Sweep:
    recipe: str
    parameters: list[Parameter]
    fixed: list[str]
    metric: str
    direction: str  # max, min
    seed: int
    startup_trials: int
    pruner: str  # median, none
    trials: int
    place: RunPlace  # the sweep's folder (for a URL, mirrored whole from this machine's staging)
    launch: str | None = None
    given_direction: bool = field(default=True, repr=False)
    trust_code: bool = field(default=False, repr=False)  # --trust-code, passed on to each trial: not the study's

    @property
    def folder(self) -> Path:
        return self.place.folder

    def shown(self, text: str | Path) -> str:
        """A path (or a line naming paths) of the sweep folder as the user gave it: its URL where it is staged."""
        return str(text).replace(str(self.folder), self.place.shown(self.folder))

    def record(self) -> dict:
        return {"recipe": self.recipe, "search": [p.spelled for p in self.parameters], "fixed": list(self.fixed),
                "metric": self.metric, "direction": self.direction, "seed": self.seed,
                "startup_trials": self.startup_trials, "pruner": self.pruner, "trials": self.trials,
                "launch": self.launch}


class Interrupted(Exception):
    """SIGTERM to the sweep (SIGINT is KeyboardInterrupt)."""


def run_sweep(sweep: Sweep) -> None:
    """Check everything, then run trials until `sweep.trials` are done; a stopped sweep's running trial first."""
    prefix = launch_prefix(sweep.launch)
    config = check_space(sweep.recipe, sweep.parameters, sweep.fixed)
    check_code(config, sweep.trust_code)
    check_metric(sweep, config)
    check_folder(sweep)
    from accel_train.sweep.study import optuna

    optuna()  # the install command before any file is written
    warn_without_validation(sweep, config)
    sweep.folder.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with SweepLock(sweep.folder) as lock_fd:
            study = open_study(sweep.folder, sweep.direction, sweep.startup_trials, sweep.pruner == "median")
            (sweep.folder / SWEEP_FILE).write_text(yaml.safe_dump(sweep.record(), sort_keys=False))
            done = len(finished(study))
            best = "highest" if sweep.direction == "max" else "lowest"
            logger.info(f"sweep: {sweep.trials} trial(s) of {sweep.recipe} ({done} done), searching "
                        f"{' '.join(p.spelled for p in sweep.parameters)} for the {best} {sweep.metric}; study in "
                        f"{sweep.shown(sweep.folder)}")
            for trial in unfinished(study):  # a stopped sweep's: continued from its newest checkpoint
                run_trial(sweep, study, trial, prefix, lock_fd, resumed=True)
            while len(finished(study)) < sweep.trials:
                give_up_if_broken(study)
                run_trial(sweep, study, new_trial(study, sweep.parameters, sweep.seed, sweep.startup_trials), prefix,
                          lock_fd, resumed=False)
    except (KeyboardInterrupt, Interrupted) as stop:
        name = "SIGINT" if isinstance(stop, KeyboardInterrupt) else "SIGTERM"
        raise Preempted(f"sweep stopped by {name} between trials; run the same command again to go on") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    lines = results.summary(sweep.folder, pictures=True)
    for line in lines:
        logger.info(sweep.shown(line))
    if lines[-1] == results.NONE_COMPLETED:
        raise NothingCompleted(f"sweep: none of the {sweep.trials} trial(s) completed, so the sweep has no result; "
                               f"see each trial's error above and its log in {sweep.shown(sweep.folder / LOGS_DIR)}")


def _interrupt(signum, frame) -> None:
    raise Interrupted


def run_trial(sweep: Sweep, study, trial, prefix: list[str], lock_fd: int, resumed: bool) -> None:
    """One trial from start (or its newest checkpoint) to complete, pruned or failed; its reports told to the
    study as they come. A stop of the sweep stops the trial, which saves, and leaves it running in the study."""
    number, folder = trial.number, trial_folder(sweep.folder, trial.number)
    values = [f"{key}={spell(value)}" for key, value in sorted(trial.params.items())]
    command = [*prefix, "-m", "accel_train", "train", sweep.recipe, *sweep.fixed, *values, f"output_dir={folder}",
               "resume=auto", *([TRUST_FLAG] if sweep.trust_code else [])]
    if not resumed:
        trial.set_user_attr("folder", folder.name)
    log = trial_log(sweep.folder, number)
    logger.info(f"trial {number}: {' '.join(values)}{' (resumed)' if resumed else ''}: {sweep.shown(folder)}, log "
                f"{sweep.shown(log)}")
    reported = set(frozen_trial(study, number).intermediate_values)
    process = TrialProcess(command, folder, log, lock_fd)
    process.start()
    started, pruned, evaluations = time.monotonic(), False, []
    try:
        while True:
            code = process.poll()
            for line in process.new_evaluations():
                evaluations.append(line)
                if len(evaluations) in reported or process.stopped:  # told before the sweep stopped; or pruned
                    continue
                pruned = report(sweep, study, trial, process, len(evaluations), line) or pruned
            if code is not None:
                break
            sweep.place.sync_soon()  # in a store, the trial's lines and the study at most SYNC_EVERY_S behind
            time.sleep(POLL_S)
    except (KeyboardInterrupt, Interrupted) as stop:
        name = "SIGINT" if isinstance(stop, KeyboardInterrupt) else "SIGTERM"
        logger.info(f"sweep: {name}: stopping trial {number}, which saves a checkpoint...")
        process.stop()
        code = process.wait()
        raise Preempted(f"sweep stopped by {name}; trial {number} {process.stopped_how(code)}; run the same command "
                        "again to resume it and go on") from None
    # as `runs` of the sweep shows it: the run's own time over its starts (metrics.jsonl), else this start's
    took = duration(results.wall_s(folder) or time.monotonic() - started)
    if pruned:
        tell(study, trial, "pruned")
        logger.info(f"trial {number}: pruned; it {process.stopped_how(code)} ({took})")
    elif code == 0 and evaluations:
        value = evaluations[-1][sweep.metric]
        tell(study, trial, "complete", value)
        logger.info(f"trial {number}: complete, {sweep.metric} {value:.4f} ({took})")
    elif not process.stopped and process.saved_at() is not None:  # stopped from outside: the rerun resumes it
        raise Preempted(f"sweep stopped: trial {number} {process.stopped_how(code)}; run the same command again to "
                        "resume it and go on")
    else:
        error = process.last_error() if code != 0 else "it ended without an evaluation"
        trial.set_user_attr("error", error)
        trial.set_user_attr("exit_code", code)
        tell(study, trial, "failed")
        logger.info(f"trial {number}: failed (exit {code}): {error}; log {sweep.shown(log)}")


def report(sweep: Sweep, study, trial, process: TrialProcess, ordinal: int, line: dict) -> bool:
    """One evaluation told to the study; True when the pruner stops the trial (SIGTERM sent)."""
    value = line.get(sweep.metric)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        process.stop()
        process.wait()
        tell(study, trial, "failed")
        reported = ", ".join(sorted(key for key, v in line.items() if isinstance(v, float) and key != "elapsed_s"))
        raise UserError(f"sweep: --metric {sweep.metric} is not in trial {trial.number}'s evaluations, which report "
                        f"{reported}; choose one of them")
    trial.report(float(value), ordinal)
    logger.info(f"trial {trial.number}: evaluation {ordinal} at step {line['step']} ({line['split']}): "
                f"{sweep.metric} {value:.4f}")
    if process.stopped or not trial.should_prune():
        return False
    others = [t.intermediate_values[ordinal] for t in finished(study)
              if t.state.name == "COMPLETE" and ordinal in t.intermediate_values]
    median = f"; the median of the complete trials there: {statistics.median(others):.4f}" if others else ""
    logger.info(f"trial {trial.number}: pruned at evaluation {ordinal} ({sweep.metric} {value:.4f}{median}): "
                "stopping it")
    process.stop()
    return True


def frozen_trial(study, number: int):
    return next(t for t in study.get_trials(deepcopy=False) if t.number == number)


def give_up_if_broken(study) -> None:
    """Trials that all fail say the setup is broken (a data path, the launch command), not the values tried."""
    done = finished(study)
    if len(done) >= FAILED_BEFORE_GIVING_UP and all(t.state.name == "FAIL" for t in done):
        last = max(done, key=lambda t: t.number)
        raise UserError(f"sweep: the first {len(done)} trials all failed, the last with: "
                        f"{last.user_attrs.get('error', '?')}; fix that (see its log) and run the sweep again")


def warn_without_validation(sweep: Sweep, config: Config) -> None:
    """Choosing on the test set is the leak a validation split exists to prevent (ImageFolder may hold a val/)."""
    if not config.data.val_fraction and config.data.name != "imagefolder" and \
            not any(p.key == "data.val_fraction" for p in sweep.parameters):
        logger.warning("sweep: no validation split, so trials are compared on the test split, which then no longer "
                       "measures unseen data; set data.val_fraction (e.g. 0.1)")


def check_metric(sweep: Sweep, config: Config) -> None:
    """--metric is one the task reports (tasks that say which); the default direction comes from it. `config`: the
    recipe with the fixed settings."""
    from accel_train.workloads.tasks import task_named
    from accel_train.workloads.tasks.base import reported_metrics

    if any(p.key == "train.ema_decay" for p in sweep.parameters):  # some trials report the raw model's metrics too
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, ema_decay=0.999))
    known = reported_metrics(task_named(config.task), config)
    if known is None:
        if not sweep.given_direction:
            sweep.direction = "min" if "loss" in sweep.metric else "max"
        return
    if sweep.metric not in known:
        raise UserError(f"sweep: --metric {sweep.metric} is not an evaluation metric of task={config.task}; it reports "
                        f"{', '.join(known)}")
    if not sweep.given_direction:
        sweep.direction = known[sweep.metric]


def check_folder(sweep: Sweep) -> None:
    """A new folder, or the same sweep's: a changed search is refused in one line, before any trial."""
    folder, record = sweep.folder, sweep.record()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"sweep: output_dir={folder} is a file; give a folder for the sweep")
    if not (folder / SWEEP_FILE).is_file():
        if folder.is_dir() and any(folder.iterdir()):
            raise UserError(f"sweep: output_dir={folder} holds files but no {SWEEP_FILE}, so no sweep; give a new "
                            "or empty folder")
        return
    stored = results.read_record(folder, remedy="; give a new output_dir")
    changed = [key for key in IDENTITY if stored.get(key) != record[key]]
    if changed:
        shown = "; ".join(f"{key} {_shown(stored.get(key))} there, {_shown(record[key])} here" for key in changed)
        raise UserError(f"sweep: {folder} holds a study of another search ({shown}); a study goes on only with the "
                        "search it began with: give the same, or a new output_dir")


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


class SweepLock:
    """An exclusive lock on the sweep folder, held by the sweep and by the trial processes it starts (inherited)."""

    def __init__(self, folder: Path) -> None:
        self.path, self.fd = folder / LOCK_FILE, None

    def __enter__(self) -> int:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if not self._take():
            owner = os.pread(self.fd, 32, 0).decode(errors="replace").strip()
            if owner.isdigit() and int(owner) != os.getpid() and is_alive(int(owner)):
                os.close(self.fd)
                raise UserError(f"sweep: another sweep (process {owner}) is running in {self.path.parent}; let it "
                                f"end, or stop it (kill {owner}: its trial saves a checkpoint), then run this again")
            logger.info("sweep: waiting for the processes of the stopped sweep's trial to end (it saves a "
                        "checkpoint)...")
            deadline = time.monotonic() + OLD_TRIAL_WAIT_S
            while not self._take():
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise UserError(f"sweep: processes of a stopped sweep still hold {self.path} after "
                                    f"{OLD_TRIAL_WAIT_S:.0f} s; end them (fuser -k {self.path}), then run this again")
                time.sleep(1)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        return self.fd

    def _take(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
