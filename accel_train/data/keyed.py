"""Keyed randomness: every random draw of a sample's augmentation a function of (seed, epoch, its index), so a
sample is augmented alike at any world size, with any number of DataLoader workers and after a resume."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import Dataset

_LOW_33_BITS = (1 << 33) - 1



def sample_keys(indices: torch.Tensor, epoch: int, seed: int) -> torch.Tensor:
    """A random 62-bit number per (seed, epoch, sample index), computed where the indices live.

    Drawing augmentation from the global RNG would tie it to which process loads a sample and to when
    (Accelerate prefetches one batch ahead), so a resumed run or another world size would crop differently.
    A counter-based hash (the splitmix64 finaliser, with masked shifts since torch's >> is arithmetic) makes
    the crops and flips of an epoch identical however the run is split or interrupted.
    """
    offset = ((seed * 1_000_003 + epoch + 1) * 0x5851F42D4C957F2D) % 2**64
    keys = indices.long() * 0x2545F4914F6CDD1D + (offset - 2**64 if offset >= 2**63 else offset)
    for multiplier in (0x3F58476D1CE4E5B9, 0x14057B7EF767814F):
        keys = (keys ^ ((keys >> 31) & _LOW_33_BITS)) * multiplier
    return (keys ^ ((keys >> 31) & _LOW_33_BITS)) & ((1 << 62) - 1)


class KeyedSamples(Dataset):
    """A dataset served sample by sample, every random draw of its transforms a function of (seed, epoch, index).

    Before each sample, torch's CPU generator, Python's `random` and numpy's global generator are seeded from
    sample_keys(index, epoch, seed); afterwards the caller's states are put back. So a sample is augmented alike at
    any world size, with any number of DataLoader workers and after a resume, and the training process's own streams
    (dropout draws from them; with num_workers=0 the transforms run there) do not move. Not reseeded: a
    numpy.random.Generator or random.Random that the dataset makes itself. The index is the one the DataLoader
    passes, the same whichever process loads the sample.
    """

    def __init__(self, samples: Dataset) -> None:
        self.samples = samples
        # [seed, epoch] in shared memory: persistent DataLoader workers keep the copy of this object made when they
        # started, and must see every later epoch. Evaluation loaders keep epoch 0 of seed 0.
        self.seed_and_epoch = torch.zeros(2, dtype=torch.long).share_memory_()

    def key_epoch(self, epoch: int, seed: int) -> None:
        """Called by start_epoch, before the epoch's iterator fetches anything. Not named set_epoch: Accelerate
        calls a dataset's set_epoch with its own count of iterations, evaluation loaders' too."""
        self.seed_and_epoch.copy_(torch.tensor([seed, epoch]))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list:
        # A batch at a time (the DataLoader's fetcher calls this), so the states are saved and put back once a batch;
        # each sample still comes from the dataset's own __getitem__ and its own key, even where the dataset could
        # fetch a whole batch (a Hugging Face datasets.Dataset).
        seed, epoch = self.seed_and_epoch.tolist()
        keys = sample_keys(torch.as_tensor(indices), epoch, seed).tolist()
        saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
        try:
            samples = []
            for index, key in zip(indices, keys):
                torch.default_generator.manual_seed(key)  # the CPU's alone: torch.manual_seed would reseed CUDA's too
                random.seed(key)
                # Its high 32 bits: torch's MT19937 takes the low 32, and numpy's with the same seed would draw the same
                np.random.seed(key >> 30)
                samples.append(self.samples[index])
            return samples
        finally:
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])
