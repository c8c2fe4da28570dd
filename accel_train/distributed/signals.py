"""SIGTERM / SIGINT during training: recorded, then agreed on by every process at one step, which saves and stops."""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING

from accel_train.console import say
from accel_train.distributed.collectives import cpu_group
from accel_train.distributed.environment import launcher_environment

if TYPE_CHECKING:
    from accelerate import Accelerator


SIGNAL_CHECK_S = 2.0  # how often processes agree on a stop signal: well inside launchers' 30 s grace before SIGKILL
MAX_STEPS_BETWEEN_CHECKS = 10_000


def steps_between_checks(seconds_per_step: float, every_s: float = SIGNAL_CHECK_S) -> int:
    """Optimizer steps until the next stop-signal agreement: about `every_s` seconds of the slowest process."""
    if seconds_per_step <= 0:
        return 1
    return max(1, min(MAX_STEPS_BETWEEN_CHECKS, int(every_s / seconds_per_step)))


class StopSignals:
    """SIGTERM / SIGINT are recorded instead of killing the process; all processes then agree to stop at one step.

    Launchers (torchrun, accelerate launch, SLURM, Kubernetes) forward the signal to every worker and then
    allow a grace period before SIGKILL; a second signal (the launcher forwarding Ctrl-C once more) must not
    cut the checkpoint short, so it is only noted.

    The agreement is an all-reduce over a CPU (gloo) group, never the GPU one, so it needs no device sync; and
    it happens about every SIGNAL_CHECK_S seconds rather than every step, because on several machines each one
    is a network round trip. Every process computes the same next step to agree at, from values it reduced.
    """

    HANDLED = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, accelerator: Accelerator, collective_timeout_s: float = 600) -> None:
        self.accelerator, self.process = accelerator, accelerator.process_index
        self.timeout_s = collective_timeout_s
        self.received: str | None = None
        self.next_check: int | None = None  # None: at the first step asked
        self._last_check: tuple[int, float] | None = None  # (step, time) of the previous agreement
        self._previous = {}
        # Set once this process is ending itself (watchdog.py: it stopped, or waits for one that did): a signal
        # then changes nothing, and says nothing of a checkpoint that will not come.
        self.quiet = False

    def __enter__(self) -> StopSignals:
        """Training starts: from here a signal saves a checkpoint instead of ending the process."""
        import threading

        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            self._previous = {sig: signal.signal(sig, self._record) for sig in self.HANDLED}
        return self

    def __exit__(self, *exc) -> None:
        """Training is over: the signals act as they did before (a script calling train() gets Ctrl-C back)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _record(self, signum: int, frame) -> None:
        if self.received is None and not self.quiet:
            self.received = signal.Signals(signum).name
            say(f"accel-train: {self.received} received by process {self.process}: saving a checkpoint at the "
                "next agreed step, then exiting", error=True, nolock=True)

    def agreed(self, step: int, now: bool = False) -> bool:
        """True on every process, at the same step, once any process got SIGTERM / SIGINT.

        Asked after every optimizer step; `now=True` (where the processes wait for each other anyway, after an
        evaluation) agrees at once. A single process needs no agreement and stops at the next step.
        """
        if self.accelerator.num_processes == 1:
            return self.received is not None
        if not now and self.next_check is not None and step < self.next_check:
            return False
        import torch
        import torch.distributed as dist

        clock = time.perf_counter()
        seconds_per_step = 0.0
        if self._last_check is not None and step > self._last_check[0]:
            seconds_per_step = (clock - self._last_check[1]) / (step - self._last_check[0])
        flags = torch.tensor([float(self.received is not None), seconds_per_step])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=cpu_group(self.timeout_s))
        received, slowest = flags.tolist()
        self.next_check = step + steps_between_checks(slowest)
        self._last_check = (step, time.perf_counter())
        return received > 0

    def stop_message(self, step: int, saved: str | None) -> str:
        """Where the run stopped and how it goes on: under a launcher that restarts (an elastic job's membership
        change signals the workers too), the restart itself resumes. `saved` None: that step's save was skipped."""
        launcher = launcher_environment()
        how = ("a restart by the launcher resumes from it (--max_restarts); else run the same command with resume=auto"
               if launcher.max_restarts > launcher.restart else "run the same command with resume=auto to continue")
        where = f"checkpoint saved in {saved}" if saved else "its checkpoint skipped (the newest committed one resumes)"
        return f"stopped by {self.received or 'a signal to another process'} at step {step}; {where}; {how}"


