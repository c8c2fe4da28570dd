"""`accel-train launch`: `accelerate launch`, once every machine has said it is there.

torch's rendezvous, which runs before any of our code, waits in silence (10 minutes by default) for a machine
that is missing, not started yet, or unreachable: the classic multi-machine hang. So each machine first joins a
short meeting at main_process_ip:main_process_port, held by machine 0 in torch's own TCPStore, and says every
few seconds how many machines have joined, which are missing, on which address, and when it gives up. Once all
are there, each hands its arguments, unchanged, to `accelerate launch`, whose rendezvous then finds everyone.
On one machine there is nothing to wait for and the hand-over is immediate.

A job that goes on when a machine is lost, and takes in a machine started later, is not launched here: accelerate
launch takes a fixed number of machines, and this meeting waits for all of them. torchrun's elastic membership
does it, the same command on every machine (10.0.0.1: the machine holding the rendezvous, which must survive):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc_per_node 8 --max_restarts 3 \\
        --rdzv_backend c10d --rdzv_endpoint 10.0.0.1:29500 --rdzv_id JOB \\
        --rdzv_conf join_timeout=600,last_call_timeout=30 \\
        -m accel_train train RECIPE output_dir=SHARED_FOLDER resume=auto

(docs/multi-machine.md, "A job that loses a machine goes on").
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import datetime, timedelta

from accel_train.errors import LaunchError, UserError
from accel_train.launch.rendezvous import reachable, store_answers
from accel_train.launch.settings import settings_of_command

JOIN_TIMEOUT_S = 300.0  # documented in README, the profiles and the SLURM script: shorter than torch's silent 600 s
SAY_EVERY_S = 10.0
KEY = "accel_train/launch"
USAGE = "accel-train launch [--join_timeout SECONDS] ACCELERATE_LAUNCH_ARGUMENTS... -m accel_train train RECIPE ..."


def split_arguments(argv: list[str]) -> tuple[float, list[str]]:
    """(join timeout, the arguments for accelerate launch). Our one option comes first, so the rest is passed on
    untouched."""
    if argv[:1] == ["--join_timeout"] or argv[:1] and argv[0].startswith("--join_timeout="):
        if "=" in argv[0]:
            value, rest = argv[0].split("=", 1)[1], argv[1:]
        else:
            value, rest = (argv[1:2] or [""])[0], argv[2:]
        try:
            timeout = float(value)
        except ValueError:
            timeout = -1
        if timeout <= 0:
            raise UserError(f"--join_timeout={value}: give the seconds to wait for the other machines, e.g. 300")
        return timeout, rest
    return JOIN_TIMEOUT_S, list(argv)


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {USAGE}\n\n{__doc__.strip()}")
        return
    timeout, arguments = split_arguments(argv)
    settings, config_file = settings_of_command(arguments)
    if settings.num_machines > 1:
        meet(settings, config_file, timeout)
    command = [sys.executable, "-m", "accelerate.commands.launch", *arguments]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)


def say(text: str) -> None:
    print(f"accel-train launch: {text}", file=sys.stderr, flush=True)


def meet(settings, config_file: str | None, timeout: float) -> None:
    """Return once every machine has joined; LaunchError naming the missing ones after `timeout` seconds. The launch
    settings were checked (check_addressing) before."""
    machines, rank, port = settings.num_machines, settings.machine_rank, settings.main_process_port
    ip = settings.main_process_ip
    started = time.monotonic()
    deadline = started + timeout
    give_up = f"giving up at {(datetime.now() + timedelta(seconds=timeout)).strftime('%H:%M:%S')} ({timeout:g} s)"
    doctor = (f"`accel-train doctor{f' --config_file {config_file}' if config_file else ''} --machine_rank {rank} "
              f"--main_process_ip {ip}` says what is wrong on this machine")
    say(f"machine {rank} of {machines}: waiting for the other machines at {ip}:{port}, {give_up}")
    store = join(ip, port, rank, machines, deadline, give_up, doctor)
    per_machine = settings.num_processes // machines
    said = time.monotonic()
    while True:
        missing = [r for r in range(machines) if not store.check([f"{KEY}/machine/{r}"])]
        if not missing:
            break
        joined = machines - len(missing)
        status = (f"{joined} of {machines} machines ({joined * per_machine} of {settings.num_processes} processes) "
                  f"joined at {ip}:{port}; waiting for machine(s) {', '.join(map(str, missing))}")
        if time.monotonic() >= deadline:
            raise LaunchError(f"gave up after {timeout:g} s: {status}. Start the missing machines, or check their "
                              f"--main_process_ip, port and firewall: {doctor}")
        if time.monotonic() - said >= SAY_EVERY_S:
            said = time.monotonic()
            say(f"{status}, {give_up}")
        time.sleep(0.2)
    say(f"all {machines} machines joined in {time.monotonic() - started:.1f} s; handing over to accelerate launch")
    leave(store, rank, machines)


def join(ip: str, port: int, rank: int, machines: int, deadline: float, give_up: str, doctor: str):
    """Machine 0 holds the meeting (a TCPStore server on the main port); the others connect to it, saying why they
    cannot while they cannot."""
    from torch.distributed import TCPStore

    if rank == 0:
        try:
            store = TCPStore(ip, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
        except (RuntimeError, OSError) as err:
            raise LaunchError(f"this is machine 0 but it cannot listen on {ip}:{port} ({str(err).splitlines()[0]}); "
                              "choose a free --main_process_port on every machine, or run machine 0 on "
                              f"{ip}: {doctor}") from None
    else:
        said = 0.0
        while True:
            reason = reachable(ip, port)
            if reason is None and (why := store_answers(ip, port, timeout=10)):
                reason = f"a connection was accepted, but no torch rendezvous answers: {why}"
            if reason is None:
                try:
                    store = TCPStore(ip, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
                    break
                except (RuntimeError, OSError) as err:
                    reason = str(err).splitlines()[0]
            # said before the deadline is looked at: a machine slow to start (its timeout spent importing torch)
            # still names what it waited for once before it gives up
            if time.monotonic() - said >= SAY_EVERY_S:
                said = time.monotonic()
                say(f"0 of {machines} machines joined: machine 0 not reached at {ip}:{port} ({reason}); {give_up}; "
                    f"{doctor}")
            if time.monotonic() >= deadline:
                raise LaunchError(f"gave up: machine 0 never answered at {ip}:{port} ({reason}). Start machine 0, or "
                                  f"check --main_process_ip, the port and the firewall: {doctor}")
            time.sleep(1.0)
    if int(store.add(f"{KEY}/rank/{rank}", 1)) > 1:
        raise LaunchError(f"two machines were started with --machine_rank {rank}: give each machine its own rank, "
                          "0 on the main node")
    store.set(f"{KEY}/machine/{rank}", socket.gethostname())
    return store


def leave(store, rank: int, machines: int) -> None:
    """Machine 0 closes the meeting only after the others have left it, so the port is free for accelerate
    launch's own rendezvous on machine 0 (the others then retry until it listens). The others hand over only once the
    meeting has closed: a launcher that starts at once (a warm interpreter) would otherwise take the meeting for the
    rendezvous, and lose it when machine 0 closes it."""
    if rank:
        store.add(f"{KEY}/left", 1)
        deadline = time.monotonic() + 30
        sys.stderr.flush()
        error_output = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)  # torch logs the closed connection with a C++ stack trace
        os.close(null)
        try:
            while time.monotonic() < deadline:
                store.check([f"{KEY}/left"])
                time.sleep(0.05)
        except Exception:  # torch's DistNetworkError, RuntimeError: machine 0 closed the meeting
            pass
        finally:
            os.dup2(error_output, 2)
            os.close(error_output)
        return
    deadline = time.monotonic() + 30
    while int(store.add(f"{KEY}/left", 0)) < machines - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # the others close their connections first, so machine 0 keeps no socket on the port
