import pickle
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from tm_slurm.data import StepSampler, key


# ---- StepSampler: the data order, and what a dataset draws, as functions of the step


class Augmented(Dataset):
    """A dataset whose __getitem__ draws from the three global generators, as augmentations do."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        noise = [random.random(), float(np.random.rand()), float(torch.rand(()))]
        return torch.tensor([float(i)] + noise, dtype=torch.float64)


class At:
    """A rank's live position, as the runtime gives it."""

    def __init__(self, step: int = 0, rank: int = 0, size: int = 1):
        self.step, self.rank, self.size = step, rank, size

    def __call__(self) -> tuple[int, int, int]:
        return self.step, self.rank, self.size


def epoch_reads(n, bs, m, size, epoch=0, **kw) -> list[list[int]]:
    """Every (step, rank) read of one epoch, in order."""
    at = At(size=size)
    s = StepSampler(n, bs, at, micro_batches=m, **kw)
    spe = s.steps_per_epoch(size)
    reads = []
    for at.step in range(epoch * spe, (epoch + 1) * spe):
        for at.rank in range(size):
            reads.append([int(i) for i in s])
    return reads


def test_the_order_is_a_function_of_seed_step_rank_and_size():
    a, b = At(5, 1, 3), At(0, 0, 1)
    s1 = StepSampler(100, 4, a, micro_batches=2, seed=3)
    s2 = StepSampler(Augmented(100), 4, b, micro_batches=2, seed=3)    # a fresh one, elsewhere
    for step, rank, size in [(5, 1, 3), (0, 0, 3), (5, 1, 3), (40, 2, 3), (7, 1, 2)]:
        a.step, a.rank, a.size = step, rank, size
        b.step, b.rank, b.size = step, rank, size
        got = list(s1)
        assert len(got) == 8 and got == list(s2) == list(s1)
    assert list(StepSampler(100, 4, At(5, 1, 3), micro_batches=2, seed=4)) != got
    in_order = StepSampler(100, 4, At(5, 1, 3), micro_batches=2, shuffle=False)
    assert list(in_order) == list(range(32, 40))                    # epoch 1's second step, rank 1


def test_an_epoch_permutes_once():
    at = At(0, 0, 2)
    s = StepSampler(100, 4, at)                                     # 12 steps an epoch
    list(s)
    perm = s._perm[1]
    for at.step in range(1, 12):
        list(s)
    assert s._perm[1] is perm
    at.step = 12
    list(s)
    assert s._perm[0] == 1 and not torch.equal(s._perm[1], perm)


@pytest.mark.parametrize("shuffle", [True, False])
def test_an_epoch_reads_each_sample_once_with_drop_last(shuffle):
    reads = epoch_reads(50, 4, 2, 3, shuffle=shuffle)              # 2 steps of 24: 2 samples sit out
    flat = [i for r in reads for i in r]
    assert len(reads) == 6 and all(len(r) == 8 for r in reads)
    assert len(flat) == len(set(flat)) == 48 and set(flat) <= set(range(50))
    nxt = [i for r in epoch_reads(50, 4, 2, 3, epoch=1, shuffle=shuffle) for i in r]
    assert (nxt != flat) == shuffle                                 # a permutation per epoch


def test_without_drop_last_the_last_global_batch_wraps_around():
    reads = epoch_reads(50, 4, 2, 3, drop_last=False)              # 3 steps of 24: 22 padded
    flat = [i for r in reads for i in r]
    assert len(flat) == 72 and set(flat) == set(range(50))
    assert flat[50:] == flat[:22]                                   # as DistributedSampler pads
    assert sorted(flat[:50]) == list(range(50))


def test_micro_batches_are_the_loaders_batches():
    at = At(3, 1, 2)
    s = StepSampler(Augmented(64), 4, at, micro_batches=3)
    loader = DataLoader(Augmented(64), batch_size=4, sampler=s)
    batches = [b[:, 0].long().tolist() for b in loader]
    assert len(loader) == len(batches) == 3
    assert [i for b in batches for i in b] == list(s)


def test_a_resize_reads_the_new_layout_from_position():
    at = At(1, 0, 3)
    s = StepSampler(100, 4, at, micro_batches=2)
    assert s.steps_per_epoch(3) == 4
    before = list(s)
    at.size = 2                                                     # a shrink: 6 steps an epoch
    shares = []
    for at.rank in range(2):
        shares += list(s)
    assert shares != before and len(set(shares)) == 16
    assert shares == list(StepSampler(100, 16, At(1, 0, 1)))        # the step's global batch, in 2 shares


def read(steps, workers: int, persistent: bool = False, bs: int = 3, rank: int = 1, **kw):
    """The batches a rank reads at `steps`, with the main process seeded at each step's start as
    the runtime does (so that num_workers=0 draws the rank's numbers)."""
    at, ds = At(0, rank, 2), Augmented(40)
    loader = DataLoader(ds, batch_size=bs, sampler=StepSampler(ds, 3, at, micro_batches=2, seed=11),
                        num_workers=workers, persistent_workers=persistent, **kw)
    out = []
    for at.step in steps:
        s = key(11, at.step, rank)
        torch.manual_seed(s), random.seed(s), np.random.seed(s & 0xFFFFFFFF)
        out.append([b for b in loader])
    return out


def same(a, b) -> bool:
    """Bitwise equal (nested lists of tensors)."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_a_repeated_step_and_a_joiner_read_the_same_bits(workers, persistent):
    original = read([0, 1, 2, 3, 3, 4], workers, persistent)        # step 3 discarded and repeated
    joiner = read([3, 4], workers)                                  # fresh sampler, loader, workers
    assert same(original[3], original[4]) and same(original[3], joiner[0]) and same(original[5], joiner[1])
    assert len(original[3]) == 2 and len(original[3][0]) == 3
    assert not torch.equal(original[3][0][:, 1:], original[3][1][:, 1:])   # the draws are not constant


def test_in_workers_a_batch_draws_the_same_whoever_reads_it():
    # one worker or two, with a history or fresh, forked or spawned: what a batch draws depends
    # on the batch only (with num_workers=0 it is the rank's numbers instead)
    want = read([2, 5], workers=2)
    assert same(want, read([0, 2, 5], workers=1, persistent=True)[1:])
    assert same(want, read([2, 5], workers=1, persistent=True, multiprocessing_context="spawn"))
    # a loader batch smaller than the sampler's: each is seeded by its own first sample
    assert same(read([2], workers=2, bs=1), read([2], workers=1, persistent=True, bs=1))


class Plain:
    """The same indices as plain ints."""

    def __init__(self, sampler: StepSampler):
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        return iter([int(i) for i in self.sampler])


def test_a_worker_without_keyed_indices_would_draw_from_its_history():
    # what the tests above guard against: torch seeds a worker once, at its start
    ds = Augmented(40)
    plain = DataLoader(ds, batch_size=3, sampler=Plain(StepSampler(ds, 3, At(), micro_batches=2)),
                       num_workers=1, persistent_workers=True)
    first, again = [b for b in plain], [b for b in plain]
    assert torch.equal(first[0][:, 0], again[0][:, 0]) and not same(first, again)


def test_an_index_is_a_plain_int_outside_a_worker():
    idx = list(StepSampler(40, 3, At(2, 1, 2), micro_batches=2))
    state = torch.get_rng_state(), random.getstate()
    back = pickle.loads(pickle.dumps(idx))
    assert back == idx and all(type(i) is int for i in back)
    assert torch.equal(state[0], torch.get_rng_state()) and state[1] == random.getstate()
    assert [4, 5, 6][idx[0] % 3] == [4, 5, 6][int(idx[0]) % 3]


def test_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match="do not fill one global batch"):
        list(StepSampler(30, 4, At(0, 0, 4), micro_batches=2))      # 32 a step
    with pytest.raises(ValueError, match="do not fill one global batch"):
        list(StepSampler(30, 4, At(0, 0, 4), micro_batches=2, drop_last=False))
    with pytest.raises(ValueError, match="at least 1"):
        StepSampler(30, 0, At())
    with pytest.raises(ValueError, match="at least 1"):
        StepSampler(30, 4, At(), micro_batches=0)
    with pytest.raises(ValueError, match="dp rank 2 of 2"):
        list(StepSampler(30, 4, At(0, 2, 2)))
    with pytest.raises(ValueError, match="step -1"):
        list(StepSampler(30, 4, At(-1, 0, 2)))
    with pytest.raises(TypeError, match="map-style"):
        StepSampler(Stream(), 2, At())


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))
