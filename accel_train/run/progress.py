"""Where training is: the loop alone changes it, observers read it, and a checkpoint restores it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Progress:
    steps_per_epoch: int
    total_steps: int
    epoch: int = 0
    step: int = 0  # optimizer steps taken
    last_eval: dict = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)  # this process's start of the run (set-up included)
    elapsed_before_s: float = 0.0  # what the run had taken up to the checkpoint it resumed from

    def elapsed_s(self) -> float:
        """Seconds the run has taken over all its resumes (time lost after a crash's last checkpoint not counted)."""
        return self.elapsed_before_s + time.perf_counter() - self.started

    def batches_done_in_epoch(self) -> int:
        """Optimizer steps of the current epoch already taken: where its sampler continues."""
        return self.step - self.epoch * self.steps_per_epoch

    def state_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "last_eval": dict(self.last_eval),
                "elapsed_s": self.elapsed_s()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.last_eval = state["step"], dict(state["last_eval"])
        self.elapsed_before_s = state["elapsed_s"]
