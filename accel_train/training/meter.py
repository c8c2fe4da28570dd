"""The train-line meter: loss terms summed on the device, read and averaged over processes only when a line is due;
the share of training time spent waiting for data, timed on the host."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from accelerate import Accelerator


class TrainMeter:
    """Per-process sums of the train terms since the last line, leaving out steps the guard skipped.

    Its state (this process's sums) goes into every checkpoint, so the first line after a resume averages
    the same steps, in the same order, as the uninterrupted run's line does.
    """

    def __init__(self, accelerator: Accelerator, global_batch: int, clock=None) -> None:
        self.accelerator, self.global_batch = accelerator, global_batch
        self.clock = clock or time.perf_counter  # seconds
        self.names: list[str] = []
        self._reset()

    def _reset(self) -> None:
        self.sums: torch.Tensor | None = None
        self.counted = torch.zeros((), device=self.accelerator.device)  # steps in the sums (skipped ones are not)
        self.steps, self.started = 0, self.clock()  # every step since the clock started, for samples/s
        self.waited = 0.0  # seconds spent waiting for the next batch since the clock started

    def update(self, terms: dict[str, torch.Tensor], skipped: torch.Tensor) -> None:
        if not self.names:
            self.names = sorted(terms)
        values = torch.stack([terms[name].detach().float() for name in self.names])
        values = torch.where(skipped > 0, 0.0, values)  # not values * 0: a skipped NaN would still be NaN
        self.sums = values if self.sums is None else self.sums + values
        self.counted = self.counted + (skipped == 0)
        self.steps += 1

    def timed(self, batches: Iterable) -> Iterator:
        """`batches`, with the time each one was waited for counted: the data_wait share of a train line.

        Host time in the loader (reading, decoding, augmenting, copying to the device) is time the step did not
        compute: with a GPU the host runs ahead of the device, so a wait here is time the device may sit idle.
        """
        iterator = iter(batches)
        while True:
            asked = self.clock()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.waited += self.clock() - asked
            yield batch

    @contextmanager
    def paused(self):
        """Time inside (evaluation, checkpoints) does not count towards samples_per_s."""
        paused_at = self.clock()
        try:
            yield
        finally:
            self.started += self.clock() - paused_at

    def compute(self, lr: float | torch.Tensor | None = None) -> dict[str, float]:
        """Averages over all processes and the steps since the last line (a collective: one host read), with the LR
        the step applied (on the device when the schedule varies: read in the same go)."""
        logs = {}
        elapsed = self.clock() - self.started
        waiting = min(1.0, self.waited / elapsed) if elapsed > 0 else 0.0
        if self.sums is not None:
            # One gather for both: the terms' mean over processes, and the longest wait (the others wait for it).
            mine = torch.cat([self.sums / self.counted, self.counted.reshape(1),
                              torch.tensor([waiting], device=self.counted.device)])
            every = self.accelerator.gather(mine.reshape(1, -1))  # one row a process
            line = torch.cat([every[:, :-1].mean(0), every[:, -1].max().reshape(1)]).double()
            if isinstance(lr, torch.Tensor):  # float64 keeps the LR's digits (the terms are float32 either way)
                line = torch.cat([line, lr.detach().double().reshape(1).to(line.device)])
            read = line.tolist()
            values, (counted, waiting) = read[:len(self.names)], read[len(self.names):len(self.names) + 2]
            lr = read[-1] if isinstance(lr, torch.Tensor) else lr
            if counted:  # every step since the last line may have been skipped (train.on_nonfinite=skip)
                logs = dict(zip(self.names, values))
        logs["samples_per_s"] = self.steps * self.global_batch / elapsed if elapsed > 0 else float("nan")
        logs["data_wait"] = waiting
        if lr is not None:
            logs["lr"] = float(lr)
        self._reset()
        return logs

    def state_dict(self) -> dict:
        """This process's partial sums (a host read: called at checkpoints only)."""
        sums = self.sums.tolist() if self.sums is not None else None
        return {"names": self.names, "sums": sums, "counted": float(self.counted)}

    @staticmethod
    def merge_states(states: list[dict]) -> dict:
        """The state each process takes from the partial sums of another world size's processes: their mean.

        A line is the mean over processes of each one's sums divided by the steps counted (the same on all), so
        processes that all start from the old processes' mean sums give the line the old processes would have.
        """
        merged = None if states[0]["sums"] is None else \
            [sum(values) / len(states) for values in zip(*(state["sums"] for state in states))]
        return {"names": states[0]["names"], "sums": merged, "counted": states[0]["counted"]}

    def load_state_dict(self, state: dict) -> None:
        device = self.accelerator.device
        self.names = list(state["names"])
        self.sums = None if state["sums"] is None else torch.tensor(state["sums"], dtype=torch.float32, device=device)
        self.counted = torch.tensor(float(state["counted"]), device=device)
