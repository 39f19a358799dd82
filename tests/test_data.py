import torch

from tm_slurm.data import key, seed_step


def test_seed_step_draws_what_torch_manual_seed_draws_on_cpu():
    # the step's random numbers stay those of every earlier run (bit-identical results), without
    # torch.manual_seed's per-call stack trace for a CUDA that a CPU job never initialises
    torch.manual_seed(key(7, 41, 3))
    want = torch.rand(5), torch.randn(2, 2)
    seed_step(torch.device("cpu"), 7, 41, 3)
    got = torch.rand(5), torch.randn(2, 2)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    seed_step(torch.device("cpu"), 7, 42, 3)
    assert not torch.equal(torch.rand(5), want[0])
