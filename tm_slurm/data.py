"""Deterministic data order keyed by (step, dp rank).

A batch is a pure function of (seed, step, dp rank, dp size): whoever holds a rank at a step, a
joiner, a recovered rank or the original, reads exactly the same samples, so the data position
moves with the state without being transferred.
"""
from __future__ import annotations

import hashlib

import torch


def key(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes and Python versions)."""
    h = hashlib.blake2b(",".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def seed_step(device: torch.device, *parts: int) -> None:
    """Seed a rank's random numbers for one step from `parts` (seed, step, rank): the CPU's, and
    the GPUs' on a CUDA job. Not `torch.manual_seed`: on a machine where CUDA is not
    initialised (a CPU job) it queues each seed for later with a formatted stack trace, 0.1 to
    0.5 ms a step depending on the caller's stack depth (measured: README "Steady-state
    overhead")."""
    s = key(*parts)
    torch.default_generator.manual_seed(s)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(s)   # direct once CUDA is initialised (the worker sets its device)


class KeyedSampler:
    """Indices of a map-style dataset: one seeded permutation per epoch, each step takes the next
    `batch_size * dp_size` of it, and dp rank d takes its slice."""

    def __init__(self, dataset_len: int, batch_size: int, dp_size: int, seed: int = 0):
        if batch_size * dp_size > dataset_len:
            raise ValueError(f"dataset of {dataset_len} is smaller than one global batch "
                             f"({batch_size} x {dp_size})")
        self.n, self.bs, self.dp, self.seed = dataset_len, batch_size, dp_size, seed
        self.steps_per_epoch = dataset_len // (batch_size * dp_size)
        self._perm: tuple[int, torch.Tensor] | None = None

    def indices(self, step: int, dp_rank: int) -> list[int]:
        epoch, i = divmod(step, self.steps_per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(key(self.seed, epoch))
            self._perm = (epoch, torch.randperm(self.n, generator=g))
        start = i * self.bs * self.dp + dp_rank * self.bs
        return self._perm[1][start:start + self.bs].tolist()


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
