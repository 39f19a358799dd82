import pytest
import torch

from tm_slurm.comm.groups import pick_backend


def test_backend_is_chosen_by_device():
    assert pick_backend("auto", torch.device("cpu")) == "gloo"
    assert pick_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert pick_backend("gloo", torch.device("cuda", 0)) == "gloo"
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        pick_backend("nccl", torch.device("cpu"))


def test_a_build_waiting_for_a_member_that_never_comes_is_abandoned_when_its_plan_is():
    """A second failure during a recovery: the dead member never arrives; the rank must be free
    for the next plan at once, not after the store timeout."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from tm_slurm.comm.groups import BuildAbandoned, build_group
    from tm_slurm.messages import GroupBuild

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    cancelled = threading.Event()
    threading.Timer(0.3, cancelled.set).start()
    t0 = time.monotonic()
    with pytest.raises(BuildAbandoned):
        build_group(store, GroupBuild("dp/pp0.tp0", (0, 1), "p7/dp/pp0.tp0"), 0, device=torch.device("cpu"),
                    backend="gloo", timeout=60, iface="127.0.0.1", abandon=cancelled.is_set)
    assert time.monotonic() - t0 < 5


def test_nccl_communicators_are_aborted_together_in_one_nccl_group():
    """A fake NCCL backend records the calls: one group start, every abort (one that fails does
    not stop the others), one group end; gloo groups are only dropped."""
    from tm_slurm.comm.groups import Group, abort_together

    calls = []

    class FakeNccl:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def _group_start(self):
            calls.append("start")

        def _group_end(self):
            calls.append("end")

        def abort(self):
            calls.append(f"abort {self.name}")
            if self.fail:
                raise RuntimeError("already aborted")

    gs = [Group("dp/a", "p", (0, 1), 0, None, FakeNccl("a", fail=True), "nccl"),
          Group("tp/b", "p", (0, 1), 0, None, object(), "gloo"),
          Group("dp/c", "p", (0, 1), 0, None, FakeNccl("c"), "nccl")]
    abort_together(gs)
    assert calls == ["start", "abort a", "abort c", "end"]
    calls.clear()
    abort_together(gs[1:2])
    assert calls == []
