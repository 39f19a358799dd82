"""A rank's random numbers, keyed by (seed, step, rank) at each step's start: whoever runs a step (the
rank that began it, the same rank repeating a discarded step, a joiner) draws the same numbers.

Seeded: torch's CPU generator and, on a CUDA job, every GPU's; Python's `random`; numpy's global
generator where the script has imported numpy; and each generator the script asked for with
`job.generator(name)`. What stays the script's job: a generator it makes itself
(`torch.Generator()`, `numpy.random.default_rng()`), which no runtime can see. Randomness in
DataLoader worker processes is `job.sampler`'s: it reseeds a worker for each batch from the
batch's place in the epoch (tm_slurm/data.py).

About 10 us a step here (a seed each; `data.seed_globals`, which DataLoader workers use too).
"""
from __future__ import annotations

import zlib

import torch

from ..data import key, seed_globals


class Seeds:
    """The generators a rank reseeds at each step's start."""

    def __init__(self, device: torch.device, seed: int):
        self.device, self.seed = device, seed
        self.named: dict[str, tuple[int, torch.Generator]] = {}
        self._now: int | None = None        # this step's seed, for a generator made during it

    def generator(self, name: str, device: torch.device | str | None = None) -> torch.Generator:
        """The script's own generator `name` (one per name and rank), reseeded at every step from
        (seed, step, rank, name), so a repeated step or a joiner draws what the original did."""
        if name in self.named:
            return self.named[name][1]
        g = torch.Generator(device=device if device is not None else self.device)
        self.named[name] = (zlib.crc32(name.encode()), g)
        if self._now is not None:
            g.manual_seed(key(self._now, self.named[name][0]))
        return g

    def step(self, step: int, rank: int) -> None:
        s = self._now = key(self.seed, step, rank)
        seed_globals(s)
        if self.device.type == "cuda":
            torch.cuda.manual_seed_all(s)   # direct once CUDA is initialised (the worker sets its device)
        for tag, g in self.named.values():
            g.manual_seed(key(s, tag))
