"""`accel-train ARGS` with recorders and injected faults, for contracts that metrics.jsonl cannot show.

Run like the CLI (`accelerate launch tests/launched_probe.py train RECIPE ...`, or plain `python`); it runs
the real CLI and loop. The test hooks of the package live here, not in it.

Recorders (with PROBE_DIR set), written to PROBE_DIR/rank{R}.json for each process:
- `batches`: the training-set indices it read, one list per optimizer step (its slice of the global batch);
- `crops` (with PROBE_CROPS=1 too): for each training batch the model received, its epoch and the sample index,
  crop offsets and flip of each image, found from the pixels (conftest.CropFinder; small noise datasets only);
- `inputs` (with PROBE_INPUTS=1 too): for each training batch the model received, its epoch and the label and a
  digest of each input (conftest.inputs_of_training_batches; with labels that are sample indices, what each
  sample's transforms drew);
- `lr`: for every shipped schedule (with warmup), the LR at each optimizer step through a scheduler
  prepared by the same Accelerator setup the loop uses;
- `eval_sets`: for each evaluation loader (validation, test), the (label, pixel sum) of each of its samples;
- `saves`: the step of every checkpoint this process saved;
- `dropout`: for each training forward pass of the model's first dropout layer, a digest of the random state
  it draws its mask from (the masks themselves also depend on which inputs are zero, which differ anyway);
- `meter`: the loss and the skip flag of every optimizer step, as the train-line meter received them;
- `step_lr`: [optimizer step, LR it applied] for every optimizer step of the run;
- `allreduce_at`: the training forward passes (micro-steps, counted from 1) after which DDP all-reduced
  gradients (its communication hook ran), once per micro-step.
The recorders never change what the run computes.

Faults:
- PROBE_NONFINITE=STEP:PROCESS makes that process's loss NaN at optimizer step STEP before backward, so the
  NaN crosses the gradient all-reduce as in life; STEP:PROCESS:grad leaves the loss finite and makes one
  gradient inf instead; STEP:PROCESS:value makes only the loss's value NaN (a NaN constant added to it) and
  leaves every gradient finite, so nothing non-finite crosses the gradient all-reduce: the other processes
  learn of it through the guard's own reduction alone.
- PROBE_OOM_ABOVE=N makes a micro-batch of more than N samples raise the device's out-of-memory error while
  train.micro_batch_size=auto searches (as a GPU with room for N would).
- PROBE_OOM_AT=STEP:PROCESS[:SAMPLES] makes that process's training forward passes raise torch's out-of-memory error
  (`CUDA out of memory. ...`, at the end of the forward pass, as a device that filled up there would) from optimizer
  step STEP on, whenever they hold more than SAMPLES samples (default 0: any pass). The search before training
  (PROBE_OOM_ABOVE's) is left alone.
- PROBE_EVAL_OOM=PROCESS:SAMPLES does the same to that process's evaluation forward passes of more than SAMPLES
  samples, at every evaluation.
- PROBE_FSDP_ON_CPU=1: Accelerate forms FSDP only on GPUs (on CPU a FSDP profile trains with DDP); this makes
  the Accelerator take the FSDP path anyway, with the plugin the profile describes, so the loop, checkpoints and
  export run through FSDP2's fully_shard on a gloo group.
- PROBE_CRASH_AFTER_SAVE=STEP ends every process (exit 1, no clean-up) right after the checkpoint of STEP,
  as a machine failure would.
- PROBE_NO_PROCESS_GROUP=1 makes accel-train believe a GPU is present on this CPU-only machine, so it does not
  tell Accelerate to use the CPU: Accelerate then forms no process group and every process runs alone, the
  silent failure the world-size check stops.
- PROBE_SIGNALS_AT=STEP makes process 0 send itself SIGTERM during optimizer step STEP, then SIGINT (a second
  signal, as a launcher forwarding Ctrl-C again) as soon as the checkpoint that the first one asked for starts.
- PROBE_LOAD_API_ERROR=1 makes Accelerator.load_state raise the TypeError accelerate 1.2 raised for an argument
  it did not know yet: a library that differs, with every checkpoint file whole.
"""

import hashlib
import json
import math
import os
import sys
from contextlib import ExitStack

import torch

from accel_train import cli
from accel_train.training import loop
from accel_train import data
from conftest import crops_of_training_batches, inputs_of_training_batches

PROBE_STEPS_PER_EPOCH, PROBE_EPOCHS = 4, 3
record = {"batches": [], "crops": [], "inputs": [], "allreduce_at": [], "eval_sets": [], "saves": [], "dropout": [],
          "meter": [], "step_lr": []}

_make_loader, _getitems = loop.make_loader, data.InMemoryImages.__getitems__


def make_loader(dataset, cfg, global_batch, train, *args):
    dataset.dataset.probe_train = train
    samples = dataset.dataset
    if not train and hasattr(samples, "labels"):
        record["eval_sets"].append(list(zip(samples.labels.tolist(), samples.images.flatten(1).sum(1).tolist())))
    return _make_loader(dataset, cfg, global_batch, train, *args)


def getitems(self, indices):
    if getattr(self, "probe_train", False):
        record["batches"].append([int(i) for i in indices])
    return _getitems(self, indices)


def record_gradient_allreduce() -> None:
    from accelerate import Accelerator
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    prepare_model, forwards = Accelerator.prepare_model, {"training": 0}

    def count(module, args):
        forwards["training"] += module.training

    def hook(process_group, bucket):
        if forwards["training"] not in record["allreduce_at"]:
            record["allreduce_at"].append(forwards["training"])
        return allreduce_hook(process_group, bucket)

    def prepare_model_with_recorder(self, model, *args, **kwargs):
        model = prepare_model(self, model, *args, **kwargs)
        if isinstance(model, DistributedDataParallel):
            model.register_forward_pre_hook(count)
            model.register_comm_hook(None, hook)
        return model

    Accelerator.prepare_model = prepare_model_with_recorder


def out_of_memory_above(limit: int) -> None:
    from accel_train.training import accumulation

    try_micro_batch = accumulation.try_micro_batch

    def try_or_run_out(accelerator, task, model, data, probe_data, size):
        if size > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} samples (PROBE_OOM_ABOVE)")
        return try_micro_batch(accelerator, task, model, data, probe_data, size)

    accumulation.try_micro_batch = try_or_run_out


def numbers(name: str, spec: str, usage: str, count: int) -> list[int]:
    """The whole numbers a PROBE_* variable holds, separated by colons, or one line naming it."""
    parts = spec.split(":")
    if not all(part.isdigit() for part in parts) or not count <= len(parts) <= len(usage.split(":")):
        sys.exit(f"{name}={spec}: expected {usage}")
    return [int(part) for part in parts]


def out_of_memory_at(spec: str, setattr=setattr) -> None:
    """PROBE_OOM_AT. `setattr`: pytest's monkeypatch.setattr in a test that runs training in its own process."""
    from accelerate import PartialState
    from accelerate.utils import find_batch_size

    from accel_train.training import accumulation
    from accel_train.workloads.tasks import TASKS

    step, process, samples = [*numbers("PROBE_OOM_AT", spec, "STEP:PROCESS:SAMPLES", 2), 0][:3]
    now, try_micro_batch = {}, accumulation.try_micro_batch

    class Watched(loop.Progress):  # the loop's own count of optimizer steps, resumes included
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            now["progress"] = self

    def searching(*args, **kwargs):  # before this run's Progress: no fault (a previous run's Progress is stale)
        now.pop("progress", None)
        return try_micro_batch(*args, **kwargs)

    def runs_out(training_step):
        def training_step_or_out_of_memory(self, model, batch):
            terms = training_step(self, model, batch)
            size = find_batch_size(batch)
            if ("progress" in now and now["progress"].step + 1 >= step and size > samples
                    and PartialState().process_index == process):
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} samples (PROBE_OOM_AT)")
            return terms
        return training_step_or_out_of_memory

    setattr(loop, "Progress", Watched)
    setattr(accumulation, "try_micro_batch", searching)
    for name in TASKS.names():
        task = TASKS.get(name)
        setattr(task, "training_step", runs_out(task.training_step))


def eval_out_of_memory(spec: str, setattr=setattr) -> None:
    """PROBE_EVAL_OOM."""
    from accelerate import PartialState
    from accelerate.utils import find_batch_size

    from accel_train.workloads.tasks import TASKS

    process, samples = numbers("PROBE_EVAL_OOM", spec, "PROCESS:SAMPLES", 2)

    def runs_out(eval_step):
        def eval_step_or_out_of_memory(self, model, batch):
            outputs = eval_step(self, model, batch)
            size = find_batch_size(batch)
            if size > samples and PartialState().process_index == process:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} samples (PROBE_EVAL_OOM)")
            return outputs
        return eval_step_or_out_of_memory

    for name in TASKS.names():
        task = TASKS.get(name)
        setattr(task, "eval_step", runs_out(task.eval_step))


def fsdp_on_cpu() -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from accel_train.launch import distributed
    from accel_train.training import evaluation

    make_accelerator = distributed.make_accelerator

    def make_fsdp_accelerator(*args, **kwargs):
        accelerator = make_accelerator(*args, **kwargs)
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the profile's FSDP_* variables
        return accelerator

    distributed.make_accelerator = loop.make_accelerator = evaluation.make_accelerator = make_fsdp_accelerator


def record_dropout_and_meter() -> None:
    from accel_train.training.meter import TrainMeter

    dropout_forward, update = torch.nn.Dropout.forward, TrainMeter.update
    first = {}

    def dropout_and_record(self, input):
        if self.training and first.setdefault("layer", self) is self:
            state = (torch.cuda.get_rng_state() if input.is_cuda else torch.get_rng_state()).numpy().tobytes()
            record["dropout"].append(hashlib.sha1(state).hexdigest())
        return dropout_forward(self, input)

    def update_and_record(self, terms, skipped):
        record["meter"].append([terms["loss"].item(), skipped.item()])
        return update(self, terms, skipped)

    torch.nn.Dropout.forward, TrainMeter.update = dropout_and_record, update_and_record


def record_step_lr() -> None:
    from accel_train.training.guard import NonFiniteGuard

    guarded_step = NonFiniteGuard.step

    def step_and_record(self, optimizer, terms, grad_norm, step):
        record["step_lr"].append([step, optimizer.param_groups[0]["lr"]])
        return guarded_step(self, optimizer, terms, grad_norm, step)

    NonFiniteGuard.step = step_and_record


def signals_at(step: int) -> None:
    import signal

    from accelerate import PartialState

    from accel_train.run.checkpoint import Checkpoints
    from accel_train.training.meter import TrainMeter

    update, save, calls = TrainMeter.update, Checkpoints.save, {"steps": 0, "signalled": False}

    def update_then_signal(self, terms, skipped):
        calls["steps"] += 1
        if calls["steps"] == step and PartialState().process_index == 0:
            calls["signalled"] = True
            os.kill(os.getpid(), signal.SIGTERM)
        return update(self, terms, skipped)

    def signal_again_then_save(self, *args, **kwargs):
        if calls["signalled"]:
            os.kill(os.getpid(), signal.SIGINT)
        return save(self, *args, **kwargs)

    TrainMeter.update, Checkpoints.save = update_then_signal, signal_again_then_save


def record_saves() -> None:
    from accel_train.run.checkpoint import Checkpoints

    save = Checkpoints.save

    def save_and_record(self, progress, *args, **kwargs):
        record["saves"].append(progress.step)
        return save(self, progress, *args, **kwargs)

    Checkpoints.save = save_and_record


def lr_traces(seed: int) -> dict:
    from accel_train.config import TrainConfig
    from accel_train.launch.distributed import make_accelerator
    from accel_train.training.optim import build_optimizer, build_scheduler

    accelerator = make_accelerator(seed)
    traces = {}
    for schedule in ("constant", "step", "exponential", "cosine"):
        cfg = TrainConfig(schedule=schedule, warmup_steps=3, lr_gamma=0.5, epochs=PROBE_EPOCHS, lr=0.1)
        model = torch.nn.Linear(2, 1)
        optimizer = build_optimizer(cfg, model)
        scheduler = build_scheduler(cfg, optimizer, steps_per_epoch=PROBE_STEPS_PER_EPOCH)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        lrs = []
        for _ in range(PROBE_STEPS_PER_EPOCH * PROBE_EPOCHS):
            lrs.append(scheduler.get_last_lr()[0])
            accelerator.backward(model(torch.ones(1, 2, device=accelerator.device)).sum())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        traces[schedule] = lrs
    return traces, accelerator.process_index


def inject_nonfinite(spec: str) -> None:
    from accelerate import PartialState

    from accel_train.workloads.tasks import TASKS

    try:
        step, process, *where = spec.split(":")
        step, process, where = int(step), int(process), (where or ["loss"])[0]
        assert where in ("loss", "grad", "value")
    except (ValueError, AssertionError):
        sys.exit(f"PROBE_NONFINITE={spec}: expected STEP:PROCESS, STEP:PROCESS:grad or STEP:PROCESS:value")
    calls = {"steps": 0}

    def poisoned(training_step):
        def training_step_with_fault(self, model, batch):
            terms = training_step(self, model, batch)
            calls["steps"] += 1
            if calls["steps"] != step or PartialState().process_index != process:
                return terms
            if where == "loss":
                return {**terms, "loss": terms["loss"] * math.nan}
            if where == "value":  # the constant has no gradient: backward gives the finite gradients of the loss
                return {**terms, "loss": terms["loss"] + torch.tensor(math.nan, device=terms["loss"].device)}
            param, fired = next(p for p in model.parameters() if p.requires_grad), []

            def infinite_once(grad):  # runs before the all-reduce, like an overflow in this process's backward
                if not fired:
                    fired.append(True)
                    return torch.full_like(grad, math.inf)
                return None

            param.register_hook(infinite_once)
            return terms
        return training_step_with_fault

    for name in TASKS.names():
        task = TASKS.get(name)
        task.training_step = poisoned(task.training_step)


def crash_after_save(step: int) -> None:
    from accel_train.run.checkpoint import Checkpoints

    save = Checkpoints.save

    def save_then_crash(self, progress, *args, **kwargs):
        saved = save(self, progress, *args, **kwargs)
        if progress.step == step:
            sys.stdout.flush()
            os._exit(1)
        return saved

    Checkpoints.save = save_then_crash


def no_process_group() -> None:
    from accel_train.launch import distributed

    distributed.has_accelerator_device = lambda: True


def load_api_error() -> None:
    from accelerate import Accelerator

    def older_load_state(self, input_dir=None, **kwargs):
        raise TypeError("load_model() got an unexpected keyword argument 'load_kwargs'")

    Accelerator.load_state = older_load_state


def whole_number(name: str) -> int:
    """The number a PROBE_* variable holds, or one line naming it (not a traceback)."""
    value = os.environ[name]
    if not value.isdigit():
        sys.exit(f"{name}={value}: expected a whole number")
    return int(value)


if __name__ == "__main__":
    seed = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("seed=")), 0)
    if os.environ.get("PROBE_NONFINITE"):
        inject_nonfinite(os.environ["PROBE_NONFINITE"])
    if os.environ.get("PROBE_OOM_ABOVE"):
        out_of_memory_above(whole_number("PROBE_OOM_ABOVE"))
    if os.environ.get("PROBE_OOM_AT"):
        out_of_memory_at(os.environ["PROBE_OOM_AT"])
    if os.environ.get("PROBE_EVAL_OOM"):
        eval_out_of_memory(os.environ["PROBE_EVAL_OOM"])
    if os.environ.get("PROBE_FSDP_ON_CPU"):
        fsdp_on_cpu()
    if os.environ.get("PROBE_CRASH_AFTER_SAVE"):
        crash_after_save(whole_number("PROBE_CRASH_AFTER_SAVE"))
    if os.environ.get("PROBE_LOAD_API_ERROR"):
        load_api_error()
    if os.environ.get("PROBE_SIGNALS_AT"):
        signals_at(whole_number("PROBE_SIGNALS_AT"))
    if os.environ.get("PROBE_NO_PROCESS_GROUP"):
        no_process_group()
    out = os.environ.get("PROBE_DIR")
    if out:
        record["lr"], rank = lr_traces(seed)  # before the run, which ends by destroying the process group
        loop.make_loader = make_loader
        data.InMemoryImages.__getitems__ = getitems
        record_gradient_allreduce()
        record_saves()
        record_dropout_and_meter()
        record_step_lr()
    try:
        with ExitStack() as recorders:
            if out and os.environ.get("PROBE_CROPS"):
                recorders.enter_context(crops_of_training_batches(record["crops"]))
            if out and os.environ.get("PROBE_INPUTS"):
                recorders.enter_context(inputs_of_training_batches(record["inputs"]))
            cli.main(sys.argv[1:])
    except SystemExit as exit:
        if exit.code:
            raise
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
            json.dump(record, file)
