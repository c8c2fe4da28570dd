"""`accel-train ARGS` with recorders and injected faults, for contracts that metrics.jsonl cannot show.

Run like the CLI (`accelerate launch tests/launched_probe.py train RECIPE ...`, or plain `python`); it runs
the real CLI and loop. The test hooks of the package live here, not in it.

Recorders (with PROBE_DIR set), written to PROBE_DIR/rank{R}.json for each process:
- `batches`: the training-set indices it read, one list per optimizer step (its slice of the global batch);
- `augment`: a fingerprint of the crop/flip parameters drawn for each augmented batch;
- `lr`: for every shipped schedule (with warmup), the LR at each optimizer step through a scheduler
  prepared by the same Accelerator setup the loop uses.
The recorders never change what the run computes: the fingerprint reuses the batch's own keys.

Faults:
- PROBE_NONFINITE=STEP:PROCESS makes that process's loss NaN at optimizer step STEP before backward, so the
  NaN crosses the gradient all-reduce as in life; STEP:PROCESS:grad leaves the loss finite and makes one
  gradient inf instead.
- PROBE_CRASH_AFTER_SAVE=STEP ends every process (exit 1, no clean-up) right after the checkpoint of STEP,
  as a machine failure would.
"""

import json
import math
import os
import sys

import torch

from accel_train import cli, data, loop

PROBE_STEPS_PER_EPOCH, PROBE_EPOCHS = 4, 3
record = {"batches": [], "augment": []}

_make_loader, _getitems, _crop_flip = loop.make_loader, data.InMemoryImages.__getitems__, data.random_crop_flip


def make_loader(dataset, cfg, global_batch, train, *args):
    dataset.dataset.probe_train = train
    return _make_loader(dataset, cfg, global_batch, train, *args)


def getitems(self, indices):
    if getattr(self, "probe_train", False):
        record["batches"].append([int(i) for i in indices])
    return _getitems(self, indices)


def random_crop_flip(images, padding, keys):
    count = min(8, len(keys))
    ramp = torch.arange(64.0).view(1, 1, 8, 8).expand(count, 1, 8, 8)
    record["augment"].append(_crop_flip(ramp, 2, keys[:count]).flatten().tolist()[::7])
    return _crop_flip(images, padding, keys)


def lr_traces(seed: int) -> dict:
    from accel_train.config import TrainConfig
    from accel_train.distributed import make_accelerator
    from accel_train.optim import build_optimizer, build_scheduler

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

    from accel_train.tasks import TASKS

    try:
        step, process, *where = spec.split(":")
        step, process, where = int(step), int(process), (where or ["loss"])[0]
        assert where in ("loss", "grad")
    except (ValueError, AssertionError):
        sys.exit(f"PROBE_NONFINITE={spec}: expected STEP:PROCESS or STEP:PROCESS:grad")
    calls = {"steps": 0}

    def poisoned(training_step):
        def training_step_with_fault(self, model, batch):
            terms = training_step(self, model, batch)
            calls["steps"] += 1
            if calls["steps"] != step or PartialState().process_index != process:
                return terms
            if where == "loss":
                return {**terms, "loss": terms["loss"] * math.nan}
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
    from accel_train.checkpoint import Checkpoints

    save = Checkpoints.save

    def save_then_crash(self, progress, *args, **kwargs):
        saved = save(self, progress, *args, **kwargs)
        if progress.step == step:
            sys.stdout.flush()
            os._exit(1)
        return saved

    Checkpoints.save = save_then_crash


if __name__ == "__main__":
    seed = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("seed=")), 0)
    if os.environ.get("PROBE_NONFINITE"):
        inject_nonfinite(os.environ["PROBE_NONFINITE"])
    if os.environ.get("PROBE_CRASH_AFTER_SAVE"):
        crash_after_save(int(os.environ["PROBE_CRASH_AFTER_SAVE"]))
    out = os.environ.get("PROBE_DIR")
    if out:
        record["lr"], rank = lr_traces(seed)  # before the run, which ends by destroying the process group
        loop.make_loader, data.random_crop_flip = make_loader, random_crop_flip
        data.InMemoryImages.__getitems__ = getitems
    try:
        cli.main(sys.argv[1:])
    except SystemExit as exit:
        if exit.code:
            raise
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
            json.dump(record, file)
