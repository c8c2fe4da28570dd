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
    kubectl apply -f job.yaml   # the same with pytorchjob_store.yaml: the run folder in S3, no shared volume

Before a multi-node run, `accel-train doctor` on each node names whatever would make the launch fail.

train.batch_size is global: N processes each take batch_size / N samples per optimizer step. Workload
specifics live in a Task (workloads/tasks/); everything is made before the first batch by setup.py. Every point
where all processes must agree is a call in this file: whether a step is applied (`guard.step`, decided on the
device), when the host reads that decision and stops or warns (`guard.check`), the train line's average
(`meter.compute`), evaluation (`evaluate`, exact over the eval set) and early stopping (`selection.update`), a stop
signal (`signals.agreed`), a checkpoint (`save`) and the end; with micro_batch_size=auto the step itself agrees
whether any process ran out of memory (adaptive.py). Observers (console, run folder, curves, trackers, pictures)
only watch, on the main process. The watchdog (distributed/watchdog.py) hears of every micro-batch: a process that
stops is named, and the job ends.
"""

from __future__ import annotations

import logging

from accel_train import hooks
from accel_train.config import Config
from accel_train.console import note
from accel_train.distributed.accelerator import finish_command
from accel_train.errors import Preempted
from accel_train.run.layout import EMA_FILE, MODEL_FILE
from accel_train.run.place import RunPlace
from accel_train.run.weights import export
from accel_train.training.evaluation import evaluate
from accel_train.training.guard import clip_gradients
from accel_train.training.memory import out_of_memory_stops
from accel_train.training.setup import Run, Sources, set_up
from accel_train.workloads.tasks import Task

logger = logging.getLogger(__name__)


def train(config: Config, task: Task, sources: Sources, trackers: list[str], place: RunPlace, *, model=None,
          train_dataset=None, eval_dataset=None) -> dict:
    """Train what `config` describes, checked before (api.check_training, which found the `sources` of its data and
    initial weights); a model or datasets given as objects take the place of its names. `trackers`: Accelerate's
    names (TensorBoard, W&B, ...); `place`: where the run folder lives (opened by the checks). Returns the final
    evaluation's metrics, the same on every process."""
    run = set_up(config, task, sources, trackers, place, model, train_dataset, eval_dataset)  # resumed as `resume` says
    accelerator, model, progress, guard, meter = run.accelerator, run.model, run.progress, run.guard, run.meter
    # SIGTERM / SIGINT are agreed on; a process without progress is named (train.stuck_after_s); the observers
    # close however training ends (a stop line starts a line of its own)
    # ... and however it ends, the pending checkpoint is committed and the run's files are in a store, within a bound,
    # while a signal still only records: torch's launcher sends SIGTERM to the others as soon as one process exits 75
    with run.signals as signals, run.checkpoints, run.observers as observers, run.watchdog:
        observers.on_train_start(run.state)
        for progress.epoch in run.epochs():
            model.train()
            for micro_batches in run.batches.steps(progress.epoch):  # a resumed epoch goes on at its checkpoint
                terms = run.step(model, micro_batches)  # forward and backward; gradients averaged over processes
                grad_norm = clip_gradients(accelerator, model, config.train.clip_grad_norm)
                lr = run.scheduler.get_last_lr()[0]
                with out_of_memory_stops(accelerator, "optimizer step"):
                    skipped = guard.step(run.optimizer, terms, grad_norm, progress.step + 1)  # on the device
                run.scheduler.step(skipped)  # a skipped step leaves the LR schedule where it was
                run.optimizer.zero_grad(set_to_none=True)
                if run.ema:
                    run.ema.update(model)
                meter.update(terms, skipped)
                progress.step += 1
                hooks.every().optimizer_stepped(progress, terms, skipped, lr)
                if run.line_due():
                    guard.check(progress)  # the host reads the guard's decision: every process stops here, or warns
                    # averaged over processes; fp16 adds its overflow steps and loss scale
                    observers.on_log(run.state, {**meter.compute(lr), **guard.line_values()})
                observers.on_step_end(run.state)

                evaluated = run.evaluation_due()  # every train.eval_every_steps, each epoch's end, the last step
                stop_early = evaluated and validate(run)  # True: early stopping ends the run
                stopping = signals.agreed(progress.step, now=evaluated)  # SIGTERM / SIGINT on any process
                if stopping or run.checkpoints.due(progress, last=stop_early or progress.finished):
                    saved = save(run, evaluated)
                if stopping:
                    raise Preempted(signals.stop_message(progress.step, saved))
                if stop_early:
                    note(logger, accelerator, f"{run.selection.describe_stop()}: stopped at step {progress.step}")
                    break
        final = finish(run)
    finish_command(accelerator)  # the trackers finish; the process group ends with the process
    return final


def validate(run: Run) -> bool:
    """Evaluate on the validation split (the test set without one) and select on it: True when early stopping ends
    the run, on every process alike."""
    run.guard.check(run.progress)  # nothing is evaluated past a non-finite step
    with run.meter.paused():
        run.progress.last_eval = evaluate(run.accelerator, run.model, run.task, run.selecting_loader, run.ema,
                                          run.adaptive_eval, run.watchdog.mark_evaluation, run.selecting_finish)
    run.observers.on_eval(run.state, run.progress.last_eval, run.selecting_split)
    with run.watchdog.paused():  # it may export model_best.safetensors
        stop_early = run.selection.update(run.progress.last_eval, run.ema.model if run.ema else run.model)
    run.model.train()
    return stop_early


def save(run: Run, evaluated: bool) -> str | None:
    """A checkpoint of the step just taken, on every process; `evaluated`: after that step's evaluation."""
    run.guard.check(run.progress)  # never save past a non-finite step (stop policy)
    with run.meter.paused(), run.watchdog.paused():
        return run.checkpoints.save(run.progress, evaluated)


def finish(run: Run) -> dict:
    """A start that applied no step ends as a non-finite stop does; else the test set once more where a validation
    split chose (the test metrics are the run's result), the exported weights, and the observers' end; the final
    metrics."""
    run.guard.refuse_a_start_without_an_applied_step(run.progress, run.start.step)  # every step skipped: exit 5
    final = run.progress.last_eval
    if run.test_loader is not None:
        with run.meter.paused():
            final = evaluate(run.accelerator, run.model, run.task, run.test_loader, run.ema, run.adaptive_eval,
                             run.watchdog.mark_evaluation, run.test_finish)
        run.observers.on_eval(run.state, final, "test")
    with run.watchdog.paused():
        folder = run.state.place.folder  # for a URL, staged: the store gets it before the run ends
        export(run.accelerator, run.model, folder / MODEL_FILE)
        if run.ema:
            export(run.accelerator, run.ema.model, folder / EMA_FILE)
        run.checkpoints.settle(at_end=True)  # the last checkpoint's line before the summary
        run.observers.on_train_end(run.state)
    return final
