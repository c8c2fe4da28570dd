"""The run folder's layout: every file a run writes, by name, and the tolerant readers of those files.

A run folder (output_dir) is the unit users pass around (`eval RUN`, `predict RUN`, `train RUN`, `runs`, `plot`):

    config.yaml               the resolved config and how the run was launched (itself a recipe)
    metrics.jsonl             one line per train log and per evaluation, as if the run never stopped
    starts.jsonl              one line per start: fresh, resumed by hand, or restarted by the launcher; and one
                              per halving of the micro-batch after running out of memory (micro_batch_size=auto)
    classes.json              the class names, so predict needs nothing but the run folder
    model.safetensors         the trained weights (model_ema / model_best beside them when asked for)
    curves.png                loss, eval metrics and LR
    checkpoints/step-N/       checkpoint.json (metadata) beside Accelerate's state and loop_state_P.json
    trackers/                 every tracker's local files (TensorBoard events, mlruns, .aim)
    stuck/                    after a stall (train.stuck_after_s): process-P.txt, each process's stacks, beside
                              process-P.json (where it was) and report.json (the main process's line)
    .lease                    while a start trains: who writes the folder (run/lease.py); removed at its end

No torch import here: `runs`, `plot` and the checks before training read run folders before torch loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from accel_train.config import CONFIG_FILE
from accel_train.distributed.watchdog import STUCK_DIR
from accel_train.errors import UnreadableFileError, UserError

METRICS_FILE = "metrics.jsonl"
STARTS_FILE = "starts.jsonl"
CLASSES_FILE = "classes.json"
MODEL_FILE = "model.safetensors"
EMA_FILE = "model_ema.safetensors"
BEST_FILE = "model_best.safetensors"
CURVES_FILE = "curves.png"
CHECKPOINTS_DIR = "checkpoints"
TRACKERS_DIR = "trackers"
CHECKPOINT_META_FILE = "checkpoint.json"
LEASE_FILE = ".lease"  # a dot file: the mirror to a store and the read cache leave it out
LOOP_STATE_FILE = "loop_state_{process}.json"  # one per process: the state of the loop's parts on that process


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def trackers_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / TRACKERS_DIR


def stuck_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / STUCK_DIR


def is_run(folder: Path) -> bool:
    return (folder / CONFIG_FILE).is_file() and (folder / METRICS_FILE).is_file()


def find_runs(root: Path) -> list[Path]:
    """`root` if it is a run folder, else every run folder under it (not looking inside runs)."""
    if is_run(root):
        return [root]
    if not root.is_dir():
        raise UserError(f"{root}: no such folder")
    found = []
    for child in sorted(p for p in root.iterdir() if p.is_dir()):
        found += find_runs(child)
    return found


def run_folder(path: str, under: Path | None = None) -> Path:
    """A run folder given by its path, or by its name under `under`."""
    for folder in (Path(path), *([under / path] if under else [])):
        if is_run(folder):
            return folder
    raise UserError(f"{path}: not a run folder (one holding {CONFIG_FILE} and {METRICS_FILE})")


def weights_folder(checkpoint: str | Path) -> Path:
    """The folder a model file is in, or the folder given."""
    path = Path(checkpoint)
    return path.parent if path.is_file() else path


def folders_of(checkpoint: str | Path) -> list[Path]:
    """Where the run folder of weights at `checkpoint` may be: the folder itself, the folder of a model file, or
    two folders up from one of a run's checkpoints."""
    folder = weights_folder(checkpoint)
    return [folder, folder.parent.parent] if folder.parent.name == CHECKPOINTS_DIR else [folder]


def run_of(checkpoint: str | Path) -> Path | None:
    """The run folder (the one holding config.yaml) that weights at `checkpoint` belong to."""
    return next((run for run in folders_of(checkpoint) if (run / CONFIG_FILE).is_file()), None)


def held_results(folder: Path) -> list[str]:
    """What of a run's results `folder` holds."""
    held = [name for name in (CONFIG_FILE, METRICS_FILE, MODEL_FILE, CLASSES_FILE) if (folder / name).exists()]
    checkpoints = checkpoints_dir(folder)
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        held.append(f"{CHECKPOINTS_DIR}/")
    return held


def results_of(*, ema: bool, best: bool, curves: bool, classes: bool, checkpoints: bool,
               tracking: bool) -> list[str]:
    """What a finished run leaves in its output_dir, for the summary it prints."""
    return [MODEL_FILE, *([EMA_FILE] if ema else []), *([BEST_FILE] if best else []), METRICS_FILE,
            *([CURVES_FILE] if curves else []), CONFIG_FILE, STARTS_FILE, *([CLASSES_FILE] if classes else []),
            *([f"{CHECKPOINTS_DIR}/"] if checkpoints else []), *([f"{TRACKERS_DIR}/"] if tracking else [])]


def read_jsonl(path: Path) -> list[dict]:
    """A JSON-lines file as written so far. A last line cut short by a crash is left out; a damaged line before
    others is named (UnreadableFileError), never a silent end of what is shown."""
    texts = path.read_text().splitlines()
    lines = []
    for number, text in enumerate(texts, start=1):
        if not text.strip():
            continue
        try:
            lines.append(json.loads(text))
        except ValueError as err:
            if any(later.strip() for later in texts[number:]):
                raise UnreadableFileError(f"{path} line {number} is damaged ({err}); only a last line cut short "
                                          "by a crash is skipped: repair or delete that line") from None
    return lines


def read_lines(folder: Path) -> list[dict]:
    """metrics.jsonl as written so far."""
    return read_jsonl(folder / METRICS_FILE)


MICRO_BATCH_CHANGE = "micro_batch_size"  # the "event" of a line of starts.jsonl that is not a start


def read_starts(folder: Path) -> list[dict]:
    """starts.jsonl: when, where and from which step each start of the run began ([] where there is none)."""
    return [line for line in _history(folder) if "event" not in line]


def read_micro_batch_changes(folder: Path) -> list[dict]:
    """starts.jsonl's other lines: each halving of the micro-batch, {time, step, from, to, processes}."""
    return [line for line in _history(folder) if line.get("event") == MICRO_BATCH_CHANGE]


def _history(folder: Path) -> list[dict]:
    path = folder / STARTS_FILE
    return read_jsonl(path) if path.is_file() else []


def read_config(folder: Path) -> dict:
    """config.yaml as the mapping it holds."""
    try:
        return yaml.safe_load((folder / CONFIG_FILE).read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"{folder / CONFIG_FILE} is not valid YAML: {err}".replace("\n", " ")) from None


def read_classes(checkpoint: str | Path) -> list[str] | None:
    """classes.json of the run that weights at `checkpoint` belong to, or None when it has none."""
    for folder in folders_of(checkpoint):
        if (folder / CLASSES_FILE).is_file():
            return json.loads((folder / CLASSES_FILE).read_text())
    return None


def usual_permissions(*paths) -> None:
    """Give files the mode every other file of the run gets (0666 less the umask): safetensors writes its files
    readable by their owner only, which breaks sharing a run folder with a group or a serving user."""
    umask = os.umask(0)
    os.umask(umask)
    for path in paths:
        os.chmod(path, 0o666 & ~umask)
