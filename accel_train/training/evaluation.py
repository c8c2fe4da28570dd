"""Evaluation: metrics over exactly the eval set at any world size, during training and of exported weights."""

from __future__ import annotations

from collections.abc import Callable

import torch

from accel_train.config import Config
from accel_train.data import build_dataset, hold_out_validation, make_loader, received_finish
from accel_train.data.classes import labelled_by
from accel_train.data.decode import model_input
from accel_train.distributed.accelerator import finish_command, make_accelerator, round_up_to_world
from accel_train.distributed.devices import set_numerics
from accel_train.errors import UserError
from accel_train.run.layout import read_classes
from accel_train.run.weights import load_weights, read_weights, weights_file
from accel_train.training.adaptive import AdaptiveEval
from accel_train.training.ema import WeightsEMA
from accel_train.training.memory import out_of_memory_stops
from accel_train.training.steps import eval_outputs
from accel_train.workloads.tasks import Task, task_named


@torch.no_grad()
def evaluate(accelerator, model, task, loader, ema: WeightsEMA | None = None,
             adaptive: AdaptiveEval | None = None, on_batch: Callable[[], None] = lambda: None, finish=None) -> dict:
    """Metrics over exactly the eval set: gather_for_metrics per batch drops the padding of the last batch.
    With an EMA of the weights, its metrics take the plain names and the raw model's are raw_*. `adaptive`
    (micro_batch_size=auto): a batch that runs out of memory on any process is evaluated again in smaller chunks.
    `on_batch`: called as each batch arrives (the loop's watchdog: progress). `finish`: the data's, which makes a
    loaded batch into the model's input on the device (None where the loader's workers did)."""
    model.eval()
    metric = task.new_metric()
    for batch in loader:
        on_batch()
        # the EMA's module is not prepared, so not autocast by Accelerate
        with accelerator.autocast(), out_of_memory_stops(accelerator, "evaluation"):
            batch = model_input(finish, batch)
            outputs = adaptive.eval_step(task, model, batch) if adaptive else eval_outputs(task, model, batch)
            metric.add_batch(**accelerator.gather_for_metrics(outputs))  # after the processes agreed (adaptive)
    metrics = metric.compute()
    if ema is None:
        return metrics
    raw = {f"raw_{name}": value for name, value in metrics.items() if name != "num_samples"}
    return {**evaluate(accelerator, ema.model, task, loader, adaptive=adaptive, on_batch=on_batch, finish=finish),
            **raw}


def evaluate_checkpoint(config: Config, checkpoint: str, *, task: Task | None = None,
                        model: torch.nn.Module | None = None, eval_dataset=None, split: str = "test") -> dict:
    """`accel-train eval`: load exported weights (safetensors) and evaluate them on the test (or validation)
    split. The metrics come with `num_processes`, the world size that computed them: the same metrics from any
    world size is the contract, and a launch that formed no process group would show 1 here (if the world-size
    check let it run)."""
    task = task if task is not None else task_named(config.task)
    task.check_config(config)
    state = read_weights(weights_file(checkpoint))
    set_numerics(config.train.deterministic, config.train.tf32)  # as the run trained
    accelerator = make_accelerator(config.seed)
    classes = read_classes(checkpoint)  # the run's, which its outputs index: the data's labels are matched by name
    with accelerator.local_main_process_first():
        if split == "val":
            test_data = build_dataset(config.data, train=False, given=eval_dataset, classes=classes)
            eval_data = hold_out_validation(config.data, config.seed, build_dataset(config.data, train=True),
                                            test_data)[1]
            if eval_data is None:
                raise UserError(f"split=val: {checkpoint} was trained without a validation split "
                                "(data.val_fraction=0 and no val/ folder); evaluate split=test")
            eval_data = labelled_by(eval_data, classes, f"data.name={config.data.name}: the validation split")
        else:
            eval_data = build_dataset(config.data, train=False, given=eval_dataset, classes=classes)
    task.setup(config, eval_data)
    model = load_weights(model if model is not None else task.build_model(config, eval_data), state, checkpoint,
                         f"model.name={config.model.name} on {config.data.name}")
    eval_loader = make_loader(eval_data, config.data, round_up_to_world(config.train.eval_batch_size, accelerator),
                              False, accelerator.device)
    model, eval_loader = accelerator.prepare(model, eval_loader)
    metrics = evaluate(accelerator, model, task, eval_loader,
                       finish=received_finish(eval_data, config.data, accelerator.device))
    finish_command(accelerator)
    return {**metrics, "num_processes": accelerator.num_processes}

