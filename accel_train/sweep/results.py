"""A sweep folder read back: one row per trial with its sampled values, sorted by the metric; the best trial
and the command that trains it again; its pictures. `accel-train runs` and `plot` of a sweep folder, and the
summary a sweep prints when it ends.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from accel_train.errors import UserError
from accel_train.run.layout import CURVES_FILE, is_run
from accel_train.run.summaries import columns, duration, summarize
from accel_train.sweep.space import parameter, spell

SWEEP_FILE = "sweep.yaml"  # what the sweep searches (runner.py writes it)
PARAMETERS_FILE = "parameters.png"
BEST_SHOWN = 5  # trials overlaid in the curves
STATE_ORDER = {"complete": 0, "pruned": 1, "running": 2, "failed": 3}


def is_sweep(folder: Path) -> bool:
    return (folder / SWEEP_FILE).is_file()


def read_record(folder: Path, remedy: str = "") -> dict:
    """What the sweep in `folder` searches (sweep.yaml); unreadable, one line ending in `remedy`."""
    try:
        return yaml.safe_load((folder / SWEEP_FILE).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise UserError(f"{folder / SWEEP_FILE} cannot be read ({err}){remedy}") from None


def rows(folder: Path) -> list[dict]:
    """Every trial of the sweep, best first: the complete ones by the metric, then the pruned ones by their last
    evaluation, then those running, then the failed ones."""
    from accel_train.sweep.study import load_study, state_name
    from accel_train.sweep.trial import trial_folder

    record = read_record(folder)
    found = []
    for trial in load_study(folder).get_trials(deepcopy=False):
        run = trial_folder(folder, trial.number)
        ran = summarize(run) if is_run(run) else None
        reports = trial.intermediate_values
        value = trial.value if trial.value is not None else reports[max(reports)] if reports else None
        found.append({"trial": trial.number, "state": state_name(trial), "value": value,
                      "params": dict(sorted(trial.params.items())), "evaluations": len(reports),
                      "steps": ran["steps"] if ran else 0, "wall_s": ran["wall_s"] if ran else None,
                      "folder": str(run), "error": trial.user_attrs.get("error")})
    sign = -1 if record.get("direction", "max") == "max" else 1
    return sorted(found, key=lambda row: (STATE_ORDER[row["state"]], row["value"] is None,
                                          sign * (row["value"] or 0), row["trial"]))


def wall_s(run: Path) -> float | None:
    """A trial's time as its row gives it: the run's seconds over all its starts, from its metrics.jsonl."""
    return summarize(run)["wall_s"] if is_run(run) else None


def table(folder: Path, found: list[dict]) -> str:
    """The trials side by side, one row each, with a column per searched key."""
    record = read_record(folder)
    keys = sorted({key for row in found for key in row["params"]})
    header = ["trial", "state", record.get("metric", "value"), *keys, "evals", "steps", "wall"]
    lines = [header]
    for row in found:
        lines.append([f"trial-{row['trial']:04d}", row["state"], _short(row["value"]),
                      *(_short(row["params"].get(key)) for key in keys), str(row["evaluations"]), str(row["steps"]),
                      duration(row["wall_s"])])
    return columns(lines)


def _short(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else spell(value)


def best_command(folder: Path, best: dict) -> str:
    """`accel-train train` with the recipe, the fixed settings and the best trial's values, in a new folder."""
    import shlex

    record = read_record(folder)
    values = [f"{key}={spell(value)}" for key, value in best["params"].items()]
    return shlex.join(["accel-train", "train", str(record["recipe"]), *record.get("fixed", []), *values,
                       f"output_dir={folder.as_posix().rstrip('/')}-best"])


NONE_COMPLETED = "no trial completed"


def summary(folder: Path, pictures: bool = False) -> list[str]:
    """What a sweep says when it ends: the table, the best trial with its values and its command, the pictures."""
    found = rows(folder)
    record = read_record(folder)
    counts = {state: sum(row["state"] == state for row in found) for state in STATE_ORDER}
    lines = [table(folder, found), f"{len(found)} trials: " + ", ".join(f"{n} {state}" for state, n in counts.items()
                                                                          if n)]
    for row in found:
        if row["state"] == "failed":
            lines.append(f"trial {row['trial']} failed: {row['error']}")
    best = next((row for row in found if row["state"] == "complete"), None)
    if best is None:
        lines.append(NONE_COMPLETED)
        return lines
    lines.append(f"best: trial {best['trial']} ({best['folder']}), {record.get('metric')} {best['value']:.4f}, with "
                 + " ".join(f"{key}={spell(value)}" for key, value in best["params"].items()))
    lines.append(f"train it again: {best_command(folder, best)}")
    if pictures:
        curves, parameters = draw(folder, found, folder / CURVES_FILE)
        lines.append(f"pictures: {curves} (the best {min(BEST_SHOWN, len(found))} trials), {parameters} "
                     f"({record.get('metric')} against each searched value)")
    return lines


def draw(folder: Path, found: list[dict], output: Path) -> tuple[Path, Path]:
    """The best trials' curves overlaid into `output`, and the metric against each searched value beside it."""
    from accel_train.run.plots import plot_parameters, plot_runs

    record = read_record(folder)
    shown = [row for row in found if is_run(Path(row["folder"]))][:BEST_SHOWN]
    curves = plot_runs([Path(row["folder"]) for row in shown], output,
                       [f"trial-{row['trial']:04d} ({_short(row['value'])})" for row in shown])
    searched = [parameter(*text.split("=", 1)) for text in record.get("search", [])]
    searched = [(p.key, p.log, p.values if p.distribution == "choice" else None) for p in searched]
    parameters = plot_parameters(found, searched, record.get("metric", "value"),
                                 output.with_name(PARAMETERS_FILE if output.name == CURVES_FILE
                                                  else f"{output.stem}_parameters.png"))
    return curves, parameters
