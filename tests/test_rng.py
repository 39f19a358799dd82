"""A rank's random numbers at a step are a function of (seed, step, rank): torch's, Python's,
numpy's and the script's named generators (tm_slurm/worker/rng.py)."""
import random

import numpy as np
import torch

from tm_slurm.data import key
from tm_slurm.worker.rng import Seeds


def _draw(seeds: Seeds, step: int, rank: int):
    seeds.step(step, rank)
    return (torch.rand(3), random.random(), np.random.rand(), torch.rand(2, generator=seeds.generator("aug")))


def test_every_global_generator_and_a_named_one_draw_the_same_at_a_step_whoever_draws():
    a, b = Seeds(torch.device("cpu"), 7), Seeds(torch.device("cpu"), 7)
    first = _draw(a, 41, 3)
    _draw(a, 42, 3)                       # other steps in between: a repeated step starts over
    torch.rand(100), random.random(), np.random.rand()
    for got in (_draw(a, 41, 3), _draw(b, 41, 3)):     # the same rank again, a joiner's process
        assert torch.equal(got[0], first[0]) and got[1:3] == first[1:3] and torch.equal(got[3], first[3])
    other = _draw(a, 41, 2)
    assert not torch.equal(other[0], first[0]) and other[1] != first[1] and not torch.equal(other[3], first[3])
    assert a.generator("aug") is a.generator("aug") and a.generator("aug") is not a.generator("noise")


def test_the_cpu_generator_draws_what_torch_manual_seed_draws():
    # the runtime's seeds keep every earlier run's numbers (bit-identical results), without
    # torch.manual_seed's per-call stack trace for a CUDA that a CPU job never initialises
    torch.manual_seed(key(7, 41, 3))
    want = torch.rand(5), torch.randn(2, 2)
    Seeds(torch.device("cpu"), 7).step(41, 3)
    got = torch.rand(5), torch.randn(2, 2)
    assert all(torch.equal(x, y) for x, y in zip(want, got))
