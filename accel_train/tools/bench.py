"""`accel-train bench`: accel-train next to plain PyTorch, its input pipeline, scaling and FLOP/s.

A benchmark, not a test:

    accel-train bench --quick                       # CPU-friendly, about a minute
    accel-train bench fashion_mnist_fast            # longer windows, best of two rounds
    accel-train bench --peak-tflops 989 cifar10_resnet50 model.name=resnet18 data.synthetic=true

Writes output_dir/bench.json (every number) and output_dir/bench.md (the tables, also printed).
Throughput is the best of windows of `--steps` optimizer steps after one warm-up window, from the
same `samples_per_s` a training run writes to metrics.jsonl.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import set_seed

from accel_train.config import Config, load_config
from accel_train.data import build_dataset, make_loader
from accel_train.data.in_memory import to_model_input
from accel_train.distributed.accelerator import make_accelerator
from accel_train.distributed.devices import cpu_has_bf16, dataloader_workers, set_numerics
from accel_train.distributed.environment import plain_process_env
from accel_train.errors import UserError
from accel_train.launch.profiles import profile_path
from accel_train.run.layout import read_lines
from accel_train.training.optim import build_optimizer, build_scheduler
from accel_train.versions import versions
from accel_train.workloads.models import compile_model, tune_for_device
from accel_train.workloads.tasks import task_named

TARGETS = {"overhead_ratio": 0.98, "input_pipeline_ratio": 20.0, "cli_help_s": 1.0}
WINDOWS = 3  # timed windows after the warm-up one


def run_bench(recipe: str, overrides: list[str], quick: bool, processes: int | None, peak_tflops: float | None,
              steps: int | None, overhead_only: bool = False) -> dict:
    if not any(o.startswith("output_dir=") for o in overrides):
        overrides = ["output_dir=runs/bench", *overrides]
    # The bench's own defaults come first so the user's overrides win; the timing keys come last.
    overrides = ["train.progress_bar=false", "train.plot=false", "data.eval_subset=1000", *overrides]
    config = load_config(recipe, overrides)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = steps or (10 if quick else 50)
    rounds = 1 if quick else 2
    device_kind = "cuda" if torch.cuda.is_available() else "cpu"
    processes = processes or (torch.cuda.device_count() if device_kind == "cuda" else 2)
    threads = max(1, (os.cpu_count() or 1) // processes) if device_kind == "cpu" else None
    if threads:
        # Every CPU measurement, in this process or launched, gets cores / N threads: rows stay comparable,
        # and no thread pool spins waiting for a core another process holds.
        torch.set_num_threads(threads)
    # No warmup: the LR does not change the speed, and a recipe's warmup outlasts a quick bench's short run.
    timing = [f"train.max_steps={steps * (1 + WINDOWS)}", f"train.log_every_steps={steps}", "train.epochs=1000",
              "train.warmup_steps=0"]
    log = _Log()

    log(f"bench: {recipe} on {device_kind}, windows of {steps} steps, {processes} processes for scaling")
    train_data = build_dataset(config.data, train=True)
    if not train_data.in_memory:
        raise UserError(f"bench: data.name={config.data.name} is not held in memory; the bench compares against a "
                        "plain loop over in-memory tensors: use mnist, fashion_mnist, cifar10 or stl10 "
                        "(data.synthetic=true works without the files)")
    train_size = len(train_data.dataset)
    result = {
        "recipe": recipe, "overrides": overrides, "quick": quick, "steps_per_window": steps, "windows": WINDOWS,
        "machine": machine_info(), "targets": TARGETS, "train_samples": train_size,
        "batch_size": config.train.batch_size,
    }
    one_epoch = []
    if config.data.synthetic and config.data.train_subset is None:
        # A window that crosses an epoch's end also times its evaluation and checkpoint, which the plain loop has none
        # of (found on an H200: 3-step epochs of FakeData read as 15% overhead): synthetic data holds the run in one.
        run_samples = config.train.batch_size * (steps * (1 + WINDOWS) + 1)
        one_epoch = [f"data.train_subset={run_samples}", "data.val_fraction=0"]
    result["overhead"] = overhead(recipe, overrides + timing + one_epoch + ["data.augment=false"], out, rounds, log)
    if overhead_only:
        (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
        print(overhead_line(result["overhead"]), flush=True)
        print(f"bench: wrote {out / 'bench.json'}", flush=True)
        return result
    result["input_pipeline"] = input_pipeline(config, steps * 2, log)
    result["threads_per_process"] = threads
    result["scaling"] = scaling(recipe, overrides + timing, out, processes, threads, device_kind, train_size, log)
    result["flops"] = flops(config, result["overhead"]["ours_samples_per_s"], peak_tflops, quick, log)
    result["cli_help_s"] = cli_help_seconds()
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "bench.md").write_text(to_markdown(result))
    print(to_markdown(result), flush=True)
    print(f"bench: wrote {out / 'bench.json'} and {out / 'bench.md'}", flush=True)
    return result


class _Log:
    def __init__(self) -> None:
        self.started = time.perf_counter()

    def __call__(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.started:6.1f} s] {text}", file=sys.stderr, flush=True)


def best_window(lines: list[dict]) -> dict:
    """The train line of the fastest window after the first (warm-up: allocation, autotuning, compilation): its
    samples_per_s and data_wait, the share of its time spent waiting for data.

    The best rather than the mean, as timeit does: other jobs on the machine only ever slow a window down.
    """
    timed = [line for line in lines if "samples_per_s" in line][1:]
    if not timed:
        raise UserError("bench: the run logged fewer than two train windows; raise --steps or data.train_subset")
    return max(timed, key=lambda line: line["samples_per_s"])


def _train_lines(output_dir: Path) -> list[dict]:
    return [row for row in read_lines(output_dir) if row["split"] == "train"]


# 1. overhead ---------------------------------------------------------------------------------------------------

def overhead(recipe: str, overrides: list[str], out: Path, rounds: int, log) -> dict:
    """Our loop against the loop a user would write by hand, same model, tensors, batch and precision."""
    from accel_train import api

    ours, plain = [], []
    for round_index in range(rounds):  # interleaved, best of each: load from other jobs hits both alike
        config = load_config(recipe, overrides + [f"output_dir={out / 'runs' / f'overhead_{round_index}'}"])
        log(f"overhead round {round_index + 1}/{rounds}: plain PyTorch loop")
        samples_per_s, precision = plain_loop(config)
        plain.append(samples_per_s)
        log(f"overhead round {round_index + 1}/{rounds}: accel-train loop")
        api.train(config)
        ours.append(best_window(_train_lines(Path(config.output_dir))))
    best = max(ours, key=lambda line: line["samples_per_s"])
    return {"ours_samples_per_s": best["samples_per_s"], "ours_data_wait": best["data_wait"],
            "plain_samples_per_s": max(plain), "ratio": best["samples_per_s"] / max(plain),
            "all_ours": [line["samples_per_s"] for line in ours], "all_plain": plain, "augment": False,
            "precision": precision, "processes": 1}


def overhead_line(o: dict) -> str:
    return (f"overhead: our loop / plain PyTorch loop (1 process, {o['precision']}, no augmentation): {o['ratio']:.3f} "
            f"({_fmt(o['ours_samples_per_s'])} / {_fmt(o['plain_samples_per_s'])} samples/s; "
            f"{o['ours_data_wait']:.0%} of ours waiting for data); target >= {TARGETS['overhead_ratio']}")


def plain_loop(config: Config) -> tuple[float, str]:
    """The reference: a hand-written PyTorch loop over the same uint8 tensor held on the device, made into the same
    inputs as ours (resized to data.image_size, normalised), at the launch's mixed precision (torch.autocast, and a
    GradScaler for fp16, as a user writes them): only the loop differs. Its samples/s and precision."""
    accelerator = make_accelerator(config.seed)
    device, precision = accelerator.device, accelerator.mixed_precision
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    set_seed(config.seed)
    data = build_dataset(config.data, train=True)
    task = task_named(config.task)
    task.setup(config, data)
    set_numerics(config.train.deterministic, config.train.tf32)  # cuDNN's benchmark and TF32 as our loop has them
    model = compile_model(tune_for_device(task.build_model(config, data), config.train.channels_last),
                          config.train.compile).to(device)
    optimizer = build_optimizer(config.train, model)
    scheduler = build_scheduler(config.train, optimizer, steps_per_epoch=len(data.dataset) // config.train.batch_size)
    images, labels = data.dataset.images.to(device), data.dataset.labels.to(device)
    mean, std = data.dataset.mean.to(device), data.dataset.std.to(device)
    batch, window = config.train.batch_size, config.train.log_every_steps
    order = torch.randperm(len(labels), device=device)
    position, seconds = 0, []
    model.train()
    for _ in range(1 + WINDOWS):
        started = time.perf_counter()
        for _ in range(window):
            if position + batch > len(order):
                order, position = torch.randperm(len(labels), device=device), 0
            index = order[position:position + batch]
            position += batch
            x = to_model_input(images[index], data.dataset.size, mean, std)
            with torch.autocast(device.type, dtype=half, enabled=half is not None):
                loss = torch.nn.functional.cross_entropy(model(x), labels[index])
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        loss.item()  # wait for the device, as our loop's logging does
        seconds.append(time.perf_counter() - started)
    return window * batch / min(seconds[1:]), precision


# 2. input pipeline ---------------------------------------------------------------------------------------------

def input_pipeline(config: Config, batches: int, log) -> dict:
    """Data only: our path (tensors on the device, batched augmentation) against per-sample ToTensor/Normalize."""
    import dataclasses

    accelerator = make_accelerator(config.seed)
    data = build_dataset(config.data, train=True)
    rates = {}
    for name, on_device in (("ours", True), ("dataloader", False)):
        cfg = dataclasses.replace(config.data, on_device=on_device)
        loader = accelerator.prepare(make_loader(data, cfg, config.train.batch_size, True, accelerator.device))
        log(f"input pipeline: {'on-device batches' if on_device else 'per-sample DataLoader'}")
        rates[name] = _drain(loader, batches, accelerator.device)
        accelerator.free_memory()
    return {"ours_samples_per_s": rates["ours"], "dataloader_samples_per_s": rates["dataloader"],
            "ratio": rates["ours"] / rates["dataloader"], "augment": config.data.augment,
            "dataloader_workers": dataloader_workers(config.data.num_workers), "batches": batches}


def _drain(loader, batches: int, device: torch.device) -> float:
    iterator, seen, started = iter(loader), 0, None
    for index in range(batches + 2):  # two warm-up batches: worker start-up is not throughput
        if index == 2:
            _sync(device)
            started, seen = time.perf_counter(), 0
        try:
            images, _ = next(iterator)
        except StopIteration:
            iterator = iter(loader)
            images, _ = next(iterator)
        seen += len(images)
    _sync(device)
    return seen / (time.perf_counter() - started)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# 3. scaling ----------------------------------------------------------------------------------------------------

def scaling(recipe: str, overrides: list[str], out: Path, processes: int, threads: int | None, device_kind: str,
            train_size: int, log) -> list[dict]:
    """1 process, N processes, N processes + mixed precision, each a real `accel-train train` run
    (the mixed-precision one always through `accelerate launch`, as users start it).

    The per-process batch stays train.batch_size (the global batch grows with N), the classic
    weak-scaling table.
    """
    if device_kind == "cuda":
        mixed = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    else:
        mixed = "bf16"
    per_process = load_config(recipe, overrides).train.batch_size
    rows = [("1 process", 1, "no")]
    if processes > 1:
        rows.append((f"{processes} processes", processes, "no"))
    emulated = " (emulated: this CPU has no native bf16 kernels)" if device_kind == "cpu" and not cpu_has_bf16() else ""
    rows.append((f"{processes} process{'es' if processes > 1 else ''} + {mixed}{emulated}", processes, mixed))
    table, single = [], None
    for name, n, precision in rows:
        run_dir = out / "runs" / f"scaling_{n}_{precision}"
        args = ["train", recipe, *overrides, f"output_dir={run_dir}", f"train.batch_size={per_process * n}"]
        if n == 1 and precision == "no":
            command = [sys.executable, "-m", "accel_train", *args]
        else:
            command = launch_command(n, precision, str(profile_path("multi_gpu")), args)
        log(f"scaling: {name}")
        result = subprocess.run(command, env=plain_process_env(threads), capture_output=True, text=True)
        row = {"name": name, "processes": n, "mixed_precision": precision, "threads_per_process": threads}
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            table.append({**row, "status": f"unavailable: {last[:200]}"})
            continue
        window = best_window(_train_lines(run_dir))
        rate = window["samples_per_s"]
        single = single or rate
        table.append({**row, "status": "ok", "samples_per_s": rate, "data_wait": window["data_wait"],
                      "speedup": rate / single, "efficiency": rate / (n * single), "epoch_s": train_size / rate})
    return table


def launch_command(num_processes: int, mixed_precision: str, profile: str, args: list[str]) -> list[str]:
    """`accelerate launch` of `accel-train ARGS` on N processes of this machine with the shipped profile."""
    import socket

    with socket.socket() as sock:  # a free port, so bench runs never collide with a training job's rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", profile, "--num_processes",
            str(num_processes), "--main_process_port", str(port), "--mixed_precision", mixed_precision,
            "-m", "accel_train", *args]


# 4. FLOP/s -----------------------------------------------------------------------------------------------------

def flops(config: Config, samples_per_s: float, peak_tflops: float | None, quick: bool, log) -> dict:
    """Achieved FLOP/s of training (forward + backward, counted by FlopCounterMode) against a peak."""
    from torch.utils.flop_counter import FlopCounterMode

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = build_dataset(config.data, train=True)
    task = task_named(config.task)
    task.setup(config, data)
    model = task.build_model(config, data).to(device)
    batch = min(config.train.batch_size, len(data.dataset))
    images, labels = data.dataset.to(device).__getitems__(list(range(batch)))
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(images), labels).backward()
    per_sample = counter.get_total_flops() / batch
    achieved = per_sample * samples_per_s / 1e12
    if peak_tflops is None:
        log("flops: measuring the matmul peak")
        peak_tflops, source = matmul_peak_tflops(device, quick), "measured: fp32 matmul" if device.type == "cpu" \
            else "measured: bf16 matmul"
    else:
        source = "given: --peak-tflops"
    return {"train_flops_per_sample": per_sample, "achieved_tflops": achieved, "peak_tflops": peak_tflops,
            "peak_source": source, "utilisation": achieved / peak_tflops, "precision": "fp32"}


def matmul_peak_tflops(device: torch.device, quick: bool) -> float:
    """The best of a few large square matmuls: what this device can do at best (bf16 on GPU, fp32 on CPU)."""
    n = (4096 if not quick else 2048) if device.type == "cuda" else (2048 if not quick else 1024)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5 if quick else 10):
        _sync(device)
        started = time.perf_counter()
        for _ in range(4):
            a @ b
        _sync(device)
        best = min(best, (time.perf_counter() - started) / 4)
    return 2 * n**3 / best / 1e12


# machine, CLI, report ------------------------------------------------------------------------------------------

def cli_help_seconds() -> float:
    """Best of three `accel-train --help` wall times (what a user waits for before anything happens)."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "accel_train", "--help"], capture_output=True, check=True)
        best = min(best, time.perf_counter() - started)
    return best


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    found = versions()
    info = {"cpu": cpu, "cpu_cores": os.cpu_count(),
            **{name: found[name] for name in ("torch", "accelerate", "python")},
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def to_markdown(r: dict) -> str:
    m, o, i, f = r["machine"], r["overhead"], r["input_pipeline"], r["flops"]
    hardware = f"{m.get('gpu_count', 0)} x {m['gpu']}" if "gpu" in m else \
        f"{m['cpu']}, {m['cpu_cores']} cores (CPU only)"
    met = lambda ok: "yes" if ok else "no"  # noqa: E731
    lines = [
        f"# accel-train bench: {r['recipe']}{' (--quick)' if r['quick'] else ''}",
        "",
        f"Machine: {hardware}; torch {m['torch']}, accelerate {m['accelerate']}, {m['date_utc']}.",
        f"Best of {r['windows']} windows of {r['steps_per_window']} optimizer steps after a warm-up window; "
        f"batch {r['batch_size']} per process"
        + (f"; {r['threads_per_process']} CPU thread(s) per process in every row." if r["threads_per_process"]
           else "."),
        "",
        "| measure | value | target | met |",
        "|---|---|---|---|",
        f"| overhead: our loop / plain PyTorch loop (1 process, {o['precision']}, no augmentation) | {o['ratio']:.3f} "
        f"({_fmt(o['ours_samples_per_s'])} / {_fmt(o['plain_samples_per_s'])} samples/s; "
        f"{o['ours_data_wait']:.0%} of ours waiting for data) "
        f"| >= {TARGETS['overhead_ratio']} "
        f"| {met(o['ratio'] >= TARGETS['overhead_ratio'])} |",
        f"| input pipeline: on-device batches / per-sample DataLoader ({i['dataloader_workers']} workers), "
        f"augment={str(i['augment']).lower()} | {i['ratio']:.1f}x ({_fmt(i['ours_samples_per_s'])} / "
        f"{_fmt(i['dataloader_samples_per_s'])} samples/s) | >= {TARGETS['input_pipeline_ratio']:.0f}x "
        f"| {met(i['ratio'] >= TARGETS['input_pipeline_ratio'])} |",
        f"| `accel-train --help` | {r['cli_help_s']:.2f} s | <= {TARGETS['cli_help_s']:.0f} s "
        f"| {met(r['cli_help_s'] <= TARGETS['cli_help_s'])} |",
        "",
        "| run | threads/process | img/s | waiting for data | speedup | scaling efficiency | time per epoch |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["scaling"]:
        threads = row["threads_per_process"] or "-"
        if row["status"] != "ok":
            lines.append(f"| {row['name']} | {threads} | {row['status']} | | | | |")
            continue
        lines.append(f"| {row['name']} | {threads} | {_fmt(row['samples_per_s'])} | {row['data_wait']:.0%} "
                     f"| {row['speedup']:.2f}x | {row['efficiency']:.0%} | {row['epoch_s']:.1f} s |")
    lines += [
        "",
        "| training FLOPs / sample | achieved | peak | utilisation |",
        "|---|---|---|---|",
        f"| {f['train_flops_per_sample'] / 1e6:.1f} MFLOP | {f['achieved_tflops'] * 1e3:.2f} GFLOP/s "
        f"| {f['peak_tflops'] * 1e3:.1f} GFLOP/s ({f['peak_source']}) | {f['utilisation']:.1%} |",
        "",
    ]
    return "\n".join(lines)
