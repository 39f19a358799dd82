import pytest
import torch

from tm_slurm.comm.groups import pick_backend


def test_backend_is_chosen_by_device():
    assert pick_backend("auto", torch.device("cpu")) == "gloo"
    assert pick_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert pick_backend("gloo", torch.device("cuda", 0)) == "gloo"
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        pick_backend("nccl", torch.device("cpu"))
