"""Optuna's side of a sweep: the study, stored in the sweep folder, its sampler and its pruner.

The study lives in Optuna's journal file (study.journal): one appended line per change, no database server, and
a file that a sweep killed at any point leaves readable. Each trial is sampled by a TPE sampler seeded from
(the sweep's seed, the trial's number), so the values a trial gets depend on the seed and the trials before it
only: a sweep stopped and run again samples what one that never stopped would have.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

from accel_train.errors import UnreadableFileError, UserError
from accel_train.sweep.space import Parameter

STUDY_FILE = "study.journal"
STUDY_NAME = "sweep"
INSTALL = "pip install 'accel-train[sweep]'"


def optuna() -> Any:
    """Optuna, an extra: its absence is the install command, not a traceback."""
    try:
        import optuna
    except ImportError:
        raise UserError(f"sweep needs Optuna, which is not installed: {INSTALL} (or pip install optuna)") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep says what happens, in its own lines
    return optuna


def open_study(folder: Path, direction: str, startup_trials: int, pruning: bool):
    """The sweep folder's study, created on the first run and loaded on every later one."""
    engine = optuna()
    # The median pruner stops a trial whose best evaluation so far is worse than the median of the earlier
    # trials' at the same evaluation; not before startup_trials trials are complete (too few to compare with).
    pruner = engine.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=0) if pruning \
        else engine.pruners.NopPruner()
    with readable_journal(folder):
        return engine.create_study(storage=journal(folder), study_name=STUDY_NAME, pruner=pruner,
                                   load_if_exists=True, direction="maximize" if direction == "max" else "minimize")


def load_study(folder: Path):
    """A sweep folder's study, read only (runs, plot)."""
    engine = optuna()
    with readable_journal(folder):
        return engine.load_study(study_name=STUDY_NAME, storage=journal(folder))


def journal(folder: Path):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(str(folder / STUDY_FILE)))


@contextmanager
def readable_journal(folder: Path):
    """A journal Optuna cannot replay (KeyError, ValueError or its own errors) becomes one line naming the file, exit 3
    (a damaged file)."""
    try:
        yield
    except Exception as err:
        raise UnreadableFileError(f"{folder / STUDY_FILE} cannot be read as the sweep's study ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0] if str(err) else ''}); it is damaged or not a study: "
                                  "restore it, or start the sweep again in a new output_dir") from None


def distribution(parameter: Parameter):
    """The Optuna distribution of a parameter of the command line."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if parameter.distribution == "choice":
        return CategoricalDistribution(parameter.values)
    low, high = parameter.values
    if parameter.distribution in ("int", "logint"):
        return IntDistribution(low, high, log=parameter.log)
    return FloatDistribution(float(low), float(high), log=parameter.log)


def trial_seed(seed: int, number: int) -> int:
    """The sampler's seed for trial `number`: distinct for every (sweep seed, trial number)."""
    import numpy as np

    return int(np.random.SeedSequence([seed, number]).generate_state(1)[0])


def new_trial(study, parameters: list[Parameter], seed: int, startup_trials: int):
    """Ask the study for the next trial, its values sampled now: at random for the first startup_trials trials,
    then by TPE from the trials so far."""
    engine = optuna()
    study.sampler = engine.samplers.TPESampler(seed=trial_seed(seed, len(study.trials)),
                                               n_startup_trials=startup_trials)
    return study.ask({p.key: distribution(p) for p in sorted(parameters, key=lambda p: p.key)})


def unfinished(study) -> list:
    """The trials a stopped sweep left running, oldest first, as trials that can report and be told."""
    engine = optuna()
    running = study.get_trials(deepcopy=False, states=(engine.trial.TrialState.RUNNING,))
    return [engine.trial.Trial(study, frozen._trial_id) for frozen in sorted(running, key=lambda t: t.number)]


def finished(study) -> list:
    """The trials that count towards the sweep's N: complete, pruned or failed."""
    engine = optuna()
    done = (engine.trial.TrialState.COMPLETE, engine.trial.TrialState.PRUNED, engine.trial.TrialState.FAIL)
    return study.get_trials(deepcopy=False, states=done)


def state_name(frozen) -> str:
    """complete, pruned, failed, running."""
    return {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed"}.get(frozen.state.name, "running")


def tell(study, trial, state: str, value: float | None = None) -> None:
    engine = optuna()
    states = engine.trial.TrialState
    if state == "complete":
        study.tell(trial, value)
    else:
        study.tell(trial, state=states.PRUNED if state == "pruned" else states.FAIL)
