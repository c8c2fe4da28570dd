"""`accel-train ARGS` with recorders, for contracts that metrics.jsonl cannot show.

Launched like the CLI (`accelerate launch tests/launched_probe.py train RECIPE ...`); runs the real CLI
and loop, and writes PROBE_DIR/rank{R}.json with, for this process:
- `batches`: the training-set indices it read, one list per optimizer step (its slice of the global batch);
- `augment`: a fingerprint of the crop/flip parameters drawn for each augmented batch;
- `lr`: for every shipped schedule (with warmup), the LR at each optimizer step through a scheduler
  prepared by the same Accelerator setup the loop uses.
The recorders never change what the run computes: the fingerprint reuses the batch's own keys.
"""

import json
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


if __name__ == "__main__":
    seed = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("seed=")), 0)
    record["lr"], rank = lr_traces(seed)  # before the run, which ends by destroying the process group
    loop.make_loader, data.InMemoryImages.__getitems__, data.random_crop_flip = make_loader, getitems, random_crop_flip
    try:
        cli.main(sys.argv[1:])
    except SystemExit as exit:
        if exit.code:
            raise
    out = os.environ["PROBE_DIR"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump(record, file)
