"""Everything a training run needs before its first batch, made in order and handed to the loop as one Run.

The Accelerator (a real process group on whatever hardware is present), the data and its loaders, the model and
its optimizer and schedule (prepared by Accelerate), the parts whose state survives a resume (restored from the
checkpoint `resume` names), the step (plain, or micro_batch_size=auto's adaptive one, chosen once), the guard, the
meter, the model selection, and who watches: observers on the main process, the stop signals and the stuck-process
watchdog on every process. Nothing here trains; loop.py does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from accel_train import hooks
from accel_train.config import Config
from accel_train.console import warn
from accel_train.data import build_dataset, hold_out_validation, make_loader
from accel_train.distributed.accelerator import (
    make_accelerator,
    maybe_sync_batchnorm,
    per_process_batch,
    round_up_to_world,
    run_info,
    shards_gradients,
)
from accel_train.distributed.devices import set_numerics
from accel_train.distributed.environment import launcher_environment
from accel_train.distributed.signals import StopSignals
from accel_train.distributed.watchdog import STUCK_DIR, Watchdog
from accel_train.run.checkpoint import Checkpoints
from accel_train.run.display import Console
from accel_train.run.folder import RunFolder
from accel_train.run.layout import stuck_dir, trackers_dir
from accel_train.run.location import RunPlace
from accel_train.run.snapshot import Prepared
from accel_train.run.tracking import Trackers
from accel_train.run.weights import initial_weights
from accel_train.state import Observers, Progress, ResumePoint, State
from accel_train.training.accumulation import accumulation_steps, fit_micro_batch
from accel_train.training.adaptive import AdaptiveEval, AdaptiveStep, MicroBatchSize, halves_on_out_of_memory
from accel_train.training.dropout import key_dropout
from accel_train.training.ema import WeightsEMA
from accel_train.training.guard import NonFiniteGuard
from accel_train.training.meter import TrainMeter
from accel_train.training.optim import build_optimizer, build_scheduler, log_every_steps, schedule_overruns, total_steps
from accel_train.training.selection import ModelSelection
from accel_train.training.steps import PlainStep, TrainingBatches
from accel_train.workloads.models import compile_model, tune_for_device
from accel_train.workloads.tasks import Task

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """The parts of a training run, as set_up made them; the loop changes `progress` (and the parts' own state)."""

    config: Config
    task: Task
    accelerator: Accelerator
    model: torch.nn.Module  # prepared: DDP's or FSDP's wrapper on several processes
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: TrainingBatches  # each epoch's optimizer steps left, their micro-batches
    step: PlainStep | AdaptiveStep  # runs a step's micro-batches forward and backward
    selecting_loader: torch.utils.data.DataLoader  # the validation split's, or the test set's without one
    selecting_split: str  # "val" or "test"
    test_loader: torch.utils.data.DataLoader | None  # evaluated once at the end, beside a validation split
    selecting_finish: Any  # each loader's data's finish: its batches made into the model's input on the device
    test_finish: Any
    adaptive_eval: AdaptiveEval | None  # micro_batch_size=auto: an eval batch that runs out is redone in halves
    guard: NonFiniteGuard
    meter: TrainMeter
    ema: WeightsEMA | None
    selection: ModelSelection
    checkpoints: Checkpoints
    progress: Progress
    start: ResumePoint
    state: State  # what observers read
    observers: Observers
    signals: StopSignals
    watchdog: Watchdog
    log_every: int  # steps between train lines

    def epochs(self):
        """The epochs left, from the checkpoint's; none once the run has taken its steps or stopped early."""
        for epoch in range(self.start.epoch, self.config.train.epochs):
            if self.progress.finished or self.selection.stopped:
                return
            yield epoch

    def line_due(self) -> bool:
        """A train line every train.log_every_steps, and at the run's last step."""
        return self.progress.step % self.log_every == 0 or self.progress.finished

    def evaluation_due(self) -> bool:
        """An evaluation every train.eval_every_steps, at each epoch's end and at the run's last step."""
        progress, every = self.progress, self.config.train.eval_every_steps
        return bool(every and progress.step % every == 0) or progress.at_epoch_end or progress.finished


def set_up(config: Config, task: Task, trackers: list[str], place: RunPlace, model: torch.nn.Module | None = None,
           train_dataset=None, eval_dataset=None) -> Run:
    """Make every part, in the order that makes a run a function of its config: the same initial weights on every
    process, then each process's own random streams (dropout), then the checkpoint's state over all of them."""
    started = time.perf_counter()
    set_numerics(config.train.deterministic, config.train.tf32)
    accelerator = make_accelerator(config.seed, config.train.collective_timeout_s, trackers,
                                   str(trackers_dir(place.folder)))
    per_process_batch(config.train.batch_size, accelerator, "train.batch_size")
    accumulation = accumulation_steps(config.train, accelerator.num_processes)  # None: micro_batch_size=auto
    auto = accumulation is None
    set_seed(config.seed)  # the same initial weights on every process
    with accelerator.local_main_process_first():  # the main process of each node fetches, the others then read
        train_data = build_dataset(config.data, train=True, given=train_dataset)
        # labelled by the training split's class names: an evaluation split lacking a class is not shifted
        test_data = build_dataset(config.data, train=False, given=eval_dataset, classes=train_data.classes)
    train_data, val_data = hold_out_validation(config.data, config.seed, train_data, test_data)  # None: on test
    task.setup(config, train_data)
    task.new_metric()  # evaluate needs a writable HF cache: say so now, not at the first evaluation
    model = model if model is not None else task.build_model(config, train_data)
    if config.model.init_from:  # the same file on every process, before any process trains
        initial_weights(model, config.model.init_from, f"model.name={config.model.name} on {config.data.name}")
    model = maybe_sync_batchnorm(model, config.model.sync_batchnorm, accelerator)
    model = tune_for_device(model, config.train.channels_last)
    # each sample's dropout masks a function of (seed, step, its index, the layer): the same at any world size
    dropout = key_dropout(model, config.seed, accelerator) if config.train.keyed_dropout else None
    # micro_batch_size=auto: the largest micro-batch that fits, recorded in config.yaml; found before compiling (one
    # compilation, for the size found). Under FSDP each process holds a shard of the model: searched once it is.
    sharded = shards_gradients(accelerator)
    if accumulation is None and not sharded:
        accumulation = fit_micro_batch(config, accelerator, task, model, train_data)
    model = compile_model(model, config.train.compile)
    optimizer = build_optimizer(config.train, model, sharded)
    prepared_first = accumulation is None
    if prepared_first:  # FSDP prepares (shards) the model with its optimizer
        model, optimizer = accelerator.prepare(model, optimizer)
        accumulation = fit_micro_batch(config, accelerator, task, model, train_data)
    accelerator.gradient_accumulation_steps = accumulation
    every = hooks.every()
    train_loader = make_loader(every.data_built(train_data, "train"), config.data, config.train.batch_size, True,
                               accelerator.device, accumulation, sample_indices=bool(dropout and dropout.layers))
    eval_batch = round_up_to_world(config.train.eval_batch_size, accelerator)
    test_loader = make_loader(every.data_built(test_data, "test"), config.data, eval_batch, False, accelerator.device)
    val_loader = make_loader(every.data_built(val_data, "val"), config.data, eval_batch, False,
                             accelerator.device) if val_data else None
    steps_per_epoch = len(train_loader) // accumulation
    scheduler = build_scheduler(config.train, optimizer, steps_per_epoch=steps_per_epoch, device=accelerator.device)
    if prepared_first:
        train_loader, test_loader, val_loader, scheduler = accelerator.prepare(train_loader, test_loader, val_loader,
                                                                               scheduler)
    else:
        model, optimizer, train_loader, test_loader, val_loader, scheduler = accelerator.prepare(
            model, optimizer, train_loader, test_loader, val_loader, scheduler)
    every.model_prepared(model)
    set_seed(config.seed, device_specific=True)  # dropout differs per process

    progress = Progress(steps_per_epoch=steps_per_epoch, total_steps=total_steps(config.train, steps_per_epoch),
                        started=started)
    if overrun := schedule_overruns(config.train, steps_per_epoch):
        warn(logger, accelerator, overrun)
    ema = WeightsEMA(accelerator, model, config.train.ema_decay) if config.train.ema_decay else None
    meter = TrainMeter(accelerator, config.train.batch_size)
    selection = ModelSelection(config, accelerator, place.folder)
    # micro_batch_size=auto (not under FSDP): a step or eval batch that runs out of memory is redone with half as many
    adapts = halves_on_out_of_memory(accelerator, auto)
    micro_batch_size = MicroBatchSize(accelerator, config.train) if adapts else None
    # What survives a resume beside the model, optimizer and scheduler: one entry a part.
    checkpoints = Checkpoints(config, accelerator, place, states={"progress": progress, "meter": meter,
                                                           "selection": selection,
                                                           **({"ema": ema.averaged} if ema else {}),
                                                           **({"micro_batch": micro_batch_size} if adapts else {})},
                              prepared=Prepared(models=[model], optimizers=[optimizer], schedulers=[scheduler],
                                                loaders=[loader for loader in (train_loader, test_loader, val_loader)
                                                         if loader is not None]))
    start = checkpoints.resume(model, progress.steps_per_epoch, progress.total_steps)  # resume=auto / PATH
    launcher = launcher_environment()
    state = State(config, progress, start, run_info(accelerator), (launcher.restart, launcher.max_restarts),
                  train_data, tuple(trackers), place)
    observers = main_process_observers(accelerator, task, config, trackers)
    signals = StopSignals(accelerator, config.train.collective_timeout_s)
    selecting_split = "val" if val_loader is not None else "test"
    if (config.checkpoint.best_metric or config.train.early_stop_patience) and val_loader is None:
        warn(logger, accelerator,
             "checkpoint.best_metric / train.early_stop_patience choose on the test set, which then "
             "no longer measures unseen data; set data.val_fraction (e.g. 0.1) to choose on a "
             "validation split")
    # a run folder in a store: the processes meet in its stuck/, not on a disk they share
    watchdog = Watchdog(accelerator, config.train, progress, stuck_dir(place.folder), signals,
                        place.mirror.store_of(STUCK_DIR) if not place.shared else None)
    batches = TrainingBatches(accelerator, train_loader, task, config.seed, accumulation, progress, start,
                              meter.timed, watchdog.mark, train_data.finish,
                              sample_indices=bool(dropout and dropout.layers))
    step = AdaptiveStep(accelerator, task, micro_batch_size, observers, state, dropout) if adapts \
        else PlainStep(accelerator, task, config.train, progress, dropout)
    return Run(config=config, task=task, accelerator=accelerator, model=model, optimizer=optimizer,
               scheduler=scheduler, batches=batches, step=step, selecting_loader=val_loader or test_loader,
               selecting_split=selecting_split, test_loader=test_loader if val_loader is not None else None,
               selecting_finish=(val_data or test_data).finish, test_finish=test_data.finish,
               adaptive_eval=AdaptiveEval(accelerator, config.train.collective_timeout_s) if adapts else None,
               guard=NonFiniteGuard(config.train, accelerator), meter=meter, ema=ema,
               selection=selection, checkpoints=checkpoints, progress=progress, start=start, state=state,
               observers=observers, signals=signals, watchdog=watchdog,
               log_every=log_every_steps(config.train, progress.total_steps))


def main_process_observers(accelerator: Accelerator, task: Task, config: Config, trackers: list[str]) -> Observers:
    """Only the main process prints and writes run files; the other processes have no observers."""
    if not accelerator.is_main_process:
        return Observers([])
    return Observers([RunFolder(), Console(), *([Trackers(accelerator)] if trackers else []),
                      *task.observers(config)])
