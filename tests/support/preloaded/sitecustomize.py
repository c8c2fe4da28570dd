"""Hands this command to the suite's preloaded interpreter (server.py beside this file) when
ACCEL_TRAIN_TESTS_PRELOADED names its socket: the server's fork runs the command with this process's arguments,
environment, folder and standard streams; this process passes on the signals it gets and ends as the fork ends. Where
the server refuses or is not there yet, the command starts here as usual; so does one with
ACCEL_TRAIN_TESTS_FRESH_HERE=1 (a launcher whose children a test finds with psutil), whose own children are handed
over again. Only the standard library, imported here: every Python the suite starts runs this."""

import os


def _hand_over() -> None:
    address = os.environ.get("ACCEL_TRAIN_TESTS_PRELOADED")
    if not address:
        return
    if os.environ.pop("ACCEL_TRAIN_TESTS_FRESH_HERE", None) == "1":  # this process fresh; what it starts, forks
        return
    import json
    import signal
    import socket
    import struct
    import sys

    request = {"argv": sys.orig_argv, "env": dict(os.environ), "cwd": os.getcwd(), "executable": sys.executable,
               "uid": os.getuid(),
               "namespaces": {name: os.readlink(f"/proc/self/ns/{name}") for name in ("net", "mnt", "pid")}}
    data = json.dumps(request).encode()
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(address)
        socket.send_fds(connection, [struct.pack("!I", len(data)) + data], [0, 1, 2])
        reader = connection.makefile("rb")
        answer = reader.readline().decode().split(" ", 1)
    except OSError:
        connection.close()
        return
    if answer[0] != "pid":
        connection.close()
        return
    pid = int(answer[1])

    def pass_on(number, _frame):
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass

    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, pass_on)
    line = reader.readline().decode().split(" ", 1)
    if line[0] != "status":  # the server is gone: so is the fork
        os._exit(1)
    status = int(line[1])
    if os.WIFSIGNALED(status):
        if os.WTERMSIG(status) != signal.SIGKILL:  # SIGKILL's action cannot be set: signal() raises, and the command
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)  # would then start again here, as a fresh interpreter
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


_hand_over()
