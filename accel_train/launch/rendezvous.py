"""Machine 0's rendezvous seen from another machine: whether anything listens there, and whether what answers is
a torch TCPStore (a launch's rendezvous) rather than another program or a proxy."""

from __future__ import annotations

import os
import select
import signal
import socket
import warnings
from datetime import timedelta


def reachable(ip: str, port: int) -> str | None:
    """None when something listens at ip:port, else why not, in words."""
    try:
        with socket.create_connection((ip, port), timeout=3):
            return None
    except ConnectionRefusedError:
        return "connection refused: nothing listens there yet"
    except TimeoutError:
        return "timed out: a firewall, or the wrong address"
    except OSError as err:
        return err.strerror or str(err)


def store_answers(ip: str, port: int, timeout: float) -> str | None:
    """None when a torch TCPStore (a launch's rendezvous) answers at ip:port within `timeout` seconds, else why not,
    in words. A client asks it one read-only question in a child process that is killed after `timeout`: torch's
    client waits forever on a server that accepts the connection and never answers (another program, a proxy or a
    firewall), and logs each failed try with a C++ stack trace."""
    from torch.distributed import TCPStore  # before the fork, so the child only asks

    read, write = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns of fork in a threaded process; the child only asks, then exits
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            # torch retries for its timeout and overshoots it: half the time leaves its answer inside ours
            store = TCPStore(ip, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout / 2))
            store.num_keys()  # changes nothing and waits for nothing; only a TCPStore answers it
            os.write(write, b"+")
        except Exception as err:  # any failure means no TCPStore answered; its first line says why
            os.write(write, b"-" + (str(err).splitlines() or [type(err).__name__])[0][:500].encode())
        finally:
            os._exit(0)
    os.close(write)
    answer = select.poll()
    answer.register(read, select.POLLIN)
    try:
        said = os.read(read, 1024) if answer.poll(timeout * 1000) else None
    finally:
        os.close(read)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    if said is None:
        return f"no answer in {timeout:g} s"
    return None if said == b"+" else f"torch: {said[1:].decode(errors='replace') or 'the client died'}"
