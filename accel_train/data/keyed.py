"""Keyed randomness: every random draw of a sample's augmentation a function of (seed, epoch, its index), so a
sample is augmented alike at any world size, with any number of DataLoader workers and after a resume."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import Dataset

_LOW_33_BITS = (1 << 33) - 1
EVERY_GENERATOR = frozenset({"torch", "random", "numpy"})  # what a transform may draw from: all, unless told
_STATES = {"torch": (torch.get_rng_state, torch.set_rng_state), "random": (random.getstate, random.setstate),
           "numpy": (np.random.get_state, np.random.set_state)}
MT_WORDS = 624  # the state of a Mersenne Twister (MT19937): torch's CPU generator and numpy's global one


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

    def __init__(self, samples: Dataset, draws_from: frozenset[str] = EVERY_GENERATOR,
                 keys_with_samples: bool = False, indices_with_samples: bool = False) -> None:
        self.samples = samples
        # Each sample's key after its fields, for a dataset whose augmentation runs where the batch is, by its key
        self.keys_with_samples = keys_with_samples
        # Each sample's index last, for dropout keyed by sample (training/dropout.py)
        self.indices_with_samples = indices_with_samples
        # The generators seeded: where the dataset says its transforms draw from fewer (ours draw from torch's
        # alone, and nothing when they do not augment), the others cost nothing (numpy's is half the seeding time)
        self.draws_from = frozenset(draws_from)
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
        samples = self._samples(indices)
        return [with_index(sample, index) for sample, index in zip(samples, indices)] if self.indices_with_samples \
            else samples

    def _samples(self, indices: list[int]) -> list:
        # A batch at a time (the DataLoader's fetcher calls this), so the states are saved and put back once a batch.
        # Where a transform draws, each sample comes from the dataset's own __getitem__ just after its key seeds the
        # generators, even where the dataset could fetch a whole batch (a Hugging Face datasets.Dataset); where none
        # draws, from the dataset's __getitems__ where it has one (batch_of).
        if self.keys_with_samples:
            seed, epoch = self.seed_and_epoch.tolist()
            keys = sample_keys(torch.as_tensor(indices), epoch, seed)
            return [(*sample, key) for sample, key in zip(batch_of(self.samples, indices), keys)]
        if not self.draws_from:  # nothing to seed: a sample's seeding costs more than reading a small image
            return batch_of(self.samples, indices)
        seed, epoch = self.seed_and_epoch.tolist()
        keys = sample_keys(torch.as_tensor(indices), epoch, seed).tolist()
        saved = {name: _STATES[name][0]() for name in self.draws_from}
        try:
            samples = []
            for index, key in zip(indices, keys):
                seed_generators(key, self.draws_from)
                samples.append(self.samples[index])
            return samples
        finally:
            for name, state in saved.items():
                _STATES[name][1](state)


def batch_of(samples: Dataset, indices: list[int]) -> list:
    """The samples at `indices`, through the dataset's own `__getitems__` where it has one (shards: one search for the
    batch's places; torch's Subset passes it on); only where no transform draws at random, since a sample's draws are
    seeded just before it is made."""
    fetch = getattr(samples, "__getitems__", None)
    return list(fetch(indices)) if fetch is not None else [samples[index] for index in indices]


SAMPLE_INDEX = "accel_train.sample_index"  # a mapping sample's entry for its index (tuples carry it last)


def with_index(sample, index: int):
    """A sample with its index in the dataset beside its own fields: last in a tuple, under SAMPLE_INDEX in a
    mapping."""
    if isinstance(sample, dict):
        return {**sample, SAMPLE_INDEX: index}
    return (*sample, index) if isinstance(sample, (tuple, list)) else (sample, index)


def without_index(batch):
    """(the batch as the dataset made it, its samples' indices): the inverse of with_index on a collated batch."""
    if isinstance(batch, dict):
        return {key: value for key, value in batch.items() if key != SAMPLE_INDEX}, batch[SAMPLE_INDEX]
    *fields, indices = batch
    return (type(batch)(fields) if isinstance(batch, tuple) else list(fields)), indices


def seed_generators(key: int, generators: frozenset[str] = EVERY_GENERATOR) -> None:
    """torch's CPU generator, Python's `random` and numpy's global generator (or those of them named in
    `generators`), each from every bit of `key`.

    torch's manual_seed and numpy's legacy seed keep 32 bits of a seed, so keys that share those would draw alike
    (about 190 pairs of samples an ImageNet epoch): both Mersenne Twisters' states are filled from all of `key`
    instead (splitmix64 of key and a counter, as sample_keys mixes), torch's and numpy's with different words.
    """
    if "random" in generators:
        random.seed(key)
    words = _state_words(key)
    if "numpy" in generators:
        np.random.set_state(("MT19937", words[MT_WORDS:], MT_WORDS))
    if "torch" not in generators:
        return
    if _TORCH_STATE is None:  # a torch whose generator state is laid out otherwise: its own 32-bit seeding
        torch.default_generator.manual_seed(key)
        return
    state = bytearray(_TORCH_STATE)
    state[:8] = (key & (2**64 - 1)).to_bytes(8, "little")  # the_initial_seed (torch.initial_seed's answer)
    state[_WORDS_AT:_WORDS_AT + 8 * MT_WORDS] = words[:MT_WORDS].astype("<u8").tobytes()
    torch.default_generator.set_state(torch.frombuffer(state, dtype=torch.uint8))


def _state_words(key: int) -> np.ndarray:
    """2 x 624 32-bit words, each a function of every bit of `key`: splitmix64 of (key, 1..624), split in halves."""
    mixed = np.arange(1, MT_WORDS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(key)
    for shift, multiplier in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        mixed = (mixed ^ (mixed >> np.uint64(shift))) * np.uint64(multiplier)
    return (mixed ^ (mixed >> np.uint64(31))).view(np.uint32)


def _torch_state_template() -> bytes | None:
    """torch's CPU generator state just after seeding: 8 bytes of seed, `left` and `seeded` (4 each), `next`
    (8), then the 624 words as 8 bytes each, then normal-sampling caches. Checked against numpy's legacy seeding,
    which fills the same words; None where the layout differs."""
    generator = torch.Generator()
    generator.manual_seed(5489)
    state = generator.get_state().numpy().tobytes()
    words = np.frombuffer(state, dtype="<u8", count=MT_WORDS, offset=_WORDS_AT) if len(state) >= 5040 else None
    expected = np.random.RandomState(5489).get_state()[1]
    return state if words is not None and np.array_equal(words, expected) else None


_WORDS_AT = 24
_TORCH_STATE = _torch_state_template()
