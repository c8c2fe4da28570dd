"""data.num_workers=auto: the DataLoader workers each process gets, chosen from a measurement on this machine.

Before the loaders are made, the main process loads a few of the run's micro-batches itself (and finishes them,
where the workers would: a CPU run) and times a training micro-step of the model on them (forward and backward, the
weights untouched, BatchNorm statistics put back, the random streams forked): `workers_to_feed` turns the two times
into a count. The count is written into the config, as micro_batch_size=auto's is, and said in one line. Nothing a
run computes depends on it: every augmentation draw is keyed by sample (data/keyed.py), with any number of workers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device

from accel_train.config import Config
from accel_train.console import note
from accel_train.data import Data, make_loader
from accel_train.data.decode import model_input
from accel_train.distributed.collectives import main_value
from accel_train.distributed.devices import dataloader_workers, finish_runs_in_workers

logger = logging.getLogger(__name__)

# Loading in the main process costs a step at most this share of its time: no worker is worth starting then
MAIN_PROCESS_SHARE = 0.05
# Workers' output against the step's demand: a fifth to spare, for the noise of a measurement of a few batches
SPARE = 1.2
MEASURED_BATCHES = 3  # the first loaded and stepped is a warm-up (decoder and kernels loaded, files first read)


def workers_to_feed(load_s: float, step_s: float, cores: int) -> int:
    """The rule of data.num_workers=auto, from the seconds a micro-batch takes to load in the main process (and to
    finish, where workers would) and the seconds a training micro-step takes: none where loading adds at most
    MAIN_PROCESS_SHARE (5%) to a step; else the fewest workers n that load n batches in the time of n steps with a
    fifth to spare (n >= 1.2 x load / step), at least 1 and at most `cores` (the usable cores per process, at most
    8: data.num_workers=auto's cap before it measured)."""
    if load_s <= MAIN_PROCESS_SHARE * step_s:
        return 0
    return max(1, min(cores, math.ceil(SPARE * load_s / step_s)))


def choose_workers(config: Config, accelerator: Accelerator, task, model: torch.nn.Module | None, data: Data,
                   accumulation: int) -> None:
    """data.num_workers=auto: measured (measured_seconds), written into config.data and said in one line; a number
    given stays. `model` None (FSDP: the model is sharded, and a step a collective): the usable cores, as before.
    Every process takes the main process's count."""
    cfg = config.data
    if cfg.num_workers != "auto" or data.in_memory and cfg.on_device:  # the latter: served without workers
        return
    cores = dataloader_workers("auto")
    finish_here = finish_runs_in_workers(accelerator.device, 1)  # a CPU run: workers would finish, loads count it
    micro_batch = config.train.batch_size // accelerator.num_processes // accumulation
    times = None if model is None else measured_seconds(accelerator, task, model, data, cfg, micro_batch, finish_here)
    if times is None:
        workers, why = cores, "the usable cores (the model sharded, or too few samples to measure)"
    else:
        load_s, step_s = times
        workers = workers_to_feed(load_s, step_s, cores)
        finished = " and finish" if finish_here else ""
        why = (f"a micro-batch of {micro_batch} took {load_s * 1e3:,.1f} ms to load{finished} in the main process, "
               f"a training micro-step {step_s * 1e3:,.1f} ms; {cores} usable cores")
    cfg.num_workers = main_value(workers, accelerator)
    note(logger, accelerator, f"data.num_workers=auto: {cfg.num_workers} DataLoader worker(s) a process ({why})")


def measured_seconds(accelerator: Accelerator, task, model: torch.nn.Module, data: Data, cfg, micro_batch: int,
                     finish_here: bool) -> tuple[float, float] | None:
    """(seconds to load a micro-batch in this process, seconds of a training micro-step on it): medians after a
    warm-up one; None where the training split holds fewer than MEASURED_BATCHES micro-batches. The run is left as
    it was: the samples are keyed (their draws do not move), the weights untouched, the buffers put back and the
    CPU and CUDA random streams forked (the run seeds them again after preparing, in any case)."""
    if len(data.dataset) < MEASURED_BATCHES * micro_batch:
        return None
    device = accelerator.device
    loader = make_loader(data, dataclasses.replace(cfg, num_workers=0), micro_batch, False, device)
    iterator, batches, loads = iter(loader), [], []
    for _ in range(MEASURED_BATCHES):
        started = time.perf_counter()
        batch = next(iterator)
        batches.append(model_input(data.finish, batch) if finish_here else batch)
        loads.append(time.perf_counter() - started)
    steps = _step_times(accelerator, task, model, [send_to_device(batch, device) for batch in batches],
                        None if finish_here else data.finish)
    return statistics.median(loads[1:]), statistics.median(steps[1:])


def _step_times(accelerator: Accelerator, task, model: torch.nn.Module, batches: list, finish) -> list[float]:
    """Each batch's training micro-step (finished on the device first, as the loop does), timed to its end on the
    device; the model as it was afterwards."""
    buffers = {name: value.clone() for name, value in model.named_buffers()}  # BatchNorm statistics: small
    if any(param.device != accelerator.device for param in model.parameters()):
        model.to(accelerator.device)
    model.train()
    device = accelerator.device
    times = []
    try:
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            for batch in batches:
                started = time.perf_counter()
                with accelerator.autocast():
                    loss = task.training_step(model, model_input(finish, batch))["loss"]
                loss.backward()
                loss.item()  # waits for the device
                times.append(time.perf_counter() - started)
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, value in model.named_buffers():
                value.copy_(buffers[name])
    return times
