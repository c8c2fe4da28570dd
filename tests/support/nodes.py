"""Several "machines" on this one: launches started together as the nodes of one job, SLURM's node tasks with its
variables faked, and network namespaces joined by a veth pair."""

from __future__ import annotations

import os
import random
import socket
import stat
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.commands import command_env
from support.locations import REPO


def run_nodes(commands: list[tuple[list[str], dict]], timeout: int = 300, check: bool = True,
              apart_s: float = 0) -> list[subprocess.CompletedProcess]:
    """Start every (command, extra env) at once, as the nodes of one job would (or `apart_s` seconds after each
    other, as nodes that boot at different times), and wait for all of them.

    If any runs past `timeout` (a hang at rendezvous or in a collective), all are killed and the test fails.
    """
    procs = []
    for index, (command, env) in enumerate(commands):
        if index and apart_s:
            time.sleep(apart_s)
        procs.append(subprocess.Popen(command, cwd=REPO, env=command_env(env), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    results = []
    try:
        for proc, (command, _) in zip(procs, commands):
            stdout, stderr = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(command, proc.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, 9)
        outputs = [proc.communicate() for proc in procs]
        raise AssertionError(f"{len(procs)} launches did not finish in {timeout}s (hang?)\n" +
                             "\n".join(f"{out[0][-2000:]}\n{out[1][-3000:]}" for out in outputs)) from None
    for result in results:
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(result.args)} exited {result.returncode}\n{result.stdout[-3000:]}\n"
                                 f"{result.stderr[-5000:]}\n(other nodes: {[r.returncode for r in results]})")
    return results


def slurm_nodes(tmp: Path, nodes: int = 2, dry_run: bool = False, **slurm) -> list:
    """The sbatch file as each node's srun task runs it, with SLURM's variables faked and a fake scontrol."""
    fake = tmp / "fake_slurm_bin"
    fake.mkdir(exist_ok=True)
    scontrol = fake / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "127.0.0.1\\n127.0.0.2\\n"\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    path = f"{fake}:{Path(sys.executable).parent}:/usr/bin:/bin"  # `accelerate` from this Python's environment
    env = {"PATH": path, "SLURM_JOB_NUM_NODES": str(nodes),
           "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_JOB_ID": str(job_id_with_free_port()), **slurm}
    if dry_run:
        env["ACCEL_TRAIN_DRY_RUN"] = "1"
    task = ["bash", "accelerate_configs/slurm_multi_node.sbatch", "--node-task"]  # as the batch step's srun runs it
    return [(task, {**env, "SLURM_NODEID": str(rank)}) for rank in range(nodes)]


def job_id_with_free_port() -> int:
    """A SLURM job id whose derived port (20000 + id % 20000) is free on this machine."""
    for _ in range(100):
        port = random.randrange(20000, 40000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return 100000 + port - 20000
    raise RuntimeError("no free port in 20000-39999")


@dataclass
class Host:
    """One network namespace: a "machine" with its own interface and address."""

    namespace: str
    interface: str
    address: str

    def run(self, command: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *command]


@contextmanager
def two_network_namespaces():
    """Two network namespaces joined by a veth pair, so "nodes" reach each other only over that link; deleted after.

    Skips the test where namespaces cannot be created (needs root or CAP_NET_ADMIN, and iproute2's `ip`).
    """
    tag, subnet = f"at{os.getpid() % 100000}", f"10.231.{os.getpid() % 250}"
    hosts = [Host(f"{tag}n{i}", f"{tag}v{i}", f"{subnet}.{i + 1}") for i in (0, 1)]
    setup = [["ip", "netns", "add", host.namespace] for host in hosts]
    setup.append(["ip", "link", "add", hosts[0].interface, "type", "veth", "peer", "name", hosts[1].interface])
    for host in hosts:
        setup += [["ip", "link", "set", host.interface, "netns", host.namespace],
                  ["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface],
                  ["ip", "-n", host.namespace, "link", "set", host.interface, "up"],
                  ["ip", "-n", host.namespace, "link", "set", "lo", "up"]]
    try:
        for command in setup:
            subprocess.run(command, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as err:
        _delete_namespaces(hosts)
        detail = getattr(err, "stderr", "") or str(err)
        pytest.skip(f"cannot create network namespaces ({' '.join(command)}: {detail.strip()}); "
                    "needs root or CAP_NET_ADMIN and iproute2")
    try:
        yield hosts
    finally:
        _delete_namespaces(hosts)


def _delete_namespaces(hosts: list[Host]) -> None:
    for host in hosts:  # deleting a namespace deletes its end of the veth pair, and with it the other end
        subprocess.run(["ip", "netns", "delete", host.namespace], capture_output=True)
