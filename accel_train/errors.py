"""Errors a user can act on: reported as one line, never as a traceback."""


class UserError(Exception):
    """A mistake in what the user asked for (config, paths, launch); exit code 2."""

    exit_code = 2


class DataNotFoundError(UserError):
    """The dataset is in none of the places we look and cannot be downloaded."""

    exit_code = 3


class LaunchError(UserError):
    """The processes that formed do not match what the launcher asked for."""

    exit_code = 4


class NonFiniteError(UserError):
    """The loss or gradient norm became NaN or inf on some process; every process stopped at that step."""

    exit_code = 5


class Preempted(Exception):
    """SIGTERM / SIGINT stopped training after a checkpoint was saved; `resume=auto` continues. Exit code 75.

    75 is EX_TEMPFAIL ("try again later"), distinct from a failure (1), a user mistake (2) and a plain
    kill by signal (128 + N), so a job scheduler can requeue on exactly this code.
    """

    exit_code = 75
