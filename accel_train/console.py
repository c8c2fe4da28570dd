"""Lines for people, through `logging`: each module logs to `logging.getLogger(__name__)`, under the "accel_train"
logger, and the handler here prints those records as plain lines that leave a progress bar whole.

The rule (docs/user-code.md, "The lines a run prints"): importing accel_train gives the "accel_train" logger this
handler, the INFO level where the program set none, and propagate=False. So a program that configures nothing, and
the command line, see the lines as they have always been printed, each once; a program controls them with the
standard calls:

    logging.getLogger("accel_train").setLevel(logging.WARNING)  # warnings and errors only, and no progress bar
    logging.getLogger("accel_train").addHandler(handler)        # `handler` receives every record too
    logging.getLogger("accel_train").propagate = True           # the program's own handlers print them, not this one
"""

from __future__ import annotations

import logging
import sys

LOGGER = "accel_train"
# extra= of a line said in a signal handler or the watchdog's thread: printed without tqdm's lock, which the
# interrupted (or stuck) main thread may hold.
NOLOCK = {"nolock": True}


class ConsoleHandler(logging.Handler):
    """INFO and below on stdout, WARNING and above on stderr, as plain lines: a warning headed "accel-train: warning: ",
    an error "accel-train: " (a record's `heading` attribute, given by extra=, takes the place of its level's). tqdm
    clears its bar, the line is printed, and the bar is drawn again below it."""

    def emit(self, record: logging.LogRecord) -> None:
        # propagate=True hands the records to the program's handlers: printing them here too would show each twice
        if logging.getLogger(LOGGER).propagate:
            return
        from tqdm.auto import tqdm

        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout  # at emit: pytest's capsys swaps them
        text = getattr(record, "heading", heading(record.levelno)) + self.format(record)
        # no handleError: a print that fails (a closed pipe) fails the caller, as the print before logging did
        with tqdm.external_write_mode(file=stream, nolock=getattr(record, "nolock", False)):
            print(text, file=stream, flush=True)


def heading(level: int) -> str:
    if level >= logging.ERROR:
        return "accel-train: "
    return "accel-train: warning: " if level >= logging.WARNING else ""


def print_lines_unless_told_otherwise() -> None:
    """At import of the package: the handler on the "accel_train" logger, once (a reload does not add a second),
    INFO unless the program chose a level before importing us."""
    logger = logging.getLogger(LOGGER)
    if any(isinstance(handler, ConsoleHandler) for handler in logger.handlers):
        return
    logger.addHandler(ConsoleHandler())
    logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def bar_disabled(log: logging.Logger) -> bool | None:
    """tqdm's `disable` for a progress bar of ours: None (a bar where stderr is a terminal, none in a log file)
    unless the program silenced `log`'s INFO lines, which silences the bar too."""
    return None if log.isEnabledFor(logging.INFO) else True


def note(log: logging.Logger, accelerator, text: str) -> None:
    """An INFO line from the main process only: every process knows the same thing."""
    if accelerator.is_main_process:
        log.info(text, stacklevel=2)


def warn(log: logging.Logger, accelerator, text: str) -> None:
    """A WARNING from the main process only: every process would say the same."""
    if accelerator.is_main_process:
        log.warning(text, stacklevel=2)
