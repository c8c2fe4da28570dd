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

Before a multi-node run, `accel-train doctor` on each node names whatever would make the launch fail.

train.batch_size is global: N processes each take batch_size / N samples per optimizer step. Workload
specifics live in a Task (tasks/). Every point where all processes must agree is a call in this file:
whether a step is applied (guard.py, decided on the device), when the host reads that decision and stops
or warns (`guard.check`), when processes agree on a stop signal, when a checkpoint is saved, when the run
evaluates and ends. Observers (console, run folder, curves, trackers, pictures) only watch, on the main process.
"""

from __future__ import annotations

import time
from itertools import islice
from pathlib import Path

import torch
from accelerate.utils import set_seed

from accel_train.config import Config
from accel_train.errors import (
    DataNotFoundError,
    Preempted,
    UnreadableFileError,
    UserError,
    say,
    usual_permissions,
    warn,
    writing,
)
from accel_train.launch.distributed import (
    StopSignals,
    launcher_restarts,
    make_accelerator,
    maybe_sync_batchnorm,
    per_process_batch,
    round_up_to_world,
    run_info,
)
from accel_train.run.checkpoint import Checkpoints, check_resume
from accel_train.run.observers import Console, Observers, Progress
from accel_train.run.tracking import Trackers, tracker_names, trackers_dir
from accel_train.run.writer import MODEL_FILE, RunFolder, check_output_dir, check_split, results_of
from accel_train.training.accumulation import StepTerms, accumulation_steps, fit_micro_batch
from accel_train.training.ema import WeightsEMA
from accel_train.training.guard import NonFiniteGuard, clip_gradients
from accel_train.training.meter import TrainMeter
from accel_train.training.optim import build_optimizer, build_scheduler, log_every_steps, schedule_overruns, total_steps
from accel_train.training.selection import ModelSelection
from accel_train.workloads.data import build_dataset, hold_out_validation, make_loader, start_epoch
from accel_train.workloads.models import tune_for_device
from accel_train.workloads.tasks import Task, task_named
from accel_train.workloads.tasks.base import check_mixing


def train(config: Config, *, task: Task | None = None, model: torch.nn.Module | None = None,
          train_dataset=None, eval_dataset=None) -> dict:
    """Train what `config` describes; a task, model or datasets given as objects take the place of its names."""
    started = time.perf_counter()
    task = task if task is not None else task_named(config.task)
    task.check_config(config)
    check_mixing(task, config)
    trackers = tracker_names(config.train.log_with)  # TensorBoard, W&B, ... through Accelerate
    check_output_dir(config)
    check_resume(config)
    accelerator = make_accelerator(config.seed, config.train.collective_timeout_s, trackers, trackers_dir(config))
    per_process_batch(config.train.batch_size, accelerator, "train.batch_size")
    accumulation = accumulation_steps(config.train, accelerator.num_processes)  # None: micro_batch_size=auto
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
    set_seed(config.seed, device_specific=True)  # dropout (and file-backed augmentation) differ per process

    progress = Progress(steps_per_epoch=steps_per_epoch, total_steps=total_steps(config.train, steps_per_epoch),
                        started=started)
    log_every = log_every_steps(config.train, progress.total_steps)
    if overrun := schedule_overruns(config.train, steps_per_epoch):
        warn(accelerator, overrun)
    ema = WeightsEMA(accelerator, model, config.train.ema_decay) if config.train.ema_decay else None
    checkpoints = Checkpoints(config, accelerator)
    start = checkpoints.resume(model, progress.steps_per_epoch, progress.total_steps)  # resume=auto / PATH
    progress.step, progress.last_eval = start.step, start.last_eval
    meter, selection = TrainMeter(accelerator, config.train.batch_size), ModelSelection(config, accelerator)
    if start.loop_state:
        meter.load_state_dict(start.loop_state)
        selection.load_state_dict(start.loop_state.get("selection"))
        progress.elapsed_before_s = start.loop_state.get("elapsed_s", 0.0)
    guard = NonFiniteGuard(config.train.on_nonfinite, accelerator)
    step_terms = StepTerms(accumulation)
    observers = main_process_observers(config, accelerator, task, start, train_data.classes, trackers)
    selecting_split = "val" if val_loader is not None else "test"
    if (config.checkpoint.best_metric or config.train.early_stop_patience) and val_loader is None:
        warn(accelerator, "checkpoint.best_metric / train.early_stop_patience choose on the test set, which then "
                          "no longer measures unseen data; set data.val_fraction (e.g. 0.1) to choose on a "
                          "validation split")

    def save(evaluated: bool) -> Path:
        guard.check(progress)  # never save past a non-finite step (stop policy)
        with meter.paused():
            return checkpoints.save(progress, evaluated, {**meter.state_dict(), "selection": selection.state_dict(),
                                                          "elapsed_s": progress.elapsed_s()})

    def validate(epoch_ends: bool) -> bool:
        """Evaluate on the validation split (the test set without one), select, save when due. True: stop early."""
        guard.check(progress)  # nothing is evaluated past a non-finite step
        with meter.paused():
            progress.last_eval = evaluate(accelerator, model, task, val_loader or test_loader, ema)
        observers.on_eval(progress, progress.last_eval, selecting_split)
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

    with StopSignals(accelerator, config.train.collective_timeout_s) as signals:  # SIGTERM / SIGINT
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
            for number, batch in enumerate(islice(micro_batches, accumulation * progress.steps_per_epoch - skip),
                                           start=skip):
                with accelerator.accumulate(model):  # no gradient all-reduce until the step's last micro-batch
                    terms = task.training_step(model, task.mix_batch(batch, progress.epoch, number))
                    accelerator.backward(terms["loss"])  # divided by the accumulation steps
                step_terms.add(terms)
                if not accelerator.sync_gradients:
                    continue
                terms = step_terms.mean()
                grad_norm = clip_gradients(accelerator, model, config.train.clip_grad_norm)
                lr = scheduler.get_last_lr()[0]
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
                final = evaluate(accelerator, model, task, test_loader, ema)
            observers.on_eval(progress, final, "test")
        with writing(Path(config.output_dir) / MODEL_FILE, "exporting the trained model"):
            accelerator.save_model(model, config.output_dir)
            if ema:
                ema.export(config.output_dir)
            if accelerator.is_main_process:  # model.safetensors (or its shards over 10 GB) and model_ema
                usual_permissions(*Path(config.output_dir).glob("model*.safetensors"))
        observers.on_train_end(progress)
    accelerator.end_training()  # destroys the process group: a clean exit on every process
    return final


def main_process_observers(config: Config, accelerator, task, start, classes, trackers: list[str]) -> Observers:
    """Only the main process prints and writes run files; the other processes have no observers."""
    if not accelerator.is_main_process:
        return Observers([])
    info = run_info(accelerator)
    restart, max_restarts = launcher_restarts()
    headline = (f"training {config.model.name} on {config.data.name}: {info['world_size']} process(es), "
                f"{info['device']}, mixed precision {info['mixed_precision']}"
                f"{f', restart {restart} of at most {max_restarts} by the launcher' if restart else ''}")
    files = results_of(config, classes is not None, tracking=bool(trackers))
    watch = f"tensorboard --logdir {trackers_dir(config)}" if "tensorboard" in trackers else None
    return Observers([RunFolder(config, info, start, classes),
                      Console(headline, config.output_dir, config.train.progress_bar, config.train.progress_every_s,
                              files, watch),
                      *([Trackers(accelerator, config, info, resumed_here=start.in_output_dir)] if trackers else []),
                      *task.observers(config)])


@torch.no_grad()
def evaluate(accelerator, model, task, loader, ema: WeightsEMA | None = None) -> dict:
    """Metrics over exactly the eval set: gather_for_metrics per batch drops the padding of the last batch.
    With an EMA of the weights, its metrics take the plain names and the raw model's are raw_*."""
    model.eval()
    metric = task.new_metric()
    for batch in loader:
        with accelerator.autocast():  # the EMA's module is not prepared, so not autocast by Accelerate
            metric.add_batch(**accelerator.gather_for_metrics(task.eval_step(model, batch)))
    metrics = metric.compute()
    if ema is None:
        return metrics
    raw = {f"raw_{name}": value for name, value in metrics.items() if name != "num_samples"}
    return {**evaluate(accelerator, ema.model, task, loader), **raw}


def evaluate_checkpoint(config: Config, checkpoint: str, *, task: Task | None = None,
                        model: torch.nn.Module | None = None, eval_dataset=None, split: str = "test") -> dict:
    """`accel-train eval`: load exported weights (safetensors) and evaluate them on the test (or validation)
    split. The metrics come with `num_processes`, the world size that computed them: the same metrics from any
    world size is the contract, and a launch that formed no process group would show 1 here (if the world-size
    check let it run)."""
    check_split(split)
    task = task if task is not None else task_named(config.task)
    task.check_config(config)
    state = read_weights(weights_file(checkpoint))
    accelerator = make_accelerator(config.seed)
    with accelerator.local_main_process_first():
        if split == "val":
            eval_data = hold_out_validation(config.data, config.seed, build_dataset(config.data, train=True))[1]
            if eval_data is None:
                raise UserError(f"split=val: {checkpoint} was trained without a validation split "
                                "(data.val_fraction=0 and no val/ folder); evaluate split=test")
        else:
            eval_data = build_dataset(config.data, train=False, given=eval_dataset)
    task.setup(config, eval_data)
    model = load_weights(model if model is not None else task.build_model(config, eval_data), state, config,
                         checkpoint)
    eval_loader = make_loader(eval_data, config.data, round_up_to_world(config.train.eval_batch_size, accelerator),
                              False, accelerator.device)
    model, eval_loader = accelerator.prepare(model, eval_loader)
    metrics = evaluate(accelerator, model, task, eval_loader)
    accelerator.end_training()
    return {**metrics, "num_processes": accelerator.num_processes}


def weights_file(checkpoint: str) -> Path:
    """The model.safetensors of a run folder, of a checkpoint folder, or the file itself."""
    weights = Path(checkpoint)
    if weights.is_dir():
        weights = weights / MODEL_FILE
    if not weights.is_file():
        raise DataNotFoundError(f"checkpoint={checkpoint}: no {MODEL_FILE} there; pass the output_dir of a run, "
                                "a checkpoint folder or the file")
    return weights


def load_weights(model: torch.nn.Module, state: dict, config: Config, checkpoint: str) -> torch.nn.Module:
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        detail = str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
        raise UserError(f"checkpoint={checkpoint} does not fit model.name={config.model.name} "
                        f"on {config.data.name}: {detail}") from None
    return model


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or one line saying the file is damaged."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as err:  # safetensors' own error for a bad header, OSError for a short read
        raise UnreadableFileError(f"{path} is not a readable safetensors file ({str(err).splitlines()[0]}); it may "
                                  "be truncated or damaged: train again, or evaluate a checkpoint under "
                                  "OUTPUT_DIR/checkpoints/") from None
