"""The Python API: train, evaluate and predict from a script; the command line is a thin layer over it.

    import accel_train

    metrics = accel_train.train("fashion_mnist_cnn", ["train.epochs=3", "output_dir=runs/mine"], model=MyNet())
    accel_train.evaluate("runs/mine", model=MyNet())      # a run folder is its own recipe
    rows = accel_train.predict("runs/mine", inputs="photos/", output="predictions.csv")

A script that calls them runs under any launcher, unchanged: `python my_script.py`, `accelerate launch
--config_file accelerate_configs/multi_gpu.yaml my_script.py`, `torchrun --nproc_per_node 2 my_script.py`.
Every process runs the script, so it must build the same model and data on each (seed what is random).

`recipe` is a shipped recipe's name, a YAML file, a run folder (its config.yaml) or a Config (`load_config`);
`overrides` are `key=value` strings as on the command line. evaluate and predict take the run folder alone,
or a recipe and `checkpoint`; either way a setting that changes what the weights mean (model.*, data.name,
data.image_size, data.normalize, task) must agree with the run's. Objects given (a task, a model,
datasets) take the place of the names the recipe gives; config.yaml records them as <module.Class>.
Mistakes raise `accel_train.UserError` with the one line the command line would print. The lines a run prints are
records of the "accel_train" logger: `logging.getLogger("accel_train").setLevel(logging.WARNING)` keeps only the
warnings (console.py says how to route them).

The command line calls these same functions: `train`, and for eval and predict `run_config` (the checks, before
torch loads), then `evaluate_run` / `predict_run`. The checks before training run once, in `check_before_opening` and
`check_training`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from accel_train.config import Config, list_recipes, load_config, refuse_contradictions
from accel_train.config.recipes import run_folder_of
from accel_train.config.schema import expand_home
from accel_train.config.trust import check_code, remember_trained
from accel_train.errors import DataNotFoundError, UserError
from accel_train.import_paths import given_object_name
from accel_train.run.checkpoint_files import list_checkpoints, read_meta
from accel_train.run.folder import check_output_dir, refusals_leave_no_folder
from accel_train.run.layout import (
    BEST_FILE,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    MODEL_FILE,
    read_config,
    run_of,
    weights_folder,
)
from accel_train.run.lease import RunLease
from accel_train.run.place import RunPlace, run_folder_patience
from accel_train.run.read_cache import readable_run
from accel_train.run.resume import check_resume
from accel_train.run.tracking import tracker_names
from accel_train.storage import check_url_form, is_remote
from accel_train.versions import check_versions

if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset

    from accel_train.training.setup import Sources
    from accel_train.workloads.tasks import Task

logger = logging.getLogger(__name__)


def train(recipe: str | Config, overrides: Sequence[str] = (), *, model: torch.nn.Module | None = None,
          train_dataset: Dataset | None = None, eval_dataset: Dataset | None = None,
          task: Task | None = None, trust_code: bool = False) -> dict:
    """Train; returns the final evaluation's metrics (every process gets the same). `trust_code`: the code a run
    folder's config.yaml names may run (the command line's --trust-code; config/trust.py)."""
    url, recipe = None, expand_home(recipe) if isinstance(recipe, str) else recipe
    if isinstance(recipe, str) and is_remote(recipe):  # a run folder in a store: its config.yaml is the recipe
        url, recipe = recipe.rstrip("/"), str(readable_run(recipe, (CONFIG_FILE,)))
    run = None if isinstance(recipe, Config) else run_folder_of(str(recipe))
    if run is not None and url is not None:
        run = url  # the run in the store, not its copy in the read cache
    if run is not None and not any(str(override).startswith("output_dir=") for override in overrides):
        if not any(str(override).startswith("resume=") for override in overrides):
            raise UserError(f"train {recipe}: a run folder as the recipe trains that run again, into a folder of its "
                            f"own: add output_dir=NEW (to continue {run} itself: accel-train train {run} resume=auto)")
        overrides = [*overrides, f"output_dir={run}"]  # resume given: that run itself continues, wherever it was
    config = _with_objects(_config(recipe, overrides), model, task, train_dataset, eval_dataset)
    if (train_dataset is None) != (eval_dataset is None):
        raise UserError("train_dataset and eval_dataset: give both, or neither (the recipe's data.name is used)")
    trust(config, trust_code)
    remember_trained(config)
    trackers = check_before_opening(config)
    # where the run folder lives: made once, handed to whoever needs it (a URL: the store checked, staging pulled)
    place = RunPlace.open(config.output_dir, run_folder_patience(config))
    # one writer: the main process holds the folder's lease before anything reads or writes the run there
    with refusals_leave_no_folder(place), RunLease.taken(config, place) as lease:
        task, sources = check_training(config, place, task)
        lease.say_taken_over()
        from accel_train.training import loop

        return loop.train(config, task, sources, trackers, place, model=model, train_dataset=train_dataset,
                          eval_dataset=eval_dataset)


def trust(config: Config, trust_code: bool) -> None:
    """Before anything is imported: the code `config` names runs only where this command may run it (check_code's
    one line otherwise); trust keys a file set were set back to false, which one line says."""
    from accel_train.distributed.environment import launcher_environment

    if launcher_environment().is_reporting_process:
        for key, file in config.ignored_trust:
            if getattr(config.model, key.split(".")[1]):  # given again by this command
                continue
            logger.warning(f"{key}: true in {file} is ignored: trust is given by the command, never by a file; add "
                           f"{key}=true to this command if you trust {config.model.name}")
    check_code(config, trust_code)


def check_before_opening(config: Config) -> list[str]:
    """The checks before the run folder is opened (nothing read or made yet): no mistyped URL, trackers by name.
    Returns Accelerate's tracker names."""
    for key, location in (("output_dir", config.output_dir), ("data.root", config.data.root),
                          ("model.init_from", config.model.init_from)):
        check_url_form(location, key)  # s3:/bucket would become a local folder named "s3:"
    return tracker_names(config.train.log_with)


def check_training(config: Config, place: RunPlace, task: Task | None = None) -> tuple[Task, Sources]:
    """Every check before training once the run folder's `place` is open (check_before_opening came before): first
    those that need no torch (the run folder, the checkpoint to resume), so a mistake there answers at once; then the
    task's (the task `config.task` names when none is given). Returns the task, and where the run's data, initial
    weights and resumed checkpoint come from, as the checks found them: the run takes them as they are."""
    resumed = check_resume(config, place)  # before the folder is made
    init_weights = None
    if config.model.init_from:
        from accel_train.run.weights import weights_file

        init_weights = weights_file(config.model.init_from, "model.init_from")
    check_output_dir(config, place)
    from accel_train.workloads.tasks import task_named
    from accel_train.workloads.tasks.base import check_mixing, check_selection_metrics

    task = task if task is not None else task_named(config.task)
    task.check_config(config)
    check_mixing(task, config)
    check_selection_metrics(task, config)
    from accel_train.data import data_source
    from accel_train.training.setup import Sources

    return task, Sources(data=data_source(config.data), init_weights=init_weights, resume=resumed)


def evaluate(recipe: str | Config | None = None, checkpoint: str | None = None, overrides: Sequence[str] = (), *,
             model: torch.nn.Module | None = None, eval_dataset: Dataset | None = None, task: Task | None = None,
             split: str = "test", trust_code: bool = False) -> dict:
    """Metrics of the weights in `checkpoint` (a run folder, a checkpoint folder or a model.safetensors; unset:
    the run folder given as `recipe`) on the test split (or split="val", the run's validation split), over
    exactly its samples at any world size, plus `num_processes` (the world size)."""
    config, checkpoint = run_config(recipe, checkpoint, overrides, "eval", model, task, eval_dataset, split=split,
                                    trust_code=trust_code)
    return evaluate_run(config, checkpoint, task=task, model=model, eval_dataset=eval_dataset, split=split)


def evaluate_run(config: Config, checkpoint: str, *, task: Task | None = None, model: torch.nn.Module | None = None,
                 eval_dataset: Dataset | None = None, split: str = "test") -> dict:
    """`evaluate` of what `run_config` returned (and checked)."""
    from accel_train.training.evaluation import evaluate_checkpoint

    return evaluate_checkpoint(config, checkpoint, task=task, model=model, eval_dataset=eval_dataset, split=split)


def predict(recipe: str | Config | None = None, checkpoint: str | None = None, inputs: str | None = None,
            overrides: Sequence[str] = (), *, output: str | None = None, model: torch.nn.Module | None = None,
            task: Task | None = None, trust_code: bool = False) -> list[dict]:
    """The top `predict.top_k` labels and scores of each image file under `inputs` (a file, a folder searched
    recursively, or a glob): rows {"path", "labels", "scores"} sorted by path, also written as CSV to `output`.
    `checkpoint` unset: the run folder given as `recipe`."""
    if inputs is None:
        raise UserError("predict needs inputs: an image file, a folder or a glob, e.g. inputs='photos/'")
    config, checkpoint = run_config(recipe, checkpoint, overrides, "predict", model, task, trust_code=trust_code)
    return predict_run(config, checkpoint, expand_home(str(inputs)), expand_home(output), task=task, model=model)


def predict_run(config: Config, checkpoint: str, inputs: str, output: str | None = None, *, task: Task | None = None,
                model: torch.nn.Module | None = None) -> list[dict]:
    """`predict` of what `run_config` returned (and checked)."""
    from accel_train.training.prediction import predict

    return predict(config, checkpoint, inputs, output, task=task, model=model)


def run_config(recipe: str | Config | None, checkpoint: str | None, overrides: Sequence[str], command: str,
               model=None, task=None, eval_dataset=None, split: str = "test",
               trust_code: bool = False) -> tuple[Config, str]:
    """The config and the weights `command` (eval, predict) uses, checked against what the run was trained with;
    no torch import, so the command line answers before torch loads."""
    if split not in ("test", "val"):
        raise UserError(f"split={split}: choose test or val (the validation split the run held out)")
    recipe, checkpoint = expand_home(recipe) if isinstance(recipe, str) else recipe, expand_home(checkpoint)
    if isinstance(recipe, str) and is_remote(recipe):  # a run folder in a store, copied into the read cache
        recipe = _copied(recipe, command, recipe)
    if checkpoint is not None and is_remote(checkpoint):
        checkpoint = _copied(checkpoint, command, f"checkpoint={checkpoint}")
    recipe, checkpoint = _recipe_and_checkpoint(recipe, checkpoint, command)
    config = _with_objects(_config(recipe, overrides), model, task, None, eval_dataset)
    trust(config, trust_code)
    _refuse_other_settings(config, checkpoint, command)
    return config, checkpoint


def _copied(url: str, command: str, named: str) -> str:
    """A run's or checkpoint's URL copied into the read cache: the copy, or one line naming the URL (not the copy)
    when nothing of a run is there."""
    copy = readable_run(url)
    if url.endswith(".safetensors") and not copy.is_file():
        raise DataNotFoundError(f"{command} {named}: no such weights file in the store; pass a run's output_dir, "
                                "one of its checkpoints (RUN/checkpoints/step-N) or a .safetensors file there")
    if not (copy.is_file() or (copy / CONFIG_FILE).is_file() or (copy / MODEL_FILE).is_file()):
        raise DataNotFoundError(f"{command} {named}: no run there ({CONFIG_FILE} nor {MODEL_FILE} at that URL); pass "
                                "a run's output_dir or one of its checkpoints (RUN/checkpoints/step-N)")
    return str(copy)


def _refuse_other_settings(config: Config, checkpoint: str, command: str) -> None:
    """`config` may differ from what the weights at `checkpoint` were trained with only where that does not change
    what they mean (data.root, data.eval_subset, train.eval_batch_size, ...): the same check as resume's."""
    meta, run = read_meta(weights_folder(checkpoint)), run_of(checkpoint)
    recorded = meta["config"] if meta is not None else read_config(run) if run is not None else None
    if recorded is not None and _same_images_elsewhere(recorded, config):
        recorded = {**recorded, "data": {**recorded["data"], "name": config.data.name}}
    if recorded is not None:
        refuse_contradictions(recorded, config, f"{command}: {checkpoint} was trained with other settings",
                              "these change what the weights mean: leave them out (the run folder alone gives "
                              f"its own: accel-train {command} {run or checkpoint} ...)")


def _same_images_elsewhere(recorded: dict, config: Config) -> bool:
    """The run's data as shards, or the shards' source (data.name differs, the images do not)."""
    if (recorded.get("data") or {}).get("name", config.data.name) == config.data.name:
        return False
    from accel_train.data.shards.dataset import same_images

    return same_images(recorded.get("data") or {}, config.data)


def _recipe_and_checkpoint(recipe: str | Config | None, checkpoint: str | None,
                           command: str) -> tuple[str | Config, str]:
    """`eval RUN`, `eval PATH` and `eval checkpoint=PATH` (a checkpoint folder or a weights file: the run PATH belongs
    to gives the config) and `eval RECIPE checkpoint=PATH`: the recipe and the weights, or a line saying which is
    missing."""
    if isinstance(recipe, str):
        check_url_form(recipe, "run")
    check_url_form(checkpoint, "checkpoint")
    if checkpoint is None:
        if recipe is None:
            raise UserError(f"{command} needs a run: accel-train {command} RUN (a training run's output_dir), or "
                            f"accel-train {command} RECIPE checkpoint=PATH")
        run = None if isinstance(recipe, Config) else Path(recipe)
        if run is not None and not run.exists() and str(recipe) not in list_recipes():
            raise DataNotFoundError(_not_there(run, f"{command} {recipe}") or f"{command} {recipe}: no such run folder "
                                    f"(nor a shipped recipe); pass a training run's output_dir: accel-train {command} "
                                    "RUN")
        run = run.parent if run is not None and run.name == CONFIG_FILE else run  # RUN/config.yaml: RUN
        if run is not None and not (run / CONFIG_FILE).is_file() and run.exists():  # a checkpoint or weights file
            if run.is_dir() and not (run / MODEL_FILE).is_file():
                raise DataNotFoundError(f"{command} {recipe}: neither a run folder nor weights ({CONFIG_FILE}, "
                                        f"{MODEL_FILE}); pass a run's output_dir, one of its checkpoints "
                                        "(RUN/checkpoints/step-N) or a .safetensors file")
            owner = run_of(str(run))
            if owner is None:
                raise UserError(f"{command} {recipe}: no {CONFIG_FILE} beside these weights or in the run folder they "
                                f"came from, to say how they were trained; pass the recipe too: accel-train {command} "
                                f"RECIPE checkpoint={recipe}")
            return str(owner), str(run)
        if run is None or not (run / CONFIG_FILE).is_file():
            raise UserError(f"{command} {recipe if isinstance(recipe, str) else 'of a Config'} needs checkpoint=PATH: "
                            "the run folder, checkpoint folder or model.safetensors whose weights to use (a run "
                            f"folder alone is enough: accel-train {command} RUN)")
        return recipe, str(run)
    if not Path(checkpoint).exists():
        raise DataNotFoundError(_not_there(Path(checkpoint), f"checkpoint={checkpoint}") or
                                f"checkpoint={checkpoint}: no such file or folder; pass a run's output_dir, one of its "
                                "checkpoint folders or a model.safetensors")
    if recipe is None:
        run = run_of(str(checkpoint))
        if run is None:
            raise UserError(f"{command}: checkpoint={checkpoint} has no {CONFIG_FILE} in its run folder to say how "
                            f"it was trained: pass the recipe too, accel-train {command} RECIPE "
                            f"checkpoint={checkpoint}")
        return str(run), str(checkpoint)
    return recipe, str(checkpoint)


def _not_there(path: Path, named: str) -> str | None:
    """The line for weights of a run that are not there: a checkpoint it does not have (naming those it has), or a
    best model it never kept (saying why); None where `path` is not inside a run folder."""
    folder = path.parent.parent if path.parent.name == CHECKPOINTS_DIR else path.parent
    if not (folder / CONFIG_FILE).is_file():
        return None
    if path.parent.name == CHECKPOINTS_DIR:
        held = [checkpoint.name for checkpoint, _ in list_checkpoints(path.parent)]
        return (f"{named}: no such checkpoint; {path.parent} holds " + (", ".join(held) if held else "none") +
                (f" (the newest: {path.parent / held[-1]})" if len(held) > 1 else ""))
    if path.name != BEST_FILE:
        return None
    trained = read_config(folder) or {}
    best = (trained.get("checkpoint") or {}).get("best_metric")
    if not best:
        return (f"{named}: the run kept no best model: it was trained without checkpoint.best_metric (set it, e.g. "
                f"checkpoint.best_metric=accuracy, for a run to keep one); evaluate the run's final model "
                f"(accel-train eval {folder}) or one of its checkpoints")
    return (f"{named}: not written: the run was to keep its best model by {best}, and has not yet finished an "
            f"evaluation that reports it; evaluate the run's final model (accel-train eval {folder}) or one of its "
            "checkpoints")


def _config(recipe: str | Config, overrides: Sequence[str]) -> Config:
    check_versions()
    if isinstance(overrides, str):
        raise UserError(f"overrides: pass a list of key=value strings, e.g. [{overrides!r}]")
    if isinstance(recipe, Config):
        return load_config(recipe, overrides)
    return load_config(str(recipe), list(overrides))


def _with_objects(config: Config, model, task, train_dataset, eval_dataset) -> Config:
    """Record given objects in place of the names they replace, after checking what they are."""
    if model is not None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise UserError(f"model: found {type(model).__name__}, expected a torch.nn.Module")
        config.model.name = given_object_name(model)
    if task is not None:
        from accel_train.workloads.tasks import check_task

        check_task(task, "task")
        config.task = given_object_name(task)
    if eval_dataset is not None:
        config.data.name = given_object_name(train_dataset if train_dataset is not None else eval_dataset)
    return config
