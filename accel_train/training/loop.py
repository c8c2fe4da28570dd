"""The training loop: a plain PyTorch loop plus Accelerate's prepare / backward / gather_for_metrics.

The same code runs on one CPU, one GPU, many GPUs and many machines; only the launch command changes:

    accel-train train fashion_mnist_cnn                                   # 1 process
    accelerate launch --config_file accelerate_configs/single_gpu.yaml -m accel_train train fashion_mnist_cnn
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml -m accel_train train fashion_mnist_cnn
    accelerate launch --config_file accelerate_configs/multi_node.yaml --machine_rank 0 \\
        --main_process_ip 10.0.0.1 -m accel_train train fashion_mnist_cnn   # then --machine_rank 1 on node 2
    accelerate launch --config_file accelerate_configs/cpu.yaml -m accel_train train fashion_mnist_cnn
    torchrun --nproc_per_node 2 -m accel_train train fashion_mnist_cnn
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 8 --rdzv_backend static --master_addr 10.0.0.1 \\
        --master_port 29500 -m accel_train train fashion_mnist_cnn           # then --node_rank 1 on node 2
    sbatch accelerate_configs/slurm_multi_node.sbatch train fashion_mnist_cnn   # SLURM, one launch per node
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc_per_node 8 --max_restarts 3 \\
        --rdzv_backend c10d --rdzv_endpoint 10.0.0.1:29500 --rdzv_id fm-1 \\
        --rdzv_conf join_timeout=600,last_call_timeout=30 -m accel_train train fashion_mnist_cnn \\
        output_dir=/shared/runs/fm resume=auto   # every machine: loses one and goes on (10.0.0.1 must survive)
    kubectl apply -f job.yaml   # Kubernetes: a copy of accelerate_configs/pytorchjob_elastic.yaml, edited

Before a multi-node run, `accel-train doctor` on each node names whatever would make the launch fail.

train.batch_size is global: N processes each take batch_size / N samples per optimizer step. Workload
specifics live in a Task (tasks/). Every point where all processes must agree is a call in this file:
whether a step is applied (guard.py, decided on the device), when the host reads that decision and stops
or warns (`guard.check`), when processes agree on a stop signal, when a checkpoint is saved, when the run
evaluates and ends; with micro_batch_size=auto, whether a step ran out of memory on any process (adaptive.py).
Observers (console, run folder, curves, trackers, pictures) only watch, on the main process. The watchdog
(run/watchdog.py) hears of every micro-batch: a process that stops is named, and the job ends.
"""

from __future__ import annotations

import time
from itertools import islice
from pathlib import Path

import torch
from accelerate.utils import set_seed

from accel_train.config import Config
from accel_train.console import say, warn
from accel_train.errors import Preempted
from accel_train.launch.distributed import (
    StopSignals,
    make_accelerator,
    maybe_sync_batchnorm,
    per_process_batch,
    round_up_to_world,
    run_info,
)
from accel_train.launch.settings import launcher_restarts
from accel_train.run.checkpoint import Checkpoints
from accel_train.run.layout import EMA_FILE, MODEL_FILE, results_of, stuck_dir, trackers_dir
from accel_train.run.observers import Console, Observers
from accel_train.run.progress import Progress
from accel_train.run.tracking import Trackers
from accel_train.run.watchdog import Watchdog
from accel_train.run.weights import export
from accel_train.run.writer import RunFolder
from accel_train.training.accumulation import StepTerms, accumulation_steps, fit_micro_batch
from accel_train.training.adaptive import AdaptiveEval, AdaptiveMicroBatch, adapts, out_of_memory_stops
from accel_train.training.ema import WeightsEMA
from accel_train.training.evaluation import evaluate
from accel_train.training.guard import NonFiniteGuard, clip_gradients
from accel_train.training.meter import TrainMeter
from accel_train.training.optim import build_optimizer, build_scheduler, log_every_steps, schedule_overruns, total_steps
from accel_train.training.selection import ModelSelection
from accel_train.workloads.data import (
    Data,
    build_dataset,
    hold_out_validation,
    make_loader,
    slow_input_advice,
    start_epoch,
)
from accel_train.workloads.models import tune_for_device
from accel_train.workloads.tasks import Task


def train(config: Config, task: Task, trackers: list[str], *, model: torch.nn.Module | None = None,
          train_dataset=None, eval_dataset=None) -> dict:
    """Train what `config` describes, checked before (api.check_training); a model or datasets given as objects
    take the place of its names. `trackers`: Accelerate's names (TensorBoard, W&B, ...)."""
    started = time.perf_counter()
    accelerator = make_accelerator(config.seed, config.train.collective_timeout_s, trackers,
                                   str(trackers_dir(config.output_dir)))
    per_process_batch(config.train.batch_size, accelerator, "train.batch_size")
    accumulation = accumulation_steps(config.train, accelerator.num_processes)  # None: micro_batch_size=auto
    auto = accumulation is None
    set_seed(config.seed)  # the same initial weights on every process
    with accelerator.local_main_process_first():  # the main process of each node fetches, the others then read
        train_data = build_dataset(config.data, train=True, given=train_dataset)
        test_data = build_dataset(config.data, train=False, given=eval_dataset)
    train_data, val_data = hold_out_validation(config.data, config.seed, train_data)  # None: evaluate on test
    task.setup(config, train_data)
    task.new_metric()  # evaluate needs a writable HF cache: say so now, not at the first evaluation
    model = model if model is not None else task.build_model(config, train_data)
    model = maybe_sync_batchnorm(model, config.model.sync_batchnorm, accelerator)
    model = tune_for_device(model, accelerator.device, config.train.channels_last, config.train.compile)
    if accumulation is None:  # micro_batch_size=auto: the largest that fits, recorded in config.yaml
        accumulation = fit_micro_batch(config, accelerator, task, model, train_data)
    accelerator.gradient_accumulation_steps = accumulation
    optimizer = build_optimizer(config.train, model)
    train_loader = make_loader(train_data, config.data, config.train.batch_size, True, accelerator.device, accumulation)
    eval_batch = round_up_to_world(config.train.eval_batch_size, accelerator)
    test_loader = make_loader(test_data, config.data, eval_batch, False, accelerator.device)
    val_loader = make_loader(val_data, config.data, eval_batch, False, accelerator.device) if val_data else None
    steps_per_epoch = len(train_loader) // accumulation
    scheduler = build_scheduler(config.train, optimizer, steps_per_epoch=steps_per_epoch)
    model, optimizer, train_loader, test_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, test_loader, val_loader, scheduler)
    set_seed(config.seed, device_specific=True)  # dropout differs per process

    progress = Progress(steps_per_epoch=steps_per_epoch, total_steps=total_steps(config.train, steps_per_epoch),
                        started=started)
    log_every = log_every_steps(config.train, progress.total_steps)
    if overrun := schedule_overruns(config.train, steps_per_epoch):
        warn(accelerator, overrun)
    ema = WeightsEMA(accelerator, model, config.train.ema_decay) if config.train.ema_decay else None
    meter, selection = TrainMeter(accelerator, config.train.batch_size), ModelSelection(config, accelerator)
    # micro_batch_size=auto (not under FSDP): a step or eval batch that runs out of memory is redone with half as many
    adaptive = AdaptiveMicroBatch(accelerator, config.train, task) if adapts(accelerator, auto) else None
    adaptive_eval = AdaptiveEval(accelerator, config.train.collective_timeout_s) if adaptive else None
    # What survives a resume beside the model, optimizer and scheduler: one entry a part.
    checkpoints = Checkpoints(config, accelerator, states={"progress": progress, "meter": meter,
                                                           "selection": selection,
                                                           **({"ema": ema.averaged} if ema else {}),
                                                           **({"micro_batch": adaptive} if adaptive else {})})
    start = checkpoints.resume(model, progress.steps_per_epoch, progress.total_steps)  # resume=auto / PATH
    guard = NonFiniteGuard(config.train.on_nonfinite, accelerator)
    step_terms = StepTerms(accumulation)
    observers = main_process_observers(config, accelerator, task, start, train_data, trackers)
    selecting_split = "val" if val_loader is not None else "test"
    if (config.checkpoint.best_metric or config.train.early_stop_patience) and val_loader is None:
        warn(accelerator, "checkpoint.best_metric / train.early_stop_patience choose on the test set, which then "
                          "no longer measures unseen data; set data.val_fraction (e.g. 0.1) to choose on a "
                          "validation split")

    def save(evaluated: bool) -> Path:
        guard.check(progress)  # never save past a non-finite step (stop policy)
        with meter.paused(), watchdog.paused():
            return checkpoints.save(progress, evaluated)

    def validate(epoch_ends: bool) -> bool:
        """Evaluate on the validation split (the test set without one), select, save when due. True: stop early."""
        guard.check(progress)  # nothing is evaluated past a non-finite step
        with meter.paused():
            progress.last_eval = evaluate(accelerator, model, task, val_loader or test_loader, ema, adaptive_eval,
                                          watchdog.mark_evaluation)
        observers.on_eval(progress, progress.last_eval, selecting_split)
        with watchdog.paused():  # exports model_best.safetensors
            stop_early = selection.update(progress.last_eval, ema.model if ema else model)
        stopping = signals.agreed(progress.step, now=True)
        last = stop_early or progress.step >= progress.total_steps
        if stopping or checkpoints.due_after_eval(progress.step, last, epoch_ends):
            saved = save(evaluated=True)
            if stopping:
                raise Preempted(signals.stop_message(progress.step, saved))
        if stop_early and accelerator.is_main_process:
            say(f"{selection.describe_stop()}: stopped at step {progress.step}")
        return stop_early

    # SIGTERM / SIGINT are agreed on; a process without progress is named (train.stuck_after_s); the observers
    # close however training ends (a stop line starts a line of its own)
    with StopSignals(accelerator, config.train.collective_timeout_s) as signals, observers, \
            Watchdog(accelerator, config.train, progress, stuck_dir(config.output_dir), signals) as watchdog:
        observers.on_train_start(progress)
        first_epoch = config.train.epochs if selection.stopped else start.epoch  # early stopping ended it
        for progress.epoch in range(first_epoch, config.train.epochs):
            model.train()
            start_epoch(train_loader, progress.epoch, config.seed)
            # The seedable sampler's order depends on (seed, epoch) only; skipping what the checkpoint already
            # trained makes a resumed epoch see exactly the batches an uninterrupted run would.
            # Micro-batches left over at the end, fewer than a step, are not trained (as drop_last drops a batch).
            skip = accumulation * (start.skip if progress.epoch == start.epoch else 0)
            micro_batches = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
            if skip:  # before accelerate 1.15 the skipping loader starts over at epoch 0: the wrong order
                start_epoch(micro_batches, progress.epoch, config.seed)
            epoch_left = islice(micro_batches, accumulation * progress.steps_per_epoch - skip)
            for number, batch in enumerate(meter.timed(epoch_left), start=skip):  # timed: the train lines' data_wait
                watchdog.mark()  # progress: no report while micro-batches come (train.stuck_after_s)
                batch = task.mix_batch(batch, progress.epoch, number)
                if adaptive:  # micro_batch_size=auto: the step's micro-batches are kept, then run together
                    if not adaptive.keep(batch):
                        continue
                    # Every process runs them without all-reduce; then all agree (CPU group) whether any ran out of
                    # memory, and if one did, all redo the step with half the micro-batch; then gradients are averaged.
                    terms = adaptive.step(model, progress, observers)
                else:  # no gradient all-reduce until the step's last micro-batch
                    with accelerator.accumulate(model), out_of_memory_stops(accelerator, "micro-batch", config.train):
                        terms = task.training_step(model, batch)
                        accelerator.backward(terms["loss"])  # divided by the accumulation steps
                    step_terms.add(terms)
                    if not accelerator.sync_gradients:
                        continue
                    terms = step_terms.mean()
                grad_norm = clip_gradients(accelerator, model, config.train.clip_grad_norm)
                lr = scheduler.get_last_lr()[0]
                with out_of_memory_stops(accelerator, "optimizer step"):
                    skipped = guard.step(optimizer, terms, grad_norm, progress.step + 1)  # on the device: no host read
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                if ema:
                    ema.update(model)
                meter.update(terms, skipped)
                progress.step += 1
                last = progress.step >= progress.total_steps
                if progress.step % log_every == 0 or last:
                    guard.check(progress)  # the host reads: all stop here, or warn
                    observers.on_log(progress, {**meter.compute(), "lr": lr})
                observers.on_step_end(progress)
                if signals.agreed(progress.step):  # SIGTERM / SIGINT on any process: all save and stop at this step
                    raise Preempted(signals.stop_message(progress.step, save(evaluated=False)))
                if last or progress.step % progress.steps_per_epoch == 0:
                    break  # the epoch's evaluation and its save follow
                if config.train.eval_every_steps and progress.step % config.train.eval_every_steps == 0:
                    if validate(epoch_ends=False):
                        break
                    model.train()
                elif checkpoints.due(progress.step):
                    save(evaluated=False)
            if selection.stopped or validate(epoch_ends=True) or progress.step >= progress.total_steps:
                break
        final = progress.last_eval
        if val_loader is not None:  # with a validation split, the test set is evaluated once, at the end
            with meter.paused():
                final = evaluate(accelerator, model, task, test_loader, ema, adaptive_eval, watchdog.mark_evaluation)
            observers.on_eval(progress, final, "test")
        with watchdog.paused():
            export(accelerator, model, Path(config.output_dir) / MODEL_FILE)
            if ema:
                export(accelerator, ema.model, Path(config.output_dir) / EMA_FILE)
            observers.on_train_end(progress)
    accelerator.end_training()  # destroys the process group: a clean exit on every process
    return final


def main_process_observers(config: Config, accelerator, task, start, train_data: Data,
                           trackers: list[str]) -> Observers:
    """Only the main process prints and writes run files; the other processes have no observers."""
    if not accelerator.is_main_process:
        return Observers([])
    info = run_info(accelerator)
    restart, max_restarts = launcher_restarts()
    change = start.world_size_change(info["world_size"])
    headline = (f"training {config.model.name} on {config.data.name}: {info['world_size']} process(es), "
                f"{f'{change}, ' if change else ''}{info['device']}, mixed precision {info['mixed_precision']}"
                f"{f', restart {restart} of at most {max_restarts} by the launcher' if restart else ''}")
    files = results_of(ema=bool(config.train.ema_decay), best=bool(config.checkpoint.best_metric),
                       curves=config.train.plot, classes=train_data.classes is not None,
                       checkpoints=bool(config.checkpoint.at_epoch_end or config.checkpoint.every_steps),
                       tracking=bool(trackers))
    watch = f"tensorboard --logdir {trackers_dir(config.output_dir)}" if "tensorboard" in trackers else None
    return Observers([RunFolder(config, info, start, train_data.classes),
                      Console(headline, config.output_dir, config.train.progress_bar, config.train.progress_every_s,
                              files, watch, slow_input_advice(config.data, train_data)),
                      *([Trackers(accelerator, config, info, resumed_here=start.in_output_dir)] if trackers else []),
                      *task.observers(config)])
