"""`accel-train ARGS` with recorders and injected faults, for contracts that metrics.jsonl cannot show.

Run like the CLI (`accelerate launch tests/launched_probe.py train RECIPE ...`, or plain `python`); it runs
the real CLI and loop, with the recorders (tests/support/recorders.py) and faults (tests/support/faults.py) that the
PROBE_* variables ask for added through the package's hooks (accel_train.hooks): nothing of the package is
reassigned (tests/package/test_rooms_and_hooks.py checks this file for it).

Recorders (with PROBE_DIR set), written to PROBE_DIR/rank{R}.json for each process that ends its run without an error
(to PROBE_DIR/NAME/rank{R}.json with PROBE_DIR_PER_RUN=1 too, NAME the last part of the run's output_dir: a script
that launches several runs with one environment):
- `batches`: the training-set indices it read, one list per optimizer step (its slice of the global batch); for
  shards (data.name=shards, with data.num_workers=0 so that samples are read in the process) the sample ids, one
  list per micro-batch the model received (support.recorders.RecordedShardSamples);
- `crops` (with PROBE_CROPS=1 too): for each training batch the model received, its epoch and the sample index,
  crop offsets and flip of each image, found from the pixels (support.recorders.CropFinder; small noise datasets only);
- `inputs` (with PROBE_INPUTS=1 too): for each training batch the model received, its epoch and the label and a
  digest of each input (support.recorders.inputs_of_training_batches; with labels that are sample indices, what each
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
- `meter` and `step_lr` come from the same point (`optimizer_stepped`): what the loop applied;
- `metrics_at_start`: the lines of output_dir/metrics.jsonl when the process started (a resume keeps those of the
  steps before its checkpoint as they were);
- `initial_weights`: a digest of each tensor of the model as prepared, before the first step (support.recorders.digests;
  a resume restores its checkpoint after this).
The recorders never change what the run computes.

Faults:
- PROBE_NONFINITE=STEP:PROCESS makes that process's loss NaN at training forward pass STEP before backward, so the
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
- PROBE_SIGTERM_AT=STEP makes process 0 send itself SIGTERM during optimizer step STEP, and nothing more.
- PROBE_SLOW_SAVED=STEP:PROCESS:SECONDS makes the checkpoint of STEP end SECONDS later on that process (its
  checkpoint_saved hook waits): the other processes may end first, and torch's launcher then signals this one.
- PROBE_WAIT_FOR_SIGNAL=NAME:STEP: in the run whose output_dir is named NAME, every process waits after optimizer
  step STEP until it receives SIGTERM or SIGINT, so that a script that signals the launcher once a line is logged
  stops the run at a known step (with train.eval_every_steps=STEP the processes agree on the signal there). A resume
  of that run in the same folder starts past STEP and never waits.
- PROBE_LOAD_API_ERROR=1 makes Accelerator.load_state raise the TypeError accelerate 1.2 raised for an argument
  it did not know yet: a library that differs, with every checkpoint file whole.
"""

import json
import os
import sys
from contextlib import ExitStack

import torch

from accel_train import cli, hooks
from accel_train.config import TrainConfig
from accel_train.distributed.accelerator import make_accelerator
from accel_train.training.optim import build_optimizer, build_scheduler
from support import faults, recorders

PROBE_STEPS_PER_EPOCH, PROBE_EPOCHS = 4, 3


def numbers(name: str, spec: str, usage: str, count: int) -> list[int]:
    """The whole numbers a PROBE_* variable holds, separated by colons, or one line naming it."""
    parts = spec.split(":")
    if not all(part.isdigit() for part in parts) or not count <= len(parts) <= len(usage.split(":")):
        sys.exit(f"{name}={spec}: expected {usage}")
    return [int(part) for part in parts]


def whole_number(name: str) -> int:
    """The number a PROBE_* variable holds, or one line naming it (not a traceback)."""
    value = os.environ[name]
    if not value.isdigit():
        sys.exit(f"{name}={value}: expected a whole number")
    return int(value)


def nonfinite(spec: str) -> faults.NonFinite:
    try:
        step, process, *where = spec.split(":")
        step, process, where = int(step), int(process), (where or ["loss"])[0]
        assert where in ("loss", "grad", "value")
    except (ValueError, AssertionError):
        sys.exit(f"PROBE_NONFINITE={spec}: expected STEP:PROCESS, STEP:PROCESS:grad or STEP:PROCESS:value")
    return faults.NonFinite(step, process, where)


def faults_asked(run_name: str) -> list:
    """The faults the PROBE_* variables ask for, in the run whose output_dir is named `run_name`."""
    env, asked = os.environ, []
    if env.get("PROBE_NONFINITE"):
        asked.append(nonfinite(env["PROBE_NONFINITE"]))
    if env.get("PROBE_OOM_ABOVE"):
        asked.append(faults.OutOfMemoryAbove(whole_number("PROBE_OOM_ABOVE")))
    if env.get("PROBE_OOM_AT"):
        step, process, samples = [*numbers("PROBE_OOM_AT", env["PROBE_OOM_AT"], "STEP:PROCESS:SAMPLES", 2), 0][:3]
        asked.append(faults.OutOfMemoryAt(step, process, samples))
    if env.get("PROBE_EVAL_OOM"):
        asked.append(faults.EvalOutOfMemory(*numbers("PROBE_EVAL_OOM", env["PROBE_EVAL_OOM"], "PROCESS:SAMPLES", 2)))
    if env.get("PROBE_FSDP_ON_CPU"):
        asked.append(faults.FsdpOnCpu())
    if env.get("PROBE_CRASH_AFTER_SAVE"):
        asked.append(faults.CrashAfterSave(whole_number("PROBE_CRASH_AFTER_SAVE")))
    if env.get("PROBE_SLOW_SAVED"):
        asked.append(faults.SlowSaved(*numbers("PROBE_SLOW_SAVED", env["PROBE_SLOW_SAVED"], "STEP:PROCESS:SECONDS", 3)))
    if env.get("PROBE_LOAD_API_ERROR"):
        asked.append(faults.LoadApiError())
    if env.get("PROBE_SIGNALS_AT"):
        asked.append(faults.SignalsAt(whole_number("PROBE_SIGNALS_AT")))
    if env.get("PROBE_SIGTERM_AT"):
        asked.append(faults.SignalsAt(whole_number("PROBE_SIGTERM_AT"), second=False))
    if env.get("PROBE_NO_PROCESS_GROUP"):
        asked.append(faults.NoProcessGroup())
    if env.get("PROBE_WAIT_FOR_SIGNAL"):
        name, _, step = env["PROBE_WAIT_FOR_SIGNAL"].rpartition(":")
        if not name or not step.isdigit():
            sys.exit(f"PROBE_WAIT_FOR_SIGNAL={env['PROBE_WAIT_FOR_SIGNAL']}: expected NAME:STEP")
        if name == run_name:
            asked.append(faults.WaitForSignal(int(step)))
    return asked


def lines_of(folder: str, name: str) -> list[str]:
    """The lines of folder/name, with their ends; none where it does not exist."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return []
    with open(path) as file:
        return file.read().splitlines(keepends=True)


def lr_traces(seed: int) -> tuple[dict, int]:
    """For every shipped schedule (with warmup), the LR at each optimizer step through a scheduler prepared by the
    Accelerator setup the loop uses; and this process's index."""
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
            lrs.append(float(scheduler.get_last_lr()[0]))
            accelerator.backward(model(torch.ones(1, 2, device=accelerator.device)).sum())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        traces[schedule] = lrs
    return traces, accelerator.process_index


if __name__ == "__main__":
    seed = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("seed=")), 0)
    output_dir = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("output_dir=")), "")
    run_name = os.path.basename(os.path.normpath(output_dir)) if output_dir else ""
    out = os.environ.get("PROBE_DIR")
    if out and os.environ.get("PROBE_DIR_PER_RUN"):
        out = os.path.join(out, run_name)
    record = {"batches": [], "crops": [], "inputs": [], "allreduce_at": [], "eval_sets": [], "saves": [],
              "dropout": [], "meter": [], "step_lr": [], "metrics_at_start": lines_of(output_dir, "metrics.jsonl"),
              "initial_weights": {}}
    added = faults_asked(run_name)
    if out:
        record["lr"], rank = lr_traces(seed)  # before the run, which ends by destroying the process group
        added.append(recorders.Run(record))
        if os.environ.get("PROBE_CROPS"):
            added.append(recorders.Crops(record["crops"]))
        if os.environ.get("PROBE_INPUTS"):
            added.append(recorders.Inputs(record["inputs"]))
    try:
        with ExitStack() as stack:
            stack.enter_context(hooks.added(*added))
            cli.main(sys.argv[1:])
    except SystemExit as exit:
        if exit.code:
            raise
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
            json.dump(record, file)
