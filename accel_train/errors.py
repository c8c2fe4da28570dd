"""Errors a user can act on: reported as one line, never as a traceback. Each class is one exit code (README).

A failure of the disk while writing becomes a StorageError here (`writing`); lines for people are console.py's."""


class UserError(Exception):
    """A mistake in what the user asked for (config, paths, launch); exit code 2."""

    exit_code = 2
    # Raised alike on every process (config, launch checks, collective decisions): the main process reports it.
    # An error one process meets alone (a file it reads or writes) is reported by that process.
    on_every_process = True

    def __init__(self, message: str) -> None:
        # A DataLoader worker's exception reaches the main process re-raised with the worker's traceback as its
        # message; the line we wrote is the traceback's last one.
        if "Traceback (most recent call last)" in message:
            message = message.rstrip().splitlines()[-1].split(": ", 1)[-1]
        super().__init__(message)


class OutOfDeviceMemory(UserError):
    """One process ran out of device memory where a smaller micro-batch is not taken (a fixed micro_batch_size, FSDP)
    or does not help (the optimizer step); exit code 2, as for the setting to change. Reported by that process; the
    launcher ends the others."""

    on_every_process = False


class DataNotFoundError(UserError):
    """A dataset or weights file is in none of the places we look, or cannot be read; exit code 3."""

    exit_code = 3


class UnreadableFileError(DataNotFoundError):
    """One file of the data (an image, exported weights) is damaged or not what its name says; exit code 3."""

    on_every_process = False


class LaunchError(UserError):
    """The processes that formed do not match what the launcher asked for."""

    exit_code = 4


class NonFiniteError(UserError):
    """The loss or gradient norm became NaN or inf on some process; every process stopped at the same step."""

    exit_code = 5


class Stuck(Exception):
    """No process made progress for train.stuck_after_s: each live process wrote its stacks to output_dir/stuck/, the
    main process named the stopped ones in one line, and every process ended itself; exit code 6. Ended from the
    watchdog's thread (distributed/watchdog.py), since the main thread is the one that is blocked: never raised."""

    exit_code = 6


class PeerLost(UserError):
    """A collective failed because another process died or stopped answering; exit code 1, as the crash it follows.
    Said by each process that saw it (the main process may be the one that is gone)."""

    exit_code = 1
    on_every_process = False


class NothingCompleted(UserError):
    """A sweep ended without one complete trial (each failed or was pruned): there is no result; exit code 1."""

    exit_code = 1


class StorageError(UserError):
    """output_dir cannot be written (disk full, read-only, permission denied); exit code 74 (EX_IOERR)."""

    exit_code = 74
    on_every_process = False


class Preempted(Exception):
    """SIGTERM / SIGINT stopped training after a checkpoint was saved; `resume=auto` continues. Exit code 75.

    75 is EX_TEMPFAIL ("try again later"), distinct from a failure (1), a user mistake (2) and a plain
    kill by signal (128 + N), so a job scheduler can requeue on exactly this code.
    """

    exit_code = 75


def refused_call(err: Exception) -> str | None:
    """The function a pickle calls that torch.load(weights_only=True) refused to call (its words: "Unsupported
    global: GLOBAL x.y was not an allowed global", "unsupported GLOBAL os.system whose module os is blocked"), or
    None for any other error."""
    import re

    refused = re.search(r"unsupported (?:global: )?GLOBAL (\S+)", str(err), re.IGNORECASE)
    return refused.group(1) if refused else None


def did_you_mean(name: str, choices) -> str:
    """` (did you mean X?)` for the closest of `choices`, for the line that names a mistyped name; or nothing."""
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


FULL_DISK_BYTES = 16 * 2**20  # below this much free space, a failed write is taken to be the full disk


RESUME_HINT = ("free space or choose another output_dir, then run again with resume=auto: checkpoints saved before "
               "are intact")


def storage_error(path, action: str, err: Exception, hint: str = RESUME_HINT) -> StorageError | None:
    """The StorageError to raise when writing `path` failed because of the disk, or None for any other cause.

    torch.save reports a full disk only as "unexpected pos" and safetensors as an "I/O error", so the free
    space is asked for when the error itself does not say.
    """
    import errno
    import shutil
    from pathlib import Path

    code, text = getattr(err, "errno", None), str(err)
    reason = None
    if code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text:
        reason = "no space left on the device"
    elif code == errno.EROFS:
        reason = "read-only file system"
    elif code in (errno.EACCES, errno.EPERM):
        reason = "permission denied"
    elif isinstance(err, OSError):
        reason = err.strerror or type(err).__name__
    else:
        folder = Path(path)
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            free = None
        if free is not None and free < FULL_DISK_BYTES:
            reason = f"no space left on the device: {free / 2**20:.1f} MiB free"
    if reason is None:
        return None
    return StorageError(f"cannot write {path} while {action} ({reason}); {hint}")


class writing:
    """`with writing(path, "saving a checkpoint"):` turns a failure of the disk into one StorageError line."""

    def __init__(self, path, action: str, hint: str = RESUME_HINT) -> None:
        self.path, self.action, self.hint = path, action, hint

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, traceback) -> bool:
        if err is None or isinstance(err, UserError) or not isinstance(err, Exception):
            return False
        error = storage_error(self.path, self.action, err, self.hint)
        if error is None:
            return False
        raise error from None
