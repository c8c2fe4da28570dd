"""A job that loses a machine goes on: torchrun's elastic membership (--nnodes 1:2, c10d rendezvous), --max_restarts
and resume=auto, as docs/multi-machine.md shows it.

"Machines" are two torchrun launchers on 127.0.0.1 sharing one output_dir. Machine 0 holds the rendezvous (with c10d
it lives in that machine's torchrun, so it is the one that must survive); machine 1 is lost while the group trains,
its launcher and workers together: killed (SIGKILL, as when a machine dies: the kernel closes its connections and
the survivor's collective fails at once) or stopped (SIGSTOP, as when a machine stops answering: nothing is closed
and the survivor's collective fails at train.collective_timeout_s). Either way the survivor's worker exits non-zero
and its torchrun restarts it, without the lost machine once that machine's rendezvous heartbeat has expired: at
world size 1, from the newest checkpoint, to the end of the run. The lost machine is watched for through the run's
files, not slept for.
"""

import contextlib
import os
import re
import shlex
import signal
import time

import psutil
import pytest
from test_checkpoint import wait_for
from test_launch_paths import torchrun

from accel_train.run.layout import read_starts
from conftest import PROFILES, free_port, read_metrics, run_nodes, slurm_nodes, start

# torch's defaults (join_timeout=600, last_call_timeout=30, a heartbeat every keep_alive_interval=5 s, a machine dead
# after keep_alive_max_attempt=3 missed) scaled down for one box: the survivor re-forms the group 3 s after the lost
# machine's last heartbeat plus the 5-s last call, instead of 15 + 30 s. A 1-s heartbeat is for this test only: across
# real machines a busy one would be taken for dead (docs/multi-machine.md gives the values to use there).
RDZV_CONF = "join_timeout=60,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
# Each attempt's workers meet in a store of their own (the documented command sets it; docs/multi-machine.md).
OWN_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
TOTAL_STEPS = 40  # 960 samples / a global batch of 24
RUN = ["train", "mnist_cnn", "data.synthetic=true", "data.train_subset=960", "data.eval_subset=50",
       "train.batch_size=24", "train.epochs=1", "train.log_every_steps=1", "checkpoint.every_steps=1000",
       "train.plot=false"]
# How each machine is lost, and how long the survivor's collective may wait for it (train.collective_timeout_s).
LOSSES = {"killed": (signal.SIGKILL, 30), "stopped answering": (signal.SIGSTOP, 8)}


def machine(port: int, holds_rendezvous: bool) -> list[str]:
    # On one box both launchers would offer to hold the rendezvous at 127.0.0.1; on real machines only the one at
    # the endpoint does, which is what is_host=false tells machine 1 here.
    conf = RDZV_CONF if holds_rendezvous else f"{RDZV_CONF},is_host=false"
    return torchrun("--nnodes", "1:2", "--nproc_per_node", 1, "--max_restarts", 1, "--rdzv_backend", "c10d",
                    "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "lost-machine", "--rdzv_conf", conf)


def lose(launcher: psutil.Process, how: signal.Signals) -> list[psutil.Process]:
    """The whole machine at once: its launcher and every worker (torchrun starts each in a session of its own, so
    they are not in the launcher's process group). Returns its processes."""
    processes = [launcher, *launcher.children(recursive=True)]
    for process in processes:
        try:
            os.kill(process.pid, how)
        except ProcessLookupError:
            pass
    return processes


@pytest.mark.parametrize("loss", LOSSES)
def test_a_job_that_loses_a_machine_restarts_without_it_at_the_smaller_world_size_and_finishes(loss, tmp_path):
    how, collective_timeout_s = LOSSES[loss]
    out, port = tmp_path / "run", free_port()
    run = [*RUN, f"output_dir={out}", f"train.collective_timeout_s={collective_timeout_s}", "resume=auto"]
    survivor_log = tmp_path / "machine0.log"
    survivor = start([*machine(port, holds_rendezvous=True), *run], survivor_log, env=OWN_STORE)
    lost = start([*machine(port, holds_rendezvous=False), *run], tmp_path / "machine1.log", env=OWN_STORE)

    # The group of both machines trains: a train line, and no checkpoint yet (the restart starts over at step 0).
    wait_for(lambda: (out / "metrics.jsonl").is_file() and read_metrics(out, "train"), survivor, survivor_log)
    assert lost.poll() is None and not (out / "checkpoints").exists()
    lost_machine = lose(psutil.Process(lost.pid), how)
    lost_at = time.monotonic()
    wait_for(lambda: len(read_starts(out)) == 2, survivor, survivor_log)
    regrouped_s = time.monotonic() - lost_at
    assert survivor.wait(timeout=240) == 0, "\n".join(f"{log.name}:\n{log.read_text()[-3000:]}"
                                                     for log in sorted(tmp_path.glob("*.log")))
    finished_s = time.monotonic() - lost_at
    for process in lost_machine:  # a machine that stopped answering is still there: gone for good now
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()

    log = survivor_log.read_text()
    assert (out / "model.safetensors").is_file()
    final = read_metrics(out, "test")[-1]
    assert (final["step"], final["num_samples"]) == (TOTAL_STEPS, 50), final
    assert [line["step"] for line in read_metrics(out, "train")] == list(range(1, TOTAL_STEPS + 1))
    starts = read_starts(out)
    assert [(start["world_size"], start["launcher_restart"]) for start in starts] == [(2, 0), (1, 1)], starts
    assert starts[1]["step"] == 0
    assert re.search(r"training mnist_cnn on mnist: 1 process\(es\), cpu, mixed precision no, "
                     r"restart 1 of at most 1 by the launcher", log), log[-3000:]
    print(f"\nmachine 1 {loss}: the survivor trained again at world size 1 {regrouped_s:.1f} s later "
          f"(collective_timeout_s {collective_timeout_s}, {RDZV_CONF}) and finished {finished_s:.1f} s after the loss")


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
