"""The model a training run trains, and what Accelerate prepares with it: the optimizer, the schedule, the loaders.

model_for_run builds the model (the same initial weights on every process: the run's seed is set before it);
prepare_for_training keys its dropout, finds micro_batch_size=auto's micro-batch and data.num_workers=auto's workers,
compiles it, and hands model, optimizer, loaders and schedule to `accelerator.prepare` in the order that keeps a run
a function of its config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator

from accel_train import hooks
from accel_train.config import Config
from accel_train.data import Data, Loaders, RunData
from accel_train.distributed.accelerator import maybe_sync_batchnorm, shards_gradients
from accel_train.run.snapshot import Prepared
from accel_train.run.weights import initial_weights
from accel_train.training.accumulation import fit_micro_batch
from accel_train.training.dropout import DropoutKeys, key_dropout
from accel_train.training.feeding import choose_workers
from accel_train.training.optim import build_optimizer, build_scheduler
from accel_train.workloads.models import compile_model, tune_for_device
from accel_train.workloads.tasks import Task


@dataclass
class Trainable:
    """What the loop trains, as Accelerate prepared it."""

    model: torch.nn.Module  # DDP's or FSDP's wrapper on several processes
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loaders: Loaders  # each process gets its share of a global batch
    accumulation: int  # micro-batches an optimizer step
    steps_per_epoch: int
    dropout: DropoutKeys | None  # train.keyed_dropout: the keys its layers read

    @property
    def keys_samples(self) -> bool:
        """Whether batches carry their samples' indices: some dropout layer is keyed by sample."""
        return bool(self.dropout and self.dropout.layers)

    def prepared(self) -> Prepared:
        """What a checkpoint saves through accelerator.save_state."""
        loaders = self.loaders
        return Prepared(models=[self.model], optimizers=[self.optimizer], schedulers=[self.scheduler],
                        loaders=[loader for loader in (loaders.train, loaders.test, loaders.val) if loader is not None])


def model_for_run(config: Config, task: Task, accelerator: Accelerator, train_data: Data, init_weights: Path | None,
                  given: torch.nn.Module | None = None) -> torch.nn.Module:
    """The task's model for the training data (or the one given), with model.init_from's weights (`init_weights`,
    the file the checks found), in the memory format train.channels_last asks for, SyncBatchNorm across processes
    where asked; not yet prepared."""
    model = given if given is not None else task.build_model(config, train_data)
    if init_weights is not None:  # the same file on every process, before any process trains
        initial_weights(model, init_weights, config.model.init_from,
                        f"model.name={config.model.name} on {config.data.name}")
    model = tune_for_device(model, config.train.channels_last)
    return maybe_sync_batchnorm(model, config.model.sync_batchnorm, accelerator)


def prepare_for_training(config: Config, task: Task, accelerator: Accelerator, model: torch.nn.Module, data: RunData,
                         accumulation: int | None) -> Trainable:
    """The model, its optimizer, the data's loaders and the schedule, prepared; `accumulation` None:
    micro_batch_size=auto, found here."""
    # each sample's dropout masks a function of (seed, step, its index, the layer): the same at any world size
    dropout = key_dropout(model, config.seed, accelerator) if config.train.keyed_dropout else None
    # micro_batch_size=auto: the largest micro-batch that fits, recorded in config.yaml; found before compiling (one
    # compilation, for the size found). Under FSDP each process holds a shard of the model: searched once it is.
    sharded = shards_gradients(accelerator)
    if accumulation is None and not sharded:
        accumulation = fit_micro_batch(config, accelerator, task, model, data.train)
    # data.num_workers=auto: measured on the model as it trains, before compiling (whose first pass would be timed);
    # under FSDP, from the cores (a sharded step is a collective, and the micro-batch is found after preparing)
    choose_workers(config, accelerator, task, None if sharded else model, data.train, accumulation or 1)
    # the optimizer holds the model's own parameters: compiling in place keeps them
    optimizer = build_optimizer(config.train, model, sharded)
    model = compile_model(model, config.train.compile)
    prepared_first = accumulation is None
    if prepared_first:  # FSDP prepares (shards) the model with its optimizer
        model, optimizer = accelerator.prepare(model, optimizer)
        accumulation = fit_micro_batch(config, accelerator, task, model, data.train)
    accelerator.gradient_accumulation_steps = accumulation
    loaders = data.loaders(config.data, config.train.batch_size, config.train.eval_batch_size, accelerator,
                           accumulation, sample_indices=bool(dropout and dropout.layers))
    steps_per_epoch = len(loaders.train) // accumulation
    scheduler = build_scheduler(config.train, optimizer, steps_per_epoch=steps_per_epoch, device=accelerator.device)
    if prepared_first:
        train, test, val, scheduler = accelerator.prepare(loaders.train, loaders.test, loaders.val, scheduler)
    else:
        model, optimizer, train, test, val, scheduler = accelerator.prepare(
            model, optimizer, loaders.train, loaders.test, loaders.val, scheduler)
    hooks.every().model_prepared(model)
    return Trainable(model, optimizer, scheduler, Loaders(train, test, val), accumulation, steps_per_epoch, dropout)
