"""Lines for people: printed so that a progress bar stays whole, warnings from the main process only."""

from __future__ import annotations

import sys


def say(text: str, error: bool = False, nolock: bool = False) -> None:
    """A line on stdout (stderr) that leaves a progress bar whole: tqdm clears the bar, the line is printed, and the
    bar is drawn again below it. `nolock` in a signal handler, which may interrupt tqdm holding its lock."""
    from tqdm.auto import tqdm

    stream = sys.stderr if error else sys.stdout
    with tqdm.external_write_mode(file=stream, nolock=nolock):
        print(text, file=stream, flush=True)


def note(accelerator, text: str) -> None:
    """One line on stdout, from the main process only."""
    if accelerator.is_main_process:
        say(text)


def warn(accelerator, text: str) -> None:
    """One warning line on stderr, from the main process only."""
    if accelerator.is_main_process:
        say(f"accel-train: warning: {text}", error=True)
