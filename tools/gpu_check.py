#!/usr/bin/env python3
"""`make gpu-check`: what only a GPU shows, as one table, in at most 8 minutes on a fresh one-GPU machine.

Prepare on a machine with the package index, run on the GPU machine (which needs none), from the repo root:

    make gpu-wheels      # here: .gpu-wheels/, wheels of what accel-train needs beyond that machine's packages
    make gpu-check       # there, with .gpu-wheels/ beside the tree: python3 tools/gpu_check.py

It installs those wheels and accel-train itself (no index, no dependency resolution) into OUT/site, then runs each
row below as the plain commands a user would type, each under its own time cap, prints one table and writes it as
JSON to OUT/gpu_check.json (OUT: --out, default runs/gpu-check/), and to $OUT/ too when that variable is set. Each
row's commands and their output are in OUT/logs/ROW.log. Exit 1 when a row failed.

`--dry-run` runs every row on the CPU with tiny sizes (the suite does: tests/tools/test_gpu_check.py), so that no
row's command rots between visits to a GPU. What only a GPU can judge (host syncs, a real out-of-memory, NCCL) is
said there as "n/a on CPU", with the row's code run all the same.

`python3 tools/gpu_check.py --count-syncs DIR` is the host-syncs row's own command (one process, every data path).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BUDGET_S = 480  # the whole check, install included: 8 minutes
DRY_RUN_BUDGET_S = 1500  # a slow, shared CPU; the dry run's caps only stop a command that hangs
# The largest relative difference of per-step train losses between two runs of other kernels, docs/contracts.md's
# table "GPU against CPU": full fp32 (train.deterministic=true), and fp32 on TF32 tensor cores (the default).
LOSS_RTOL_FP32 = 1e-3
LOSS_RTOL_TF32 = 1e-2
# Rows in order, each with its cap in seconds on the GPU (they add up to less than BUDGET_S) and in the dry run.
CAPS = {
    "install": (35, 150),
    "demo_bf16": (25, 150),
    "demo_fp16": (25, 150),
    "torchrun_nccl": (25, 150),
    "host_syncs": (50, 240),
    "loop_overhead": (55, 240),
    "out_of_memory": (65, 150),
    "background_save": (20, 150),
    "compile_on_off": (55, 240),
    "fsdp": (25, 150),
    "gpu_vs_cpu": (30, 200),
    "test_suite": (70, 200),
}
TOKEN = "GPU_CHECK_TOKEN"  # in every command's environment: finds a launcher's workers when a cap ends it


@dataclass
class Row:
    row: str
    result: str = "ok"  # ok, fail or skipped
    seconds: float = 0.0
    numbers: dict = field(default_factory=dict)
    note: str = ""
    commands: list[str] = field(default_factory=list)


class Failed(Exception):
    """A row's check failed; the message says what, and becomes the row's note."""


class Check:
    """What the rows share: the mode, the folders, the environment of every command, the clock."""

    def __init__(self, dry_run: bool, out: Path, wheels: Path, caps: dict | None = None,
                 budget_s: float = BUDGET_S) -> None:
        self.dry_run, self.out, self.wheels, self.caps = dry_run, out, wheels, caps or CAPS
        self.site = out / "site"
        self.deadline = time.monotonic() + (DRY_RUN_BUDGET_S if dry_run else budget_s)
        self.row_ends = self.deadline
        self.row: Row | None = None
        self.blocked = ""  # why no row can run (install found it)
        env = {key: value for key, value in os.environ.items()
               if key not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               and not key.startswith("PYTEST_")}
        env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TQDM_DISABLE="1",
                   PYTHONPATH=os.pathsep.join([str(self.site), str(REPO), *filter(None, [env.get("PYTHONPATH")])]))
        if dry_run:
            env["CUDA_VISIBLE_DEVICES"] = ""  # every row on the CPU, also on a machine with a GPU
        self.env = env

    # sizes: a short run on the GPU, a tiny one in the dry run
    def short_run(self, batch: int = 64, steps: int = 60, log_every: int = 20) -> list[str]:
        if self.dry_run:
            batch, steps, log_every = 8, 4, min(log_every, 2)
        return ["data.synthetic=true", f"data.train_subset={batch * (steps // 2 + 2)}",
                f"data.eval_subset={batch * 2}", f"train.batch_size={batch}", f"train.max_steps={steps}",
                f"train.log_every_steps={log_every}", "train.plot=false", "train.progress_bar=false"]

    def folder(self, name: str) -> Path:
        """An empty folder under OUT/runs for a row's runs."""
        path = self.out / "runs" / name
        shutil.rmtree(path, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def run(self, command: list[str], env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
        """`command` from the repo root, its output appended to OUT/logs/ROW.log; ended, with a launcher's workers,
        when the row's cap comes. With `check`, an exit other than 0 fails the row."""
        row = self.row
        row.commands.append(" ".join(command).replace(PYTHON, "python3"))
        timeout = self.row_ends - time.monotonic()
        if timeout <= 1:
            raise Failed(f"over its cap of {self.caps[row.row][self.dry_run]} s before: {row.commands[-1][:80]}")
        token = uuid.uuid4().hex
        process = subprocess.Popen(command, cwd=REPO, env={**self.env, **(env or {}), TOKEN: token}, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            end(process, token)
            try:
                output, _ = process.communicate(timeout=5)
            except subprocess.TimeoutExpired:  # something still holds its output open
                output = "(output lost: still held open after the command was ended)"
            self.log(command, output, "ended at the row's cap")
            raise Failed(f"over its cap of {self.caps[row.row][self.dry_run]} s in: {row.commands[-1][:80]}") from None
        self.log(command, output, f"exit {process.returncode}")
        result = subprocess.CompletedProcess(command, process.returncode, output, "")
        if check and process.returncode != 0:
            raise Failed(f"exit {process.returncode}: {last_line(output)}")
        return result

    def log(self, command: list[str], output: str, ending: str) -> None:
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{self.row.row}.log", "a") as file:
            file.write(f"$ {' '.join(command)}\n{output}\n[{ending}]\n\n")


def end(process: subprocess.Popen, token: str) -> None:
    """A command over its cap: SIGTERM to its process group (launchers pass it to their workers), SIGKILL 3 s later,
    then SIGKILL to any process still carrying its token (torch's launchers start each worker in a session of its
    own, which the group's signal does not reach)."""
    for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 2)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    marker = f"{TOKEN}={token}".encode()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError, ValueError):
            if marker in environ.read_bytes().split(b"\0"):
                os.kill(int(environ.parent.name), signal.SIGKILL)


def last_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# what a run folder says --------------------------------------------------------------------------------------

def train_lines(run: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [line for line in lines if line.get("split") == "train"]


def run_info(run: Path) -> dict:
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())["run"]


def final_loss(run: Path) -> float:
    loss = train_lines(run)[-1]["loss"]
    if not math.isfinite(loss):
        raise Failed(f"final train loss {loss}")
    return loss


def samples_per_s(run: Path) -> float:
    """The best train line after the first (warm-up: allocation, autotuning, compilation)."""
    lines = [line["samples_per_s"] for line in train_lines(run) if "samples_per_s" in line]
    return max(lines[1:] or lines)


def largest_relative_difference(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        raise Failed(f"{len(a)} and {len(b)} train losses to compare")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def accel_train(*args: str) -> list[str]:
    return [PYTHON, "-m", "accel_train", *args]


def accelerate_launch(*args: str) -> list[str]:
    return [PYTHON, "-m", "accelerate.commands.launch", *args]


# the rows ----------------------------------------------------------------------------------------------------

def install(check: Check) -> None:
    """The wheels of .gpu-wheels/ and accel-train itself into OUT/site, without an index or dependency resolution;
    then the package imports (datasets and evaluate with it), its declared floors hold and a GPU is visible. Where
    one of these last three fails, the other rows cannot run: they are skipped, naming why."""
    row, failures = check.row, []
    shutil.rmtree(check.site, ignore_errors=True)
    check.site.mkdir(parents=True)
    wheels = sorted(check.wheels.glob("*.whl"))
    row.numbers["wheels"] = len(wheels)
    row.numbers["wheels_mib"] = round(sum(path.stat().st_size for path in wheels) / 2**20, 2)
    pip = [PYTHON, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index", "--no-deps",
           "--no-compile", "--target", str(check.site)]
    if check.dry_run:
        row.note = f"dry run: {len(wheels)} wheel(s) in {check.wheels.name}/ listed, not installed (Python 3.12's)"
    elif not wheels:
        row.note = f"no wheels in {check.wheels} (make gpu-wheels): only this Python's packages"
    installs = [("the wheels", [*pip, *map(str, wheels)])] if wheels and not check.dry_run else []
    source = check.out / "source"  # a copy: building in the repo would leave build/ and an egg-info there
    shutil.rmtree(source, ignore_errors=True)
    for folder in ("accel_train", "accelerate_configs"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for file in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / file, source / file)
    for what, command in [*installs, ("accel-train", [*pip, "--no-build-isolation", str(source)])]:
        try:  # without the package's install the rows still import it from the repo (PYTHONPATH)
            check.run(command)
        except Failed as failure:
            failures.append(f"installing {what}: {failure}")
    try:
        said = check.run([PYTHON, "-c", "import datasets, evaluate, accel_train.workloads.metrics; "
                          "print('datasets', datasets.__version__); print('evaluate', evaluate.__version__); "
                          "from accel_train import cli; cli.main(['--version'])"]).stdout
    except Failed as failure:
        check.blocked = f"accel-train does not import ({failure})"
        raise Failed("; ".join([*failures, check.blocked])) from None
    versions = dict(line.split(None, 1) for line in said.splitlines() if len(line.split(None, 1)) == 2)
    row.numbers.update({name: versions.get(name, "?") for name in ("torch", "accelerate", "datasets", "python")})
    row.numbers["devices"] = versions.get("devices", "?")
    conflicts = [line for line in check.run([PYTHON, "-m", "pip", "check"], check=False).stdout.splitlines()
                 if line.split(" ")[0].lower() in {"accel-train", *(wheel.name.split("-")[0].lower()
                                                                     for wheel in wheels)}]
    if conflicts:
        row.note = "; ".join(filter(None, [row.note, "pip check: " + "; ".join(conflicts[:3])]))
    problems = [line for line in said.splitlines() if line.startswith("problem:")]
    if problems:  # every command would stop at the same line
        check.blocked = "; ".join(problems)
    elif not check.dry_run and "CUDA" not in row.numbers["devices"]:  # GPU sizes on a CPU: hours, and all its memory
        check.blocked = f"no CUDA GPU visible ({row.numbers['devices']}; --dry-run runs every row on the CPU)"
    if failures or check.blocked:
        raise Failed("; ".join(filter(None, [*failures, check.blocked])))


def demo(check: Check, precision: str) -> None:
    """The demo under `accelerate launch` at one process and this precision: exit 0, a finite loss, on the GPU."""
    run = check.folder(f"demo_{precision}")
    check.run(accelerate_launch("--config_file", "accelerate_configs/single_gpu.yaml", "--num_processes", "1",
                                "--mixed_precision", precision, "-m", "accel_train", "train", "fashion_mnist_cnn",
                                *check.short_run(), f"output_dir={run}"))
    info = run_info(run)
    check.row.numbers.update(loss=final_loss(run), samples_per_s=samples_per_s(run), device=info["device"],
                             mixed_precision=info["mixed_precision"])
    if check.dry_run:
        check.row.note = "on CPU (fp16 falls back to fp32 there)"
    elif (info["device"], info["mixed_precision"]) != ("cuda", precision):
        raise Failed(f"trained on {info['device']} at {info['mixed_precision']}, not cuda at {precision}")


def demo_bf16(check: Check) -> None:
    demo(check, "bf16")


def demo_fp16(check: Check) -> None:
    demo(check, "fp16")


def torchrun_nccl(check: Check) -> None:
    """torchrun at world size 1: a process group (NCCL on a GPU: Accelerate's MULTI_GPU on cuda), exit 0."""
    run = check.folder("torchrun_nccl")
    check.run([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
               "-m", "accel_train", "train", "fashion_mnist_cnn", *check.short_run(), f"output_dir={run}"])
    info = run_info(run)
    check.row.numbers.update(loss=final_loss(run), world_size=info["world_size"],
                             distributed_type=info["distributed_type"], device=info["device"])
    if check.dry_run:
        check.row.note = "n/a on CPU: a gloo group there"
    elif (info["device"], info["distributed_type"]) != ("cuda", "MULTI_GPU"):
        raise Failed(f"{info['distributed_type']} on {info['device']}: no NCCL process group")


def host_syncs(check: Check) -> None:
    """Host syncs per optimizer step that does not log, for each data path (torch.cuda.set_sync_debug_mode; on the
    CPU, host reads of tensor values): 0 on each."""
    folder = check.folder("host_syncs")
    dry_run = ["--dry-run"] if check.dry_run else []
    check.run([PYTHON, "tools/gpu_check.py", "--count-syncs", str(folder), *dry_run])
    # fp16 (its GradScaler) in a process of its own: one process keeps the mixed precision of its first Accelerator
    check.run([PYTHON, "tools/gpu_check.py", "--count-syncs", str(folder / "fp16"), *dry_run],
              env={"ACCELERATE_MIXED_PRECISION": "fp16"})
    paths = {**json.loads((folder / "syncs.json").read_text()),
             **json.loads((folder / "fp16" / "syncs.json").read_text())}
    check.row.numbers.update({path: result["syncs"] for path, result in paths.items()})
    short = [path for path, result in paths.items() if result["steps"] < result["expected_steps"]]
    if short:
        raise Failed(f"fewer steps than asked on: {', '.join(short)}")
    blind = [path for path, result in paths.items() if not result["everywhere"]]
    if blind:  # log steps and evaluation read the device: a counter that saw none of them does not count
        raise Failed(f"no sync counted at all, not even at log steps or evaluation, on: {', '.join(blind)}")
    if check.dry_run:
        check.row.note = (f"on CPU: host reads of tensor values counted instead (set_sync_debug_mode sees CUDA only); "
                          f"{len(paths)} paths, {paths[next(iter(paths))]['expected_steps']} steps each")
    syncing = [f"{path}: step {step} {count} at {', '.join(result['where'][:2])}"
               for path, result in paths.items() for step, count in result["per_step"].items()]
    if syncing:
        raise Failed("syncs on steps that do not log: " + "; ".join(syncing[:4]))


def loop_overhead(check: Check) -> None:
    """`accel-train bench` on ResNet-50 at 224 px, bf16, channels_last: our loop / a plain PyTorch loop, data_wait."""
    run = check.folder("loop_overhead")
    sizes = ["data.image_size=224"] if not check.dry_run else \
        ["model.name=bn_cnn", "data.image_size=32", "train.batch_size=8", "data.train_subset=64", "data.eval_subset=16"]
    check.run(accel_train("bench", "--overhead", "--quick", *(["--steps", "1"] if check.dry_run else []),
                          "cifar10_resnet50", "data.synthetic=true", "train.channels_last=true", *sizes,
                          f"output_dir={run}"), env={"ACCELERATE_MIXED_PRECISION": "bf16"})
    bench = json.loads((run / "bench.json").read_text())
    overhead, target = bench["overhead"], bench["targets"]["overhead_ratio"]
    check.row.numbers.update(ratio=overhead["ratio"], ours_samples_per_s=overhead["ours_samples_per_s"],
                             plain_samples_per_s=overhead["plain_samples_per_s"], data_wait=overhead["ours_data_wait"],
                             bench_precision=overhead.get("precision"))
    if overhead.get("precision") != "bf16":  # bench's own account of both loops' precision
        raise Failed(f"bench ran its loops at {overhead.get('precision')}, not bf16")
    if check.dry_run:
        check.row.note = "ratio not judged on CPU"
    elif overhead["ratio"] < target:
        raise Failed(f"our loop at {overhead['ratio']:.3f} of the plain loop, below bench's target {target}")


def out_of_memory(check: Check) -> None:
    """train.micro_batch_size=auto with a per-process batch that cannot fit (ResNet-50, fp32, 224 px, 2048 samples:
    about 180 GB of activations): the search runs out of memory for real, finds a size, says it and trains."""
    run = check.folder("out_of_memory")
    batch, side, evaluated = (2048, 224, 256) if not check.dry_run else (16, 32, 16)
    model = [] if not check.dry_run else ["model.name=bn_cnn"]
    said = check.run(accel_train("train", "cifar10_resnet50", *model, "data.synthetic=true", f"data.image_size={side}",
                                 "data.val_fraction=0", "data.augment=false", "checkpoint.best_metric=null",
                                 "checkpoint.at_epoch_end=false", f"train.batch_size={batch}",
                                 f"data.train_subset={batch}", "train.micro_batch_size=auto", "train.max_steps=1",
                                 f"train.eval_batch_size={evaluated}", f"data.eval_subset={evaluated}",
                                 "train.plot=false", "train.progress_bar=false", f"output_dir={run}")).stdout
    found = re.search(r"train\.micro_batch_size=auto: (\d+) samples per process fit in (\w+) memory", said)
    if not found:
        raise Failed("the run did not say which micro-batch fits")
    micro = int(found.group(1))
    halved = re.search(r"memory at step \d+ with \d+ sample\(s\) per micro-batch; continuing with (\d+)", said)
    check.row.numbers.update(batch_per_process=batch, micro_batch=micro, loss=final_loss(run),
                             halved_in_training_to=int(halved.group(1)) if halved else None)
    if check.dry_run:
        check.row.note = f"n/a on CPU (no device memory to run out of): the search ran and kept {micro}"
    elif micro >= batch:
        raise Failed(f"{batch} samples per process fit in {found.group(2)} memory: no out-of-memory to adapt to")
    elif not halved:
        check.row.note = "no in-training halving provoked (tests/training/ inject one)"


def background_save(check: Check) -> None:
    """`accel-train bench --saves`: how long a background save of ResNet-50's CUDA tensors blocks training, against
    the synchronous save."""
    sizes = ["data.image_size=224"] if not check.dry_run else ["model.name=bn_cnn", "data.image_size=32"]
    said = check.run(accel_train("bench", "--saves", "cifar10_resnet50", *sizes)).stdout
    synchronous = re.search(r"synchronous save \([^)]*\): ([\d.]+) s", said)
    blocked = re.search(r"training blocked ([\d.]+) s .*?first save ([\d.]+) s", said)
    if not (synchronous and blocked):
        raise Failed("bench --saves did not give both times")
    sync_s, blocked_s = float(synchronous.group(1)), float(blocked.group(1))
    check.row.numbers.update(blocked_s=blocked_s, synchronous_s=sync_s, first_blocked_s=float(blocked.group(2)))
    if check.dry_run:
        check.row.note = "CPU tensors here: times not judged"
    elif blocked_s >= sync_s:
        raise Failed(f"a background save blocked {blocked_s} s, no less than a synchronous one ({sync_s} s)")


def compile_on_off(check: Check) -> None:
    """The same short run with train.compile=false and true, at the default numerics (TF32 on a GPU): both speeds;
    the losses agree within LOSS_RTOL_TF32 (other kernels, as docs/contracts.md's GPU against CPU)."""
    runs = {}
    for compiled in ("false", "true"):
        env = None
        if check.dry_run and compiled == "true":  # inductor's C++ build of a CPU graph takes minutes on 2 cores: the
            env = {"TORCH_COMPILE_DISABLE": "1"}  # suite's compile test has it (and the eager run needs no such env)
        runs[compiled] = check.folder(f"compile_{compiled}")
        check.run(accel_train("train", "fashion_mnist_cnn", "model.dropout=false", *check.short_run(log_every=10),
                              f"train.compile={compiled}", f"output_dir={runs[compiled]}"), env=env)
    losses = {key: [line["loss"] for line in train_lines(run)] for key, run in runs.items()}
    difference = largest_relative_difference(losses["true"], losses["false"])
    eager, compiled = samples_per_s(runs["false"]), samples_per_s(runs["true"])
    check.row.numbers.update(eager_samples_per_s=eager, compiled_samples_per_s=compiled, speedup=compiled / eager,
                             loss_eager=losses["false"][-1], loss_compiled=losses["true"][-1],
                             max_rel_loss_diff=difference)
    if check.dry_run:
        check.row.note = "dry run: TORCH_COMPILE_DISABLE=1 (the key's path, not inductor)"
    tolerance = LOSS_RTOL_FP32 if check.dry_run else LOSS_RTOL_TF32
    if difference > tolerance:
        raise Failed(f"compiled and eager train losses {difference:.2e} apart (relative), above {tolerance}")


def fsdp(check: Check) -> None:
    """The shipped FSDP profile at one process: FSDP2 on the GPU, bf16, exit 0, a finite loss."""
    run = check.folder("fsdp")
    check.run(accelerate_launch("--config_file", "accelerate_configs/fsdp.yaml", "--num_processes", "1",
                                "--main_process_port", str(free_port()), "-m", "accel_train", "train",
                                "fashion_mnist_cnn", *check.short_run(), f"output_dir={run}"))
    info = run_info(run)
    check.row.numbers.update(loss=final_loss(run), distributed_type=info["distributed_type"], device=info["device"],
                             mixed_precision=info["mixed_precision"])
    if check.dry_run:
        check.row.note = "n/a on CPU: the profile trains with DDP there"
    elif info["distributed_type"] != "FSDP":
        raise Failed(f"trained as {info['distributed_type']}, not FSDP")


def gpu_vs_cpu(check: Check) -> None:
    """The same deterministic fp32 run on the GPU and on the CPU (CUDA_VISIBLE_DEVICES=""): per-step train losses
    within LOSS_RTOL_FP32 (relative)."""
    losses = {}
    for device, env in (("gpu", None), ("cpu", {"CUDA_VISIBLE_DEVICES": ""})):
        run = check.folder(f"gpu_vs_cpu_{device}")
        check.run(accel_train("train", "fashion_mnist_cnn", "model.dropout=false", "train.deterministic=true",
                              *check.short_run(steps=20, log_every=1), f"output_dir={run}"), env=env)
        losses[device] = [line["loss"] for line in train_lines(run)]
    difference = largest_relative_difference(losses["gpu"], losses["cpu"])
    check.row.numbers.update(steps=len(losses["cpu"]), max_rel_loss_diff=difference, tolerance=LOSS_RTOL_FP32)
    if difference > LOSS_RTOL_FP32:
        raise Failed(f"GPU and CPU train losses {difference:.2e} apart (relative), above {LOSS_RTOL_FP32}")
    if check.dry_run:
        check.row.note = "both runs on CPU here"


def test_suite(check: Check) -> None:
    """The tests that start no process and use no store, on this machine's CPU, which is not ours (the suite hides
    the GPU: its contracts are the CPU's, tests/conftest.py); the dry run: one file of them."""
    workers = 8
    chosen = ["tests/launching/test_doctor.py"] if check.dry_run else \
        ["-n", str(workers), "--dist", "loadfile", "--durations", "10", "tests"]
    # torch's threads shared among the workers: each taking every core made the suite slower at 12 workers than at 8
    # on the H200 machine's 16 (the row ran past its cap both times, with no test failed)
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    said = check.run([PYTHON, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "-m",
                      "not processes and not store", *chosen], env={"OMP_NUM_THREADS": threads},
                     check=False).stdout
    counts = {word: int(number) for number, word in
              re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", last_line(said))}
    check.row.numbers.update({word: counts.get(word, 0) for word in ("passed", "failed", "skipped")})
    failed = [line.split()[1] for line in said.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    if not counts.get("passed") or counts.get("failed") or counts.get("error") or counts.get("errors"):
        raise Failed(f"{last_line(said)}{': ' + ', '.join(failed[:5]) if failed else ''}")


ROWS = [install, demo_bf16, demo_fp16, torchrun_nccl, host_syncs, loop_overhead, out_of_memory, background_save,
        compile_on_off, fsdp, gpu_vs_cpu, test_suite]
assert [row.__name__ for row in ROWS] == list(CAPS) and sum(cap for cap, _ in CAPS.values()) <= BUDGET_S


# host syncs, in one process: python3 tools/gpu_check.py --count-syncs DIR ----------------------------------

USER_RECIPE = "tests/user_code/recipe.yaml"  # user_models.py beside it


# What the GPU's sync would be on the CPU: a read of a tensor's value by the host (test_step_boundaries.py counts
# the same), outside code that reads tensors kept on the host by design: the samplers' batch indices.
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")
HOST_BY_DESIGN = ("torch/utils/data/", "accelerate/data_loader.py")


def warn_on_host_reads(torch) -> None:
    """On the CPU, where set_sync_debug_mode sees nothing: each host read of a tensor's value warns as a sync would,
    so the same counting runs and means something (this process only counts, then ends)."""
    import warnings

    def warning(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if not any(part in caller for part in HOST_BY_DESIGN):
                warnings.warn_explicit(f"host read ({name}): synchronizing on a GPU", UserWarning, caller,
                                       sys._getframe(1).f_lineno)
            return original(self, *args, **kwargs)
        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, warning(name))


def sync_paths(folder: Path, dry_run: bool) -> tuple[dict[str, tuple[str, list[str]]], int, int]:
    """Each data path as (recipe, overrides), the steps of each run, and its log interval. Runs stay within one epoch,
    so every step but the log steps and the last ends with no evaluation or checkpoint."""
    batch, steps, log_every = (8, 4, 2) if dry_run else (32, 12, 4)
    samples = batch * (steps + 2)
    tree, shards = folder / "images", folder / "shards"
    write_image_tree(tree, samples, batch)
    from accel_train import cli

    with contextlib.suppress(SystemExit):  # `accel-train shard imagefolder data.root=TREE output=SHARDS`
        cli.main(["shard", "imagefolder", f"data.root={tree}", "data.image_size=32", f"output={shards}"])
    common = [f"train.batch_size={batch}", f"train.max_steps={steps}", f"train.log_every_steps={log_every}",
              f"data.train_subset={samples}", f"data.eval_subset={batch}", "train.plot=false",
              "train.progress_bar=false"]
    in_memory = ["data.synthetic=true", *common]
    files = ["model.name=bn_cnn", "data.image_size=32", "data.num_workers=2", *common]
    paths = {
        "on_device": ("fashion_mnist_cnn", ["data.on_device=true", *in_memory]),
        "dataloader_workers": ("fashion_mnist_cnn", ["data.on_device=false", "data.num_workers=2", *in_memory]),
        "imagefolder": ("imagefolder", [f"data.root={tree}", *files]),
        "shards": ("imagefolder", ["data.name=shards", f"data.root={shards}", *files]),
        "user_dataset": (USER_RECIPE, ["data.name=user_models:photos", "data.num_classes=3",
                                       f"data.args.size={samples}", "data.num_workers=2", *common]),
        "ema": ("fashion_mnist_cnn", ["train.ema_decay=0.99", *in_memory]),
        "mixup_cutmix": ("fashion_mnist_cnn", ["train.mixup_alpha=0.2", "train.cutmix_alpha=1.0", *in_memory]),
        "accumulation": ("fashion_mnist_cnn", ["train.accumulation_steps=2", *in_memory]),
        "lr_schedule": ("fashion_mnist_cnn", ["train.schedule=cosine", "train.warmup_steps=2", *in_memory]),
    }
    if os.environ.get("ACCELERATE_MIXED_PRECISION") == "fp16":  # the loss scaling's path (a process of its own)
        paths = {"fp16": paths["on_device"]}
    return paths, steps, log_every


def write_image_tree(root: Path, train: int, test: int) -> None:
    """An ImageFolder tree of small PNGs, two classes: root/train/<class>/, root/test/<class>/."""
    import numpy as np
    from PIL import Image

    for split, count in (("train", train), ("test", test)):
        for index in range(count):
            folder = root / split / f"class_{index % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            pixels = np.random.default_rng(index).integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{index}.png")


def count_syncs(folder: Path, dry_run: bool) -> None:
    """Each data path trained in this process with torch.cuda.set_sync_debug_mode("warn"): the sync warnings from one
    optimizer step to the next are that step's (evaluation counted apart). FOLDER/syncs.json has, per path, those of
    the steps that neither log nor end the run."""
    import warnings

    import torch

    from accel_train import api, hooks

    class SyncsPerStep(hooks.Hooks):
        """Where the loop is (the last optimizer step taken, or evaluating); before it moves on, the sync warnings
        caught since it last moved are counted where it was."""

        def __init__(self, caught: list) -> None:
            self.caught, self.counted, self.step, self.evaluating = caught, 0, 0, False
            self.counts, self.where = {}, {}

        def settle(self) -> None:
            key = "eval" if self.evaluating else self.step
            for warning in self.caught[self.counted:]:
                if "synchroniz" in str(warning.message):
                    self.counts[key] = self.counts.get(key, 0) + 1
                    self.where.setdefault(key, set()).add(f"{Path(warning.filename).name}:{warning.lineno}")
            self.counted = len(self.caught)

        def optimizer_stepped(self, progress, terms, skipped, lr):
            self.settle()
            self.step = progress.step

        def after_forward(self, phase, step, model, batch, outputs):
            if phase == "eval" and not self.evaluating:
                self.settle()
                self.evaluating = True
            return outputs

        def micro_batch_loaded(self, progress, batch):
            if self.evaluating:
                self.settle()
                self.evaluating = False

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_sync_debug_mode("warn")
    else:
        warn_on_host_reads(torch)
    for made in ("images", "shards", "runs"):  # this command's own, from an earlier run
        shutil.rmtree(folder / made, ignore_errors=True)
    paths, steps, log_every = sync_paths(folder, dry_run)
    results = {}
    for name, (recipe, overrides) in paths.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # every sync, not the first from each line
            seen = SyncsPerStep(caught)
            with hooks.added(seen):
                api.train(recipe, [*overrides, f"output_dir={folder / 'runs' / name}"])
            seen.settle()
        quiet = {step: count for step, count in seen.counts.items()
                 if isinstance(step, int) and 0 < step < steps and step % log_every}
        results[name] = {"syncs": sum(quiet.values()), "per_step": quiet, "steps": seen.step,
                         "everywhere": sum(seen.counts.values()),  # log steps and evaluation: the counter counts
                         "by_step": {str(step): count for step, count in seen.counts.items()},
                         "expected_steps": steps, "where": sorted({w for step in quiet for w in seen.where[step]}),
                         "on_gpu": on_gpu}
        print(f"host syncs: {name}: {results[name]['syncs']} on the steps that do not log ({seen.step} steps)",
              flush=True)
    (folder / "syncs.json").write_text(json.dumps(results, indent=2) + "\n")


# the table ---------------------------------------------------------------------------------------------------

def spelled(value) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def table(rows: list[Row]) -> str:
    lines = [f"{'row':16s} {'result':8s} {'s':>6s}  numbers / note", "-" * 100]
    for row in rows:
        numbers = ", ".join(f"{key} {spelled(value)}" for key, value in row.numbers.items() if value is not None)
        text = "; ".join(filter(None, [numbers, row.note]))
        lines.append(f"{row.row:16s} {row.result:8s} {row.seconds:6.1f}  {text}")
    return "\n".join(lines)


def write_json(rows: list[Row], path: Path, dry_run: bool, started: float) -> dict:
    failed = [row.row for row in rows if row.result == "fail"]
    result = {"dry_run": dry_run, "ok": not failed, "failed": failed, "seconds": round(time.monotonic() - started, 1),
              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loss_rtol_fp32": LOSS_RTOL_FP32,
              "rows": [asdict(row) for row in rows]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def run_rows(check: Check, functions: list, only: str | None, started: float, name_of_check: str) -> list[Row]:
    """Each row's function under its cap (check.caps), in order; `only`: comma-separated rows (install always runs).
    A row that fails or breaks is that row's result; rows after a blocking one, or past the deadline, are skipped."""
    chosen = set(check.caps) if not only else {"install", *(name.strip() for name in only.split(","))}
    rows = []
    for function in functions:
        name = function.__name__
        check.row = row = Row(name)
        rows.append(row)
        if name not in chosen:
            row.result, row.note = "skipped", "not chosen (--only)"
            continue
        if check.blocked or time.monotonic() > check.deadline - 2:
            row.result, row.note = "skipped", check.blocked or "the check's time is spent"
            continue
        began = time.monotonic()
        check.row_ends = min(began + check.caps[name][check.dry_run], check.deadline)
        print(f"{name_of_check} [{began - started:5.0f} s] {name} ...", file=sys.stderr, flush=True)
        try:
            function(check)
        except Failed as failure:
            row.result, row.note = "fail", "; ".join(filter(None, [str(failure), row.note]))
        except Exception as err:  # a row that breaks is that row's failure, not the end of the check
            row.result, row.note = "fail", f"{type(err).__name__}: {err}"[:300]
        row.seconds = round(time.monotonic() - began, 1)
        print(f"{name_of_check} [{time.monotonic() - started:5.0f} s] {name}: {row.result}", file=sys.stderr,
              flush=True)
    return rows


def bring_back(table: Path, logs: Path, name: str) -> None:
    """The table (NAME.json) and every row's log (NAME_logs.txt, each log's last 200 kB) into $OUT, the folder a
    remote runner brings back, where that variable is set."""
    if not os.environ.get("OUT"):
        return
    out = Path(os.environ["OUT"])
    shutil.copy(table, out / f"{name}.json")
    with open(out / f"{name}_logs.txt", "w") as written:
        for path in sorted(logs.glob("*.log")):
            written.write(f"===== {path.name}\n{path.read_text()[-200000:]}\n")


class OneLineErrors(argparse.ArgumentParser):
    """A mistake on the command line in one line (what was wrong, and where the usage is), exit 2."""

    def error(self, message: str):
        self.exit(2, f"gpu-check: error: {message}; tools/gpu_check.py --help shows its usage\n")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrors(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="every row on the CPU, tiny sizes")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-check", help="runs, logs, site, JSON")
    parser.add_argument("--json", type=Path, help="the table as JSON (default OUT/gpu_check.json)")
    parser.add_argument("--wheels", type=Path, default=REPO / ".gpu-wheels", help="wheels made by make gpu-wheels")
    parser.add_argument("--only", help="comma-separated rows to run (install always runs)")
    parser.add_argument("--count-syncs", type=Path, metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [name.strip() for name in (args.only or "").split(",") if name.strip() and name.strip() not in CAPS]
    if unknown:  # else they would be skipped, and the rest "all ok"
        parser.error(f"--only {args.only}: no row named {', '.join(unknown)}; the rows are {', '.join(CAPS)}")
    if args.count_syncs:
        count_syncs(args.count_syncs.resolve(), args.dry_run)
        return 0
    started = time.monotonic()
    out = args.out.resolve()
    shutil.rmtree(out / "logs", ignore_errors=True)  # this check's logs only
    check = Check(args.dry_run, out, args.wheels.resolve())
    rows = run_rows(check, ROWS, args.only, started, "gpu-check")
    print(table(rows), flush=True)
    result = write_json(rows, args.json or out / "gpu_check.json", args.dry_run, started)
    print(f"gpu-check: {'dry run, ' if args.dry_run else ''}{len(rows)} rows in {result['seconds']:.0f} s; "
          f"{'all ok' if result['ok'] else 'failed: ' + ', '.join(result['failed'])}; table in "
          f"{args.json or out / 'gpu_check.json'}, logs in {out / 'logs'}", flush=True)
    bring_back(args.json or out / "gpu_check.json", out / "logs", "gpu_check")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
