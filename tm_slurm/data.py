"""Deterministic data keyed by (step, dp rank).

A batch is a pure function of (seed, step, dp rank, dp size): whoever holds a rank at a step, a
joiner, a recovered rank or the original, reads exactly the same samples, so the data position
moves with the state without being transferred; and what a dataset draws for a batch in a
DataLoader worker is a function of the batch (`StepSampler`).
"""
from __future__ import annotations

import hashlib
import random
import sys
from typing import Callable, Iterator, Sized

import torch
from torch.utils.data import IterableDataset, Sampler, get_worker_info


def key(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes and Python versions)."""
    h = hashlib.blake2b(",".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def seed_globals(s: int) -> None:
    """Seed the generators a script draws from without naming one: torch's CPU generator, Python's
    `random`, and numpy's global one where the script has imported numpy (never imported here for
    one that does not). Not `torch.manual_seed`: on a machine where CUDA is not initialised (a CPU
    job) it queues each seed for later with a formatted stack trace, 0.1 to 0.5 ms a call."""
    torch.default_generator.manual_seed(s)
    random.seed(s)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(s & 0xFFFFFFFF)


class StepSampler(Sampler[int]):
    """In place of DistributedSampler: `DataLoader(ds, batch_size=batch_size, sampler=StepSampler(
    ds, batch_size, position, micro_batches))`, iterated once inside a step, gives that step's
    `micro_batches` batches for the rank, read from `position()` = (step, dp rank, dp size) when
    the loader is iterated: a standby learns its rank when promoted, a shrink changes the size.

    The order is a pure function of (seed, step, dp rank, dp size), so whoever runs a step (the
    rank that began it, the same rank repeating a discarded step, a joiner) reads the same samples
    and the data position needs no state of its own. An epoch is `steps_per_epoch` global batches
    (`batch_size * micro_batches * dp_size` samples each) of one seeded permutation (the dataset's
    order without `shuffle`); rank d reads the d-th share of its step's global batch, micro-batch
    k the k-th part of that share. With `drop_last` the samples that do not fill a global batch
    sit the epoch out; without it the epoch's last global batch wraps around to its first samples,
    as DistributedSampler pads, so every sample is read each epoch. A step's epoch is counted at
    the current dp size: after a resize the order goes on from the epoch the step falls in.

    The dataset's own random numbers (an augmentation's `random`, `numpy.random`, `torch.rand`):
    in DataLoader workers they are reseeded with each loader batch from the epoch and the
    position of the batch's first sample (`_Index`), whatever worker, fresh or persistent, reads
    it; with num_workers=0 they are the rank's, which the runtime seeds at each step's start.
    A generator the dataset holds itself (`numpy.random.default_rng()`) stays its own."""

    def __init__(self, dataset: Sized | int, batch_size: int, position: Callable[[], tuple[int, int, int]],
                 micro_batches: int = 1, shuffle: bool = True, drop_last: bool = True, seed: int = 0):
        super().__init__()
        if isinstance(dataset, IterableDataset):
            raise TypeError("StepSampler orders a map-style dataset (__getitem__ and __len__): an "
                            "IterableDataset yields its samples in its own order")
        if batch_size < 1 or micro_batches < 1:
            raise ValueError(f"batch_size ({batch_size}) and micro_batches ({micro_batches}) are at least 1")
        self.n = dataset if isinstance(dataset, int) else len(dataset)
        self.batch_size, self.micro_batches, self.position = batch_size, micro_batches, position
        self.shuffle, self.drop_last, self.seed = shuffle, drop_last, seed
        self._perm: tuple[int, torch.Tensor] | None = None    # the current epoch's

    def __len__(self) -> int:
        return self.batch_size * self.micro_batches

    def steps_per_epoch(self, dp_size: int) -> int:
        """Steps that read the dataset once at `dp_size` (the script's step count for N epochs)."""
        whole, part = divmod(self.n, len(self) * dp_size)
        if whole == 0:
            raise ValueError(f"the dataset's {self.n} samples do not fill one global batch "
                             f"({self.batch_size} x {self.micro_batches} micro-batches x {dp_size} DP ranks)")
        return whole + (1 if part and not self.drop_last else 0)

    def __iter__(self) -> Iterator[int]:
        step, rank, size = self.position()
        if step < 0 or not 0 <= rank < size:
            raise ValueError(f"position() gave step {step}, dp rank {rank} of {size}")
        epoch, i = divmod(step, self.steps_per_epoch(size))
        start = (i * size + rank) * len(self)
        pos = torch.arange(start, start + len(self))
        order = self._epoch(epoch)[pos % self.n] if self.shuffle else pos % self.n
        seeds = _EpochSeed(key(self.seed, epoch))
        return iter([_Index(v, p, seeds) for v, p in zip(order.tolist(), range(start, start + len(self)))])

    def _epoch(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(key(self.seed, epoch))
            self._perm = (epoch, torch.randperm(self.n, generator=g))
        return self._perm[1]


class _EpochSeed:
    """The seed of an epoch's batches in workers, one object shared by the indices of an
    iteration: pickle sends a shared object once per message, so a DataLoader worker unpickles
    a new one with each batch it is sent, and so tells where a batch begins."""

    def __init__(self, seed: int):
        self.seed = seed


class _Index(int):
    """A sample index as StepSampler yields it: the int itself to the dataset in the main process
    (num_workers=0), and on its way to a DataLoader worker a call to `_arrive`, which reseeds the
    worker as the batch's first index arrives. What the worker draws for a batch is then a
    function of the batch (seed, epoch, its first sample's position in the epoch), never of the
    worker's history: a persistent worker is not reseeded by torch between iterations, and a
    joiner's or a fresh iterator's workers start from other seeds (torch draws them from the main
    process's generator when the loader is iterated). Each index carries the mark, whatever the
    loader's batch size, as a worker cannot tell where a batch begins otherwise: about 2 us an
    index to make and pickle in the main process, against the 0.05 of an int."""

    def __new__(cls, value: int, pos: int, seeds: _EpochSeed):
        self = super().__new__(cls, value)
        self.pos, self.seeds = pos, seeds
        return self

    def __reduce__(self):
        return _arrive, (int(self), self.pos, self.seeds)


_arrived: _EpochSeed | None = None   # the batch's, in a worker; held, so no later one takes its id


def _arrive(value: int, pos: int, seeds: _EpochSeed) -> int:
    """An index unpickled: in a DataLoader worker, the first of a batch reseeds `random`, numpy's
    global generator (where the dataset imported numpy) and torch's CPU generator, once a batch
    (a seed of all three costs about 17 us here). Elsewhere (a script that pickles what its
    __getitem__ returned) it is just the int."""
    global _arrived
    if seeds is not _arrived and get_worker_info() is not None:
        _arrived = seeds
        seed_globals(key(seeds.seed, pos))
    return value


class SyntheticTokens:
    """Generated token batches (a learnable pattern, not noise, so the loss goes down)."""

    def __init__(self, vocab: int, seq_len: int, batch_size: int, seed: int = 0):
        self.vocab, self.seq, self.bs, self.seed = vocab, seq_len, batch_size, seed

    def batch(self, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(key(self.seed, step, dp_rank))
        start = torch.randint(0, self.vocab, (self.bs, 1), generator=g)
        stride = torch.randint(1, 7, (self.bs, 1), generator=g)
        pos = torch.arange(self.seq + 1).unsqueeze(0)
        seq = (start + stride * pos) % self.vocab
        noise = torch.rand(seq.shape, generator=g) < 0.05
        seq = torch.where(noise, torch.randint(0, self.vocab, seq.shape, generator=g), seq)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
