"""SIGTERM / SIGINT during training: recorded, then agreed on by every process at one step, which saves and stops."""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING

from accel_train.console import NOLOCK
from accel_train.distributed.collectives import cpu_group
from accel_train.distributed.environment import launcher_environment

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from accelerate import Accelerator


class StopSignals:
    """SIGTERM / SIGINT are recorded instead of killing the process; all processes then agree to stop at one step.

    Launchers (torchrun, accelerate launch, SLURM, Kubernetes) forward the signal to every worker and then
    allow a grace period before SIGKILL; a second signal (the launcher forwarding Ctrl-C once more) must not
    cut the checkpoint short, so it is only noted.

    The agreement is an all-reduce over a CPU (gloo) group, never the GPU one, so it needs no device sync. Each
    optimizer step starts one without waiting (async_op) and reads the one the step before started, which has had
    a whole step to finish: the network round trip between machines stays off the step, and a signal stops the
    run at most one step after the step it came in (a store-backed run too, whose saves take longer).
    """

    HANDLED = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, accelerator: Accelerator, collective_timeout_s: float = 600) -> None:
        self.accelerator, self.process = accelerator, accelerator.process_index
        self.timeout_s = collective_timeout_s
        self.received: str | None = None
        self._under_way = None  # (flag tensor, torch's Work) of the agreement the previous step started
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

    def __exit__(self, kind, error, trace) -> None:
        """Training is over: the signals act as they did before (a script calling train() gets Ctrl-C back). An
        agreement still under way ends first, unless training failed (a peer may be gone, that it would wait for)."""
        if kind is None and self._under_way is not None:
            self._under_way[1].wait()
        self._under_way = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _record(self, signum: int, frame) -> None:
        if self.received is None and not self.quiet:
            self.received = signal.Signals(signum).name
            # a warning (the run ends early, as asked), headed as the command line always said it: no "warning:"
            logger.warning(f"{self.received} received by process {self.process}: saving a checkpoint at the next "
                           "agreed step, then exiting", extra={**NOLOCK, "heading": "accel-train: "})

    def agreed(self, step: int, now: bool = False) -> bool:
        """True on every process, at the same step, once any process got SIGTERM / SIGINT.

        Asked after every optimizer step: it reads the agreement the previous step started and starts this step's,
        so a signal is agreed on at the step after the one it came in. `now=True` (where the processes wait for each
        other anyway, after an evaluation) agrees at once. A single process needs no agreement and stops at the next
        step.
        """
        if self.accelerator.num_processes == 1:
            return self.received is not None
        import torch
        import torch.distributed as dist

        received = False
        if self._under_way is not None:
            flag, work = self._under_way
            self._under_way = None
            work.wait()
            received = flag.item() > 0
        if received:  # every process read the same flag: none starts another
            return True
        flag = torch.tensor([float(self.received is not None)])
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=cpu_group(self.timeout_s), async_op=not now)
        if now:
            return flag.item() > 0
        self._under_way = (flag, work)
        return False

    def stop_message(self, step: int, saved: str | None) -> str:
        """Where the run stopped and how it goes on: under a launcher that restarts (an elastic job's membership
        change signals the workers too), the restart itself resumes. `saved` None: that step's save was skipped."""
        launcher = launcher_environment()
        how = ("a restart by the launcher resumes from it (--max_restarts); else run the same command with resume=auto"
               if launcher.max_restarts > launcher.restart else "run the same command with resume=auto to continue")
        where = f"checkpoint saved in {saved}" if saved else "its checkpoint skipped (the newest committed one resumes)"
        return f"stopped by {self.received or 'a signal to another process'} at step {step}; {where}; {how}"


