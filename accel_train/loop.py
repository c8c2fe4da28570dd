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

train.batch_size is global: N processes each take batch_size / N samples per optimizer step.
Workload specifics live in a Task (tasks.py, vae.py); features such as logging hook in (hooks.py), and so does
checkpointing (checkpoint.py): add `resume=auto` to any command above to continue a stopped run exactly.
guard.py clips gradients and stops (or skips) a step whose loss is not finite on some process.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate.utils import set_seed

from accel_train.checkpoint import check_resume, resume
from accel_train.config import Config
from accel_train.data import build_dataset, make_loader, start_epoch
from accel_train.distributed import (make_accelerator, maybe_sync_batchnorm, per_process_batch, round_up_to_world,
                                     tune_for_device)
from accel_train.errors import UserError
from accel_train.guard import NonFiniteGuard, clip_gradients
from accel_train.hooks import RunState, TrainMeter, default_hooks
from accel_train.optim import build_optimizer, build_scheduler, total_steps
from accel_train.tasks import TASKS


def train(config: Config) -> dict:
    task = TASKS.get(config.task)()
    task.check_config(config)
    check_resume(config)
    accelerator = make_accelerator(config.seed, config.train.collective_timeout_s)
    per_process_batch(config.train.batch_size, accelerator, "train.batch_size")
    set_seed(config.seed)  # the same initial weights on every process
    with accelerator.local_main_process_first():  # the main process of each node fetches, the others then read
        train_data = build_dataset(config.data, train=True)
        eval_data = build_dataset(config.data, train=False)
    model = maybe_sync_batchnorm(task.build_model(config, train_data), config.model.sync_batchnorm, accelerator)
    model = tune_for_device(model, accelerator, config.train.channels_last, config.train.compile)
    optimizer = build_optimizer(config.train, model)
    train_loader = make_loader(train_data, config.data, config.train.batch_size, True, accelerator.device)
    eval_loader = make_loader(eval_data, config.data, round_up_to_world(config.train.eval_batch_size, accelerator),
                              False, accelerator.device)
    scheduler = build_scheduler(config.train, optimizer, steps_per_epoch=len(train_loader))
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)
    set_seed(config.seed, device_specific=True)  # dropout (and file-backed augmentation) differ per process

    run = RunState(config, accelerator, len(train_loader), total_steps(config.train, len(train_loader)))
    start = resume(config, accelerator, model, run)  # resume=auto / PATH: weights, optimizer, scheduler, RNG, step
    hooks = default_hooks(config, accelerator, task.hooks(config))
    meter = TrainMeter(accelerator, config.train.batch_size)
    guard = NonFiniteGuard(config, accelerator)
    hooks.fire("on_train_start", run)
    for run.epoch in range(start.epoch, config.train.epochs):
        model.train()
        start_epoch(train_loader, run.epoch, config.seed)
        # The seedable sampler's order depends on (seed, epoch) only; skipping what the checkpoint already
        # trained makes a resumed epoch see exactly the batches an uninterrupted run would.
        resumed_epoch = run.epoch == start.epoch and start.skip
        for batch in accelerator.skip_first_batches(train_loader, start.skip) if resumed_epoch else train_loader:
            terms = task.training_step(model, batch)
            accelerator.backward(terms["loss"])
            grad_norm = clip_gradients(accelerator, model, config.train.clip_grad_norm)
            lr = scheduler.get_last_lr()[0]
            if guard.allows_step(run, terms, grad_norm):  # the same answer on every process; may raise on all
                optimizer.step()
                meter.update(terms)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            run.step += 1
            if run.step % config.train.log_every_steps == 0 or run.step == run.total_steps:
                hooks.fire("on_log", run, {**meter.compute(), "lr": lr})
            hooks.fire("on_step_end", run)
            if run.step >= run.total_steps or run.should_stop:
                break
        run.last_eval = evaluate(accelerator, model, task, eval_loader)
        hooks.fire("on_eval", run, run.last_eval)
        meter.exclude_time_since_last_step()
        if run.step >= run.total_steps or run.should_stop:
            break
    accelerator.save_model(model, config.output_dir)
    hooks.fire("on_train_end", run)
    accelerator.end_training()  # destroys the process group: a clean exit on every process
    return run.last_eval


@torch.no_grad()
def evaluate(accelerator, model, task, loader) -> dict:
    """Metrics over exactly the eval set: gather_for_metrics per batch drops the padding of the last batch."""
    model.eval()
    metric = task.new_metric()
    for batch in loader:
        metric.add_batch(**accelerator.gather_for_metrics(task.eval_step(model, batch)))
    return metric.compute()


def evaluate_checkpoint(config: Config, checkpoint: str) -> dict:
    """`accel-train eval`: load exported weights (safetensors) and evaluate them on the eval split."""
    from safetensors.torch import load_file

    task = TASKS.get(config.task)()
    task.check_config(config)
    weights = Path(checkpoint)
    if weights.is_dir():
        weights = weights / "model.safetensors"
    if not weights.is_file():
        raise UserError(f"checkpoint={checkpoint}: no model.safetensors there; pass the output_dir of a run or the file")
    accelerator = make_accelerator(config.seed)
    with accelerator.local_main_process_first():
        eval_data = build_dataset(config.data, train=False)
    model = task.build_model(config, eval_data)
    try:
        model.load_state_dict(load_file(str(weights)))
    except RuntimeError as err:
        detail = str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
        raise UserError(f"checkpoint={checkpoint} does not fit model.name={config.model.name} "
                        f"on {config.data.name}: {detail}") from None
    eval_loader = make_loader(eval_data, config.data, round_up_to_world(config.train.eval_batch_size, accelerator),
                              False, accelerator.device)
    model, eval_loader = accelerator.prepare(model, eval_loader)
    metrics = evaluate(accelerator, model, task, eval_loader)
    accelerator.end_training()
    return metrics
