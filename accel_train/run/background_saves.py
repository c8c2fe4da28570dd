"""The saves a run writes in the background, from the training thread's side: the newest, waited for by the next save
or the end of the run, and those a wait gave up on, which go on and commit themselves. Each is said once it has
ended, on the training thread: its checkpoint_saved hook, or one warning (raised with checkpoint.require_upload, or
when the disk failed); the end says which saves it ends without."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from accel_train import hooks
from accel_train.console import warn
from accel_train.errors import UserError
from accel_train.storage import StoreUnavailable

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from concurrent.futures import Future

    from accelerate import Accelerator

    from accel_train.config import CheckpointConfig
    from accel_train.run.place import Worker
    from accel_train.state import Progress


@dataclass
class UnderWay:
    """A save written in the background that the training thread has not yet seen end."""

    progress: Progress
    name: str  # its folder's, `.partial-NAME` until committed
    job: Future
    location: str  # where it will be, as the user knows it


class BackgroundSaves:
    """`worker`: the thread the saves are written on, in the order submitted; `save_verb`: what it does to them, as
    lines say it (written, uploaded)."""

    def __init__(self, accelerator: Accelerator, cfg: CheckpointConfig, worker: Worker, save_verb: str) -> None:
        self.accelerator, self.cfg, self.worker, self.save_verb = accelerator, cfg, worker, save_verb
        self.pending: UnderWay | None = None  # the newest save, waited for by the next save or the end
        self.overdue: list[UnderWay] = []  # saves that wait gave up on, oldest first: still under way, or not yet said

    def add(self, save: UnderWay) -> None:
        self.pending = save

    def overdue_names(self) -> set[str]:
        """The saves still being written after a wait gave up on them: their partial folders are in use."""
        return {save.name for save in self.overdue}

    def settle(self, bound_s: float | None = None, at_end: bool = False) -> None:
        """Wait (at most `bound_s`, else checkpoint.upload_wait_s) for the pending save, and say each that ended. A
        save this wait gives up on goes on and is said at a later settle; the end waits for it too."""
        bound_s = self.cfg.upload_wait_s if bound_s is None else bound_s
        if self.pending is not None or (at_end and self.overdue):
            self.worker.idle_within(bound_s)  # every job so far, run in the order submitted: these saves' among them
        for save in [save for save in self.overdue if save.job.done()]:
            self.overdue.remove(save)
            self._said_late(save)
        pending, self.pending = self.pending, None
        if pending is not None and pending.job.done():
            self._said(pending)
        elif pending is not None:
            self.overdue.append(pending)
            if not at_end:
                warn(logger, self.accelerator,
                     f"the checkpoint of step {pending.progress.step} is still being {self.save_verb} after "
                     f"{bound_s:g} s (checkpoint.upload_wait_s); going on without it: it is committed if it ends, "
                     "and a later line says if it fails")
        if at_end:
            for save in self.overdue:
                warn(logger, self.accelerator,
                     f"the checkpoint of step {save.progress.step} is still being {self.save_verb} after "
                     f"{bound_s:g} s (checkpoint.upload_wait_s); ending without it: resume=auto takes the newest "
                     "committed checkpoint")
            self.overdue = []

    def _said(self, save: UnderWay) -> None:
        """A save the training thread waited for, ended."""
        try:
            save.job.result(timeout=0)
        except StoreUnavailable as err:
            if self.cfg.require_upload:
                raise
            logger.warning(f"the checkpoint of step {save.progress.step} did not reach the store ({err}); training "
                           "goes on and the next save tries again (checkpoint.require_upload=true stops instead)")
            return
        hooks.every().checkpoint_saved(save.progress, save.location)

    def _said_late(self, save: UnderWay) -> None:
        """A save training went on without, ended: committed (its worker did it), or failed, which is a warning, not
        an error: the run already goes on without it. Each process says its own failure (errors.py)."""
        error = save.job.exception(timeout=0)
        if error is None:
            hooks.every().checkpoint_saved(save.progress, save.location)
            return
        reason = str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"  # ours: one line
        logger.warning(f"the checkpoint of step {save.progress.step} failed after training went on without it "
                       f"({reason.splitlines()[0]}); resume=auto takes the newest committed checkpoint")
