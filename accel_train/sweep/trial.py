"""One trial: `accel-train train` in its own run folder, under the sweep's launch command, watched from outside.

The sweep reads the trial's metrics.jsonl as it is written, as `runs` does: no channel between the processes but
the run folder. A trial is stopped by SIGTERM to the process the sweep started (a launcher forwards it), so it
saves a checkpoint and exits 75, as for any preemption, and can be continued with resume=auto.
"""

from __future__ import annotations

import ctypes
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from accel_train.errors import UserError
from accel_train.run.layout import METRICS_FILE, read_jsonl

LOGS_DIR = "logs"
TRIAL_FOLDER = "trial-{number:04d}"
_PR_SET_PDEATHSIG = 1
_ERROR_LINE = re.compile(r"^accel-train: error: (.*)$")
_STOP_LINE = re.compile(r"stopped by SIG[A-Z]+ at step (\d+); checkpoint saved")
_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*")


def trial_folder(sweep: Path, number: int) -> Path:
    return sweep / TRIAL_FOLDER.format(number=number)


def trial_log(sweep: Path, number: int) -> Path:
    return sweep / LOGS_DIR / f"{TRIAL_FOLDER.format(number=number)}.log"


def launch_prefix(launch: str | None) -> list[str]:
    """What runs `-m accel_train train ...`: this Python, or the launch command given (accelerate launch,
    torchrun, accel-train launch, srun ...), which must exist here."""
    if launch is None:
        return [sys.executable]
    try:
        words = shlex.split(launch)
    except ValueError as err:
        raise UserError(f"sweep: --launch '{launch}' cannot be split into words ({err})") from None
    if not words:
        raise UserError("sweep: --launch is empty; give a launch command such as \"accelerate launch "
                        "--num_processes 2\", or leave it out for one process")
    import shutil

    if shutil.which(words[0]) is None:
        raise UserError(f"sweep: --launch '{launch}': {words[0]} is not a command found on PATH")
    return words


def _dies_with_the_sweep() -> None:  # pragma: no cover - runs in the child between fork and exec
    """A sweep that is killed (SIGKILL, a lost session) leaves no trial training on its own: the kernel sends the
    trial SIGTERM, so it saves and exits 75, and the next sweep resumes it (Linux; elsewhere a no-op). prctl through
    ctypes: the standard library has no parent-death signal, and one call is not worth a dependency."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class TrialProcess:
    """The trial's training, started under the launch command; its evaluations as they are written."""

    def __init__(self, command: list[str], folder: Path, log: Path, lock_fd: int | None = None) -> None:
        self.command, self.folder, self.log = command, folder, log
        self.lock_fd = lock_fd
        self.process: subprocess.Popen | None = None
        self.seen = 0  # metrics.jsonl lines already read
        self.selecting: str | None = None  # the split evaluations are reported on: val when the run holds one out
        self.stopped = False  # SIGTERM sent
        self.offset = 0  # where this start's output begins in the log

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as log:
            log.write(f"$ {shlex.join(self.command)}\n")
            log.flush()
            self.offset = log.tell()
            # Its own session: a Ctrl-C typed at the sweep reaches the sweep alone, which stops the trial once.
            # The sweep's lock is held by the trial's processes too, until the last of them ends.
            self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            pass_fds=(self.lock_fd,) if self.lock_fd is not None else (),
                                            preexec_fn=_dies_with_the_sweep if sys.platform == "linux" else None)

    def new_evaluations(self) -> list[dict]:
        """The evaluation lines written since the last call, on the split that selects (val, or test without a
        validation split); a line cut short is read on a later call."""
        path = self.folder / METRICS_FILE
        if not path.is_file():
            return []
        lines = read_jsonl(path)
        fresh, self.seen = lines[self.seen:], len(lines)
        found = []
        for line in fresh:
            if line.get("split") == "val":
                self.selecting = "val"
            if line.get("split") == (self.selecting or "test"):
                found.append(line)
        return found

    def stop(self) -> None:
        """SIGTERM, once: the trial saves its checkpoint and exits 75 (a launcher forwards it to every process)."""
        if not self.stopped and self.process is not None and self.process.poll() is None:
            self.stopped = True
            self.process.send_signal(signal.SIGTERM)

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self) -> int:
        return self.process.wait()

    def output(self) -> str:
        """What this start of the trial has printed (the log holds every start's, one after the other)."""
        try:
            with open(self.log, "rb") as log:
                log.seek(self.offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def saved_at(self) -> int | None:
        """The step of the checkpoint a SIGTERM made the trial save, from its stop line; None without one."""
        saved = _STOP_LINE.findall(self.output())
        return int(saved[-1]) if saved else None

    def stopped_how(self, code: int) -> str:
        """How a trial that was sent SIGTERM ended: the checkpoint it saved, and its exit code."""
        step = self.saved_at()
        saved = "saved no checkpoint (nothing trained yet)" if step is None else f"saved a checkpoint at step {step}"
        return f"{saved} and exited {code}"

    def last_error(self) -> str:
        """The line that says why the trial failed: accel-train's own one-line error, else the exception's last
        line, else the output's last line."""
        lines = [line.strip() for line in self.output().splitlines()[-400:] if line.strip()]
        for pattern, group in ((_ERROR_LINE, 1), (_EXCEPTION_LINE, 0)):
            matches = [m.group(group) for m in map(pattern.match, lines) if m]
            if matches:
                return matches[-1]
        return lines[-1] if lines else "no output"

