"""A job that loses a machine goes on, and one started later joins it: torchrun's elastic membership (--nnodes 1:2,
c10d rendezvous), --max_restarts and resume=auto, as docs/multi-machine.md shows it.

"Machines" are two torchrun launchers on 127.0.0.1 sharing one output_dir. Machine 0 holds the rendezvous (with c10d
it lives in that machine's torchrun, so it is the one that must survive). Machine 1 is lost once the group has
trained past a checkpoint, its launcher and workers together: killed (SIGKILL, as when a machine's processes die:
the kernel closes their connections and the survivor's collective fails at once) or stopped (SIGSTOP, as when a
machine stops answering: nothing is closed, and the survivor's watchdog names the silent process at
train.stuck_after_s, half of train.collective_timeout_s, and ends it with exit 6).
Either way the survivor's worker exits non-zero and its torchrun restarts it without the lost machine, once that
machine's rendezvous heartbeat has expired: at world size 1, from the newest checkpoint, to the end of the run. A
machine started while another trains alone is taken in by a restart of the group (SIGTERM, a checkpoint), which
resumes at world size 2. Every moment is watched for in the run's files, never slept for.
"""

import contextlib
import json
import os
import re
import shlex
import signal
import time

import psutil
import pytest

from accel_train.run.checkpoint_files import list_checkpoints
from accel_train.run.layout import read_starts
from support.commands import FRESH_LAUNCHER, FRESH_PROCESSES, free_port, start, torchrun, wait_for
from support.locations import PROFILES
from support.nodes import run_nodes, slurm_nodes
from support.runs import assert_resumed_from, read_metrics

# torch's defaults (join_timeout=600, last_call_timeout=30, a heartbeat every keep_alive_interval=5 s, a machine dead
# after keep_alive_max_attempt=3 missed) scaled down for one box: the survivor re-forms the group 3 s after the lost
# machine's last heartbeat plus the 5-s last call, instead of 15 + 30 s. A 1-s heartbeat is for this test only: across
# real machines a busy one would be taken for dead (docs/multi-machine.md gives the values to use there).
RDZV_CONF = "join_timeout=60,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
# Each attempt's workers meet in a store of their own (the documented command sets it; docs/multi-machine.md).
OWN_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
EVERY = 5  # checkpoint.every_steps


def run(out, samples: int, collective_timeout_s: int) -> list[str]:
    """`train` arguments: samples / a global batch of 24 optimizer steps, one epoch."""
    return ["train", "mnist_cnn", "data.synthetic=true", f"data.train_subset={samples}", "data.eval_subset=50",
            "train.batch_size=24", "train.epochs=1", "train.log_every_steps=1", f"checkpoint.every_steps={EVERY}",
            "checkpoint.keep_last=50", "train.plot=false", f"train.collective_timeout_s={collective_timeout_s}",
            f"output_dir={out}", "resume=auto"]


def machine(port: int, holds_rendezvous: bool) -> list[str]:
    # On one box both launchers would offer to hold the rendezvous at 127.0.0.1; on real machines only the one at
    # the endpoint does, which is what is_host=false tells machine 1 here.
    conf = RDZV_CONF if holds_rendezvous else f"{RDZV_CONF},is_host=false"
    return torchrun("--nnodes", "1:2", "--nproc_per_node", 1, "--max_restarts", 1, "--rdzv_backend", "c10d",
                    "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "elastic", "--rdzv_conf", conf)


def lose(launcher: psutil.Process, how: signal.Signals) -> list[psutil.Process]:
    """The whole machine at once: its launcher and every worker (torchrun starts each in a session of its own, so
    they are not in the launcher's process group). Returns its processes."""
    processes = [launcher, *launcher.children(recursive=True)]
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, how)
    return processes


def newest_checkpoint_step(out) -> int | None:
    saved = list_checkpoints(out / "checkpoints")
    return saved[-1][1]["step"] if saved else None


def trained_steps(out) -> list[int]:
    return [line["step"] for line in read_metrics(out, "train")] if (out / "metrics.jsonl").is_file() else []


def logs(folder) -> str:
    return "\n".join(f"{log.name}:\n{log.read_text()[-3000:]}" for log in sorted(folder.glob("*.log")))


# How machine 1 is lost, and how long the survivor's collective may wait for it (train.collective_timeout_s).
LOSSES = {"killed": (signal.SIGKILL, 30), "stopped answering": (signal.SIGSTOP, 8)}


@pytest.mark.parametrize("loss", LOSSES)
def test_a_job_that_loses_a_machine_restarts_without_it_from_the_newest_checkpoint_and_finishes(loss, tmp_path):
    how, collective_timeout_s = LOSSES[loss]
    out, port, total_steps = tmp_path / "run", free_port(), 40
    arguments = run(out, 24 * total_steps, collective_timeout_s)
    survivor_log = tmp_path / "machine0.log"
    # Both launchers start fresh, so that neither meets the rendezvous seconds before the other (a fork of the
    # preloaded interpreter would, and the 5-s last call could close before the fresh one came: seen in CI)
    survivor = start([*machine(port, holds_rendezvous=True), *arguments], survivor_log,
                     env={**OWN_STORE, **FRESH_LAUNCHER})
    # The lost machine's launcher is inspected (psutil) and its processes signalled: fresh ones, and under SIGSTOP
    # every one of them (a stopped command's fork would run on)
    fresh = FRESH_LAUNCHER if how == signal.SIGKILL else FRESH_PROCESSES
    lost = start([*machine(port, holds_rendezvous=False), *arguments], tmp_path / "machine1.log",
                 env={**OWN_STORE, **fresh})

    # Both machines train past a checkpoint: the steps since it are the work the loss costs.
    wait_for(lambda: newest_checkpoint_step(out) and max(trained_steps(out)) > newest_checkpoint_step(out),
             survivor, survivor_log)
    assert lost.poll() is None and read_starts(out)[0]["world_size"] == 2
    lost_machine = lose(psutil.Process(lost.pid), how)
    lost_at, trained_to = time.monotonic(), max(trained_steps(out))
    written = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    wait_for(lambda: len(read_starts(out)) == 2, survivor, survivor_log)
    regrouped_s = time.monotonic() - lost_at
    assert survivor.wait(timeout=240) == 0, logs(tmp_path)
    finished_s = time.monotonic() - lost_at
    for process in lost_machine:  # a machine that stopped answering is still there: gone for good now
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()

    starts = read_starts(out)
    assert [(start["world_size"], start["launcher_restart"], start["checkpoint_world_size"]) for start in starts] \
        == [(2, 0, None), (1, 1, 2)], starts
    resumed_at = starts[1]["step"]
    assert resumed_at % EVERY == 0 and 0 < resumed_at <= trained_to, (resumed_at, trained_to)
    # The lines the group of two wrote before its checkpoint stay as they were (a line being written at the loss
    # has no end yet, and is of a later step anyway).
    kept = [line for line in written if line.endswith("\n") and json.loads(line)["step"] < resumed_at]
    assert_resumed_from(out, resumed_at, kept)
    assert trained_steps(out) == list(range(1, total_steps + 1))  # the lost steps trained again, once
    final = read_metrics(out, "test")[-1]
    assert (final["step"], final["num_samples"]) == (total_steps, 50) and (out / "model.safetensors").is_file()
    log = survivor_log.read_text()
    if how == signal.SIGSTOP:  # no connection closes: the watchdog names the silent process (at stuck_after_s, 4 s)
        named = [line for line in log.splitlines() if line.startswith("accel-train: process ")]
        assert named and ("did not answer" in named[0] or "the main process did not report" in named[0]), log[-3000:]
    assert re.search(r"training mnist_cnn on mnist: 1 process\(es\), resumed from a checkpoint of 2 process\(es\), "
                     r"cpu, mixed precision no, restart 1 of at most 1 by the launcher", log), log[-3000:]
    print(f"\nmachine 1 {loss} at step {trained_to}: the survivor trained again at world size 1 from step "
          f"{resumed_at} {regrouped_s:.1f} s later and finished {finished_s:.1f} s after the loss "
          f"(collective_timeout_s {collective_timeout_s}, {RDZV_CONF})")


def test_a_machine_started_later_joins_the_running_job_at_a_restart_and_the_group_of_two_finishes(tmp_path):
    out, port, total_steps = tmp_path / "run", free_port(), 200  # long enough at 1 process for machine 1 to start
    arguments = run(out, 24 * total_steps, collective_timeout_s=30)
    first_log, later_log = tmp_path / "machine0.log", tmp_path / "machine1.log"
    first = start([*machine(port, holds_rendezvous=True), *arguments], first_log, env=OWN_STORE)
    wait_for(lambda: trained_steps(out), first, first_log)
    later = start([*machine(port, holds_rendezvous=False), *arguments], later_log, env=OWN_STORE)
    started_at = time.monotonic()
    wait_for(lambda: len(read_starts(out)) == 2, first, first_log)
    joined_s = time.monotonic() - started_at
    assert first.wait(timeout=240) == 0 and later.wait(timeout=60) == 0, logs(tmp_path)
    finished_s = time.monotonic() - started_at

    starts = read_starts(out)
    # A membership change: torch stops the group (SIGTERM: a checkpoint at the next step) and counts no restart.
    assert [(start["world_size"], start["launcher_restart"], start["checkpoint_world_size"]) for start in starts] \
        == [(1, 0, None), (2, 0, 1)], starts
    assert 0 < starts[1]["step"] < total_steps
    assert "accel-train: SIGTERM received by process 0" in first_log.read_text()
    assert trained_steps(out) == list(range(1, total_steps + 1))
    final = read_metrics(out, "test")[-1]
    assert (final["step"], final["num_samples"]) == (total_steps, 50) and (out / "model.safetensors").is_file()
    print(f"\nmachine 1 started while machine 0 trained alone: training at world size 2 from step {starts[1]['step']} "
          f"{joined_s:.1f} s after its start, finished {finished_s:.1f} s after it ({RDZV_CONF})")


def test_the_slurm_script_with_min_nodes_runs_the_elastic_torchrun_command_on_every_node_and_keeps_going(tmp_path):
    nodes = slurm_nodes(tmp_path, nodes=2, dry_run=True, SLURM_JOB_ID="1234567", SLURM_GPUS_ON_NODE="a100:4",
                        MIN_NODES="1")
    for result in run_nodes([(command + ["train", "mnist_cnn", "resume=auto"], env) for command, env in nodes]):
        words = shlex.split(result.stdout)  # as bash reads the %q-quoted command
        assert words[:3] == ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "torchrun"], words
        assert words[-4:] == ["accel_train", "train", "mnist_cnn", "resume=auto"]
        options = dict(zip(words[3:-5:2], words[4:-5:2]))  # the same on every node: no machine rank
        assert options == {"--nnodes": "1:2", "--nproc_per_node": "4", "--max_restarts": "3",
                           "--rdzv_backend": "c10d", "--rdzv_endpoint": f"127.0.0.1:{20000 + 1234567 % 20000}",
                           "--rdzv_id": "1234567", "--rdzv_conf": "join_timeout=300,last_call_timeout=30"}, words
    (_, env), _ = nodes
    srun = tmp_path / "fake_slurm_bin" / "srun"  # records how the batch step starts the node tasks
    srun.write_text('#!/bin/bash\necho "$@" > "$0.args"\n')
    srun.chmod(0o755)
    run_nodes([(["bash", str(PROFILES / "slurm_multi_node.sbatch"), "train", "mnist_cnn"], env)])
    srun_options = (tmp_path / "fake_slurm_bin/srun.args").read_text().split(" bash -c ")[0].split()
    assert srun_options == ["--ntasks-per-node=1", "--no-kill", "--kill-on-bad-exit=0"], "a lost node ends no other"


def test_a_job_with_its_run_folder_in_object_storage_loses_a_machine_and_the_survivor_resumes_from_the_store(
        object_store, tmp_path):
    """No shared folder: each machine stages the run on its own disk (ACCEL_TRAIN_STAGING), and the survivor's restart
    finds the newest checkpoint, metrics.jsonl and starts.jsonl in the store alone."""
    url, port, total_steps = object_store.url("runs/elastic"), free_port(), 40
    arguments = run(url, 24 * total_steps, collective_timeout_s=30)
    fs, prefix = object_store.fs(), url.split("://", 1)[1]

    def lines(name: str) -> list[dict]:
        text = fs.cat(f"{prefix}/{name}").decode() if fs.exists(f"{prefix}/{name}") else ""
        return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]

    def committed_steps() -> list[int]:
        return sorted(json.loads(fs.cat(path))["step"] for path in fs.glob(f"{prefix}/checkpoints/*/checkpoint.json"))

    def stored_train_steps() -> list[int]:
        return [line["step"] for line in lines("metrics.jsonl") if line["split"] == "train"]

    survivor_log = tmp_path / "machine0.log"
    survivor = start([*machine(port, holds_rendezvous=True), *arguments], survivor_log,  # fresh as the other: above
                     env={**OWN_STORE, "ACCEL_TRAIN_STAGING": str(tmp_path / "disk0"), **FRESH_LAUNCHER})
    lost = start([*machine(port, holds_rendezvous=False), *arguments], tmp_path / "machine1.log",
                 env={**OWN_STORE, "ACCEL_TRAIN_STAGING": str(tmp_path / "disk1"), **FRESH_LAUNCHER})
    wait_for(lambda: committed_steps() and max(stored_train_steps(), default=0) > committed_steps()[-1],
             survivor, survivor_log)
    assert lost.poll() is None
    lose(psutil.Process(lost.pid), signal.SIGKILL)
    # The steps the store shows trained, until the survivor starts again: the step under way when the machine was
    # lost may still commit its line and checkpoint after the kill (the restart then rewrites what follows its step).
    trained_to = 0
    while len([line for line in lines("starts.jsonl") if "event" not in line]) < 2 and survivor.poll() is None:
        trained_to = max([trained_to, *stored_train_steps(), *committed_steps()])
        time.sleep(0.1)
    assert survivor.wait(timeout=240) == 0, logs(tmp_path)

    starts = [line for line in lines("starts.jsonl") if "event" not in line]
    assert [(start["world_size"], start["launcher_restart"], start["checkpoint_world_size"]) for start in starts] \
        == [(2, 0, None), (1, 1, 2)], starts
    resumed_at = starts[1]["step"]
    assert resumed_at % EVERY == 0 and 0 < resumed_at <= trained_to, (resumed_at, trained_to)
    assert f"resuming from {url}/checkpoints/step-{resumed_at:08d}" in survivor_log.read_text()
    assert stored_train_steps() == list(range(1, total_steps + 1))  # the lost steps trained again, once
    final = [line for line in lines("metrics.jsonl") if line["split"] == "test"][-1]
    assert (final["step"], final["num_samples"]) == (total_steps, 50) and fs.exists(f"{prefix}/model.safetensors")
    assert not list((tmp_path / "disk0").rglob("*.json")), "the survivor's staging is left behind"


def test_a_restarted_gpu_process_takes_its_own_gpu_before_it_forms_the_group(monkeypatch):
    """Without the device set first (and named), NCCL sets up a restarted group's every process on GPU 0."""
    import torch
    import torch.distributed as dist

    from accel_train.distributed.accelerator import form_group_apart_from_earlier_attempts
    from accel_train.distributed.environment import LauncherEnvironment

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(dist, "TCPStore", lambda *args, **kwargs: "agent store")
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: (prefix, store))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.append(("init", backend, kwargs)))
    launcher = LauncherEnvironment(world_size=4, rank=3, local_rank=1, local_world_size=2, node_rank=1,
                                   main_address="10.0.0.1", main_port=29500, restart=2, max_restarts=3,
                                   mixed_precision=None, uses_fsdp=False, uses_agent_store=True)
    form_group_apart_from_earlier_attempts(False, 60, launcher)
    assert calls[0] == ("set_device", 1)
    _, backend, options = calls[1]
    assert backend == "cuda:nccl,cpu:gloo" and options["device_id"] == torch.device("cuda", 1)
    assert options["store"] == ("accel_train/restart_2", "agent store")
    assert (options["rank"], options["world_size"]) == (3, 4)
