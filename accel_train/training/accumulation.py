"""Gradient accumulation: one optimizer step's global batch = processes x micro-batch x accumulation steps.

The whole of that arithmetic is here: the global batch split evenly across the processes (per_process_batch), each
process's share split into micro-batches.

Accelerate does the accumulating (`Accelerator.gradient_accumulation_steps`, `accelerator.accumulate(model)`:
no gradient all-reduce on the micro-steps in between, the loss divided by the steps). This module decides
how many steps: from `train.accumulation_steps`, from a given `train.micro_batch_size`, or, with
`micro_batch_size: auto`, by searching for the largest micro-batch that fits in device memory with
Accelerate's `find_executable_batch_size`. Whatever the split, the samples of one optimizer step, and so the
optimization, are those of `train.batch_size` without accumulation.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from accelerate import Accelerator
from accelerate.utils import release_memory, send_to_device

from accel_train import hooks
from accel_train.config import Config, TrainConfig
from accel_train.console import note
from accel_train.data import Data, make_loader, received_finish
from accel_train.data.decode import model_input
from accel_train.distributed.accelerator import shards_gradients
from accel_train.distributed.collectives import processes_where
from accel_train.errors import UserError
from accel_train.training.memory import ran_out_of_memory

logger = logging.getLogger(__name__)


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def per_process_batch(global_batch: int, accelerator: Accelerator, key: str) -> int:
    """Check that a global batch splits evenly across processes (Accelerate's split_batches needs it)."""
    n = accelerator.num_processes
    if global_batch % n:
        lower, upper = (global_batch // n) * n, (global_batch // n + 1) * n
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        # A checkpoint continues only with its own global batch: the world sizes that split it are the other way out.
        raise UserError(f"{key}={global_batch} does not split evenly across {n} processes; use a multiple of {n}, "
                        f"e.g. {hint}, or run at a world size that splits it: "
                        f"{', '.join(map(str, divisors(global_batch)))} process(es)")
    return global_batch // n


def accumulation_steps(cfg: TrainConfig, accelerator: Accelerator) -> int | None:
    """Micro-batches per optimizer step; None for micro_batch_size=auto (found later, with the model).

    Checks that batch_size splits evenly into processes x micro-batches, naming the keys and values that would.
    """
    num_processes = accelerator.num_processes
    per_process = per_process_batch(cfg.batch_size, accelerator, "train.batch_size")
    if cfg.micro_batch_size is not None and cfg.accumulation_steps != 1:
        raise UserError(f"train.micro_batch_size={cfg.micro_batch_size} and train.accumulation_steps="
                        f"{cfg.accumulation_steps}: set one of them; the other follows from train.batch_size")
    if cfg.micro_batch_size == "auto":
        return None
    # micro-batch x accumulation steps = per-process batch: whichever is given must divide it
    key, given = ("train.micro_batch_size", cfg.micro_batch_size) if cfg.micro_batch_size is not None \
        else ("train.accumulation_steps", cfg.accumulation_steps)
    if per_process % given:
        raise UserError(f"{key}={given} does not divide the {per_process} samples each of {num_processes} "
                        f"process(es) takes per step (train.batch_size={cfg.batch_size}); use one of "
                        f"{', '.join(map(str, divisors(per_process)))}")
    return per_process // given if cfg.micro_batch_size is not None else given


def fit_micro_batch(config: Config, accelerator: Accelerator, task, model: torch.nn.Module, data: Data) -> int:
    """micro_batch_size=auto: find it, write it (and the accumulation steps) into the config, say it; the steps."""
    per_process = config.train.batch_size // accelerator.num_processes
    micro = find_micro_batch_size(config, accelerator, task, model, data)
    config.train.micro_batch_size, config.train.accumulation_steps = micro, per_process // micro
    sharded = f", the model sharded over {accelerator.num_processes} (FSDP)" if shards_gradients(accelerator) else ""
    note(logger, accelerator,
         f"train.micro_batch_size=auto: {micro} samples per process fit in {accelerator.device.type} "
         f"memory{sharded}; train.accumulation_steps={per_process // micro} makes up train.batch_size="
         f"{config.train.batch_size} over {accelerator.num_processes} process(es)")
    return per_process // micro


def find_micro_batch_size(config: Config, accelerator: Accelerator, task, model: torch.nn.Module, data: Data) -> int:
    """train.micro_batch_size=auto: the largest divisor of the per-process batch with which a forward and backward
    pass fits in device memory on every process.

    Each try is one training micro-step on real samples; the model's weights are untouched and its buffers
    (BatchNorm statistics) restored, so the run is the one a given micro_batch_size would make. The processes try
    each size together and agree over the CPU group before the next: under FSDP (whose model is searched sharded,
    as each process holds it) the passes are collectives, and a process that moved on alone would meet the others
    in another one. The optimizer's state is not allocated yet when this runs: it needs about 2x the parameters
    more (Adam).
    """
    per_process = config.train.batch_size // accelerator.num_processes
    if any(param.device != accelerator.device for param in model.parameters()):  # not once prepared: FSDP's .to()
        model.to(accelerator.device)  # makes new parameters, and the optimizer would update the old ones
    buffers = {name: value.clone() for name, value in model.named_buffers()}  # BatchNorm statistics: small
    probe_data = dataclasses.replace(config.data, num_workers=0)
    model.train()
    try:
        for size in sorted(divisors(per_process), reverse=True):
            try:
                try_micro_batch(accelerator, task, model, data, probe_data, size)
                ran_out = False
            except Exception as err:
                if not ran_out_of_memory(err):
                    raise
                ran_out = True
            model.zero_grad(set_to_none=True)
            if ran_out:
                release_memory()  # what the failed pass left: gc, then the device's cache
            if not processes_where(ran_out, accelerator, config.train.collective_timeout_s):
                return size
    finally:
        with torch.no_grad():
            for name, value in model.named_buffers():
                value.copy_(buffers[name])
    raise UserError(f"train.micro_batch_size=auto: not even 1 sample per process fits in {accelerator.device.type} "
                    "memory; use a smaller model or image size, mixed precision, or FSDP")


def try_micro_batch(accelerator: Accelerator, task, model, data: Data, probe_data, size: int) -> None:
    """One forward and backward pass on `size` samples (the device's out-of-memory error propagates)."""
    loader = make_loader(data, probe_data, size, False, accelerator.device)
    batch = model_input(received_finish(data, probe_data, accelerator.device),
                        send_to_device(next(iter(loader)), accelerator.device))
    with accelerator.autocast():
        terms = hooks.every().after_forward("search", None, model, batch, task.training_step(model, batch))
    terms["loss"].backward()
    model.zero_grad(set_to_none=True)
    del terms, batch
