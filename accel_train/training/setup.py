"""Everything a training run needs before its first batch, made in order and handed to the loop as one Run.

set_up reads as the list of what a run is made of, each part built in its own room: the Accelerator (a real process
group on whatever hardware is present: distributed/accelerator.py's accelerator_for_run), the data (data's
run_data), the model and, prepared with it by Accelerate, its optimizer, loaders and schedule (preparation.py), the
parts whose state survives a resume (Resumable, restored from the checkpoint `resume` names), the step (plain, or
micro_batch_size=auto's adaptive one, chosen once), the guard, and who watches: observers on the main process, the
stop signals and the stuck-process watchdog on every process. Nothing here trains; loop.py does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from accel_train.config import Config
from accel_train.console import warn
from accel_train.data import DataSource, received_finish, run_data
from accel_train.distributed.accelerator import accelerator_for_run, run_info
from accel_train.distributed.environment import launcher_environment
from accel_train.distributed.signals import StopSignals
from accel_train.distributed.watchdog import STUCK_DIR, Watchdog
from accel_train.run.checkpoint import Checkpoints
from accel_train.run.display import Console
from accel_train.run.folder import RunFolder
from accel_train.run.layout import stuck_dir, trackers_dir
from accel_train.run.place import RunPlace
from accel_train.run.tracking import Trackers
from accel_train.state import Observers, Progress, ResumePoint, State
from accel_train.training.accumulation import accumulation_steps
from accel_train.training.adaptive import AdaptiveEval, AdaptiveStep, MicroBatchSize, halves_on_out_of_memory
from accel_train.training.ema import WeightsEMA
from accel_train.training.guard import NonFiniteGuard
from accel_train.training.meter import TrainMeter
from accel_train.training.optim import log_every_steps, schedule_overruns, total_steps
from accel_train.training.preparation import Trainable, model_for_run, prepare_for_training
from accel_train.training.selection import ModelSelection
from accel_train.training.steps import PlainStep, TrainingBatches
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
    selecting_finish: Any  # each loader's data's finish: its batches made into the model's input on the device (None
    # where the loader's workers finish them: a CPU run with workers)
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


@dataclass(frozen=True)
class Sources:
    """Where a run's data, initial weights and resumed checkpoint come from, found once by the checks before it
    (api.check_training), and taken by set_up as found."""

    data: DataSource  # data.name's source: a user's data function imported and checked
    init_weights: Path | None  # model.init_from's weights file (at a URL, copied into the read cache), content checked
    resume: Path | None  # the checkpoint folder resume=PATH names; None for resume=auto (found as the run starts)


def set_up(config: Config, task: Task, sources: Sources, trackers: list[str], place: RunPlace,
           model: torch.nn.Module | None = None, train_dataset=None, eval_dataset=None) -> Run:
    """Make every part, in the order that makes a run a function of its config: the same initial weights on every
    process, then each process's own random streams (dropout), then the checkpoint's state over all of them."""
    started = time.perf_counter()
    accelerator = accelerator_for_run(config.train, config.seed, trackers, str(trackers_dir(place.folder)))
    accumulation = accumulation_steps(config.train, accelerator)  # None: micro_batch_size=auto
    set_seed(config.seed)  # the same initial weights on every process
    data = run_data(config.data, config.seed, accelerator, sources.data, train_dataset, eval_dataset)
    task.setup(config, data.train)
    task.new_metric()  # evaluate needs a writable HF cache: say so now, not at the first evaluation
    model = model_for_run(config, task, accelerator, data.train, sources.init_weights, given=model)
    trainable = prepare_for_training(config, task, accelerator, model, data, accumulation)
    set_seed(config.seed, device_specific=True)  # dropout differs per process
    # micro_batch_size=auto (not under FSDP): a step or eval batch that runs out of memory is redone with half as many
    adapts = halves_on_out_of_memory(accelerator, auto=accumulation is None)
    resumable = Resumable.of(config, accelerator, trainable, place.folder, started, adapts)
    resumable.selection.warn_if_choosing_on(data.selecting_split)
    prepared = trainable.prepared()
    checkpoints = Checkpoints(config, accelerator, place, states=resumable.states(), prepared=prepared)
    progress = resumable.progress
    start = checkpoints.resume(trainable.model, progress.steps_per_epoch, progress.total_steps, sources.resume)
    launcher = launcher_environment()
    state = State(config, progress, start, run_info(accelerator), (launcher.restart, launcher.max_restarts),
                  data.train, tuple(trackers), place)
    observers = main_process_observers(accelerator, task, config, trackers)
    signals = StopSignals(accelerator, config.train.collective_timeout_s)
    # a run folder in a store: the processes meet in its stuck/, not on a disk they share
    watchdog = Watchdog(accelerator, config.train, progress, stuck_dir(place.folder), signals,
                        place.store_of(STUCK_DIR))
    finish = partial(received_finish, cfg=config.data, device=accelerator.device)  # None: the loader's workers did
    batches = TrainingBatches(accelerator, trainable.loaders.train, task, config.seed, trainable.accumulation,
                              progress, start, resumable.meter.timed, watchdog.mark, finish(data.train),
                              sample_indices=trainable.keys_samples)
    step = AdaptiveStep(accelerator, task, resumable.micro_batch, observers, state, trainable.dropout) if adapts \
        else PlainStep(accelerator, task, config.train, progress, trainable.dropout)
    loaders = trainable.loaders
    return Run(config=config, task=task, accelerator=accelerator, model=trainable.model,
               optimizer=trainable.optimizer, scheduler=trainable.scheduler, batches=batches, step=step,
               selecting_loader=loaders.val or loaders.test, selecting_split=data.selecting_split,
               test_loader=loaders.test if loaders.val is not None else None,
               selecting_finish=finish(data.val or data.test), test_finish=finish(data.test),
               adaptive_eval=AdaptiveEval(accelerator, config.train.collective_timeout_s) if adapts else None,
               guard=NonFiniteGuard(config.train, accelerator), meter=resumable.meter, ema=resumable.ema,
               selection=resumable.selection, checkpoints=checkpoints, progress=progress, start=start, state=state,
               observers=observers, signals=signals, watchdog=watchdog,
               log_every=log_every_steps(config.train, progress.total_steps))


@dataclass
class Resumable:
    """What a checkpoint saves and a resume restores beside the prepared model, optimizer, schedule and loaders."""

    progress: Progress
    meter: TrainMeter
    selection: ModelSelection
    ema: WeightsEMA | None
    micro_batch: MicroBatchSize | None  # micro_batch_size=auto's size after the halvings so far

    @classmethod
    def of(cls, config: Config, accelerator: Accelerator, trainable: Trainable, folder: Path, started: float,
           adapts: bool) -> Resumable:
        """Each part new, as at a run's first step; `adapts`: a micro-batch that runs out of memory is halved."""
        steps_per_epoch = trainable.steps_per_epoch
        progress = Progress(steps_per_epoch=steps_per_epoch, total_steps=total_steps(config.train, steps_per_epoch),
                            started=started)
        if overrun := schedule_overruns(config.train, steps_per_epoch):
            warn(logger, accelerator, overrun)
        ema = WeightsEMA(accelerator, trainable.model, config.train.ema_decay) if config.train.ema_decay else None
        return cls(progress=progress, ema=ema, meter=TrainMeter(accelerator, config.train.batch_size),
                   selection=ModelSelection(config, accelerator, folder),
                   micro_batch=MicroBatchSize(accelerator, config.train) if adapts else None)

    def states(self) -> dict[str, Any]:
        """Checkpoints' states: one entry a part, each with state_dict and load_state_dict."""
        return {"progress": self.progress, "meter": self.meter, "selection": self.selection,
                **({"ema": self.ema.averaged} if self.ema else {}),
                **({"micro_batch": self.micro_batch} if self.micro_batch is not None else {})}


def main_process_observers(accelerator: Accelerator, task: Task, config: Config, trackers: list[str]) -> Observers:
    """Only the main process prints and writes run files; the other processes have no observers."""
    if not accelerator.is_main_process:
        return Observers([])
    return Observers([RunFolder(), Console(), *([Trackers(accelerator)] if trackers else []),
                      *task.observers(config)])
