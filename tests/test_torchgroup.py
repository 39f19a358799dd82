"""TorchGroup: a torch ProcessGroup that stays the same object while the group under it is
replaced (docs/design.md §3). Two ranks as threads of this process over real gloo groups."""
import os
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from tm_slurm.comm.groups import build_group
from tm_slurm.comm.handles import GroupTable
from tm_slurm.comm.torchgroup import TorchGroup, serve_locally
from tm_slurm.messages import GroupBuild

CPU = torch.device("cpu")


def _two_ranks(fn, tmp: Path, timeout=120):
    """fn(rank, store) in two real processes (DDP runs its backward on threads of its own: one
    process a rank, as in a job); returns their results."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=_rank_main, args=(fn, r, store.port, tmp)) for r in range(2)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(timeout)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in ps] == [0, 0], [(tmp / f"err{r}").read_text() for r in range(2)
                                                if (tmp / f"err{r}").exists()]
    return {r: torch.load(tmp / f"out{r}.pt") for r in range(2)}


def _rank_main(fn, r, port, tmp):
    # ends with os._exit, as a worker does: interpreter teardown of gloo groups (one with a
    # peer gone) can abort the process ("Resource deadlock avoided")
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        torch.save(fn(r, store), tmp / f"out{r}.pt")
    except BaseException:
        (tmp / f"err{r}").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _group(store, prefix, r, timeout=30.0):
    return build_group(store, GroupBuild("dp/pp0.tp0", (0, 1), prefix), r, device=CPU,
                       backend="gloo", timeout=timeout, iface="127.0.0.1")


def _ddp_rank(r, store):
    errors = []
    table = GroupTable(lambda gid, e: errors.append(gid), op_timeout=30)
    table.swap({"dp/pp0.tp0": _group(store, "a", r)})
    tg = TorchGroup("dp", 2)
    tg.bind(table, "dp/pp0.tp0", (0, 1), r)
    torch.manual_seed(r)                  # different weights: DDP broadcasts rank 0's
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), process_group=tg)
    x = torch.ones(3, 8) * (r + 1)
    grads = []
    for swap in (False, True):
        if swap:                          # a new instance under the same object
            old = table.swap({"dp/pp0.tp0": _group(store, "b", r)})
            assert len(old) == 1
        for _ in range(2):
            model.zero_grad()
            model(x).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert model.process_group is tg and not table.broken and not errors
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t, group=tg)          # the Python c10d path takes it too
    weights = [p.detach().clone() for p in model.parameters()]
    # rank 1 stops taking part: rank 0's next collective fails, its backward still ends
    if r == 0:
        table.swap({"dp/pp0.tp0": _group(store, "c", r, timeout=1.0)})
        model.zero_grad()
        model(x).sum().backward()
        assert table.broken == {"dp/pp0.tp0"} and errors == ["dp/pp0.tp0"]
    else:
        _group(store, "c", r, timeout=1.0)
    return grads, weights, t.item()


def test_ddp_keeps_its_group_object_through_a_swap_and_a_collective_failure_fails_through(tmp_path):
    out = _two_ranks(_ddp_rank, tmp_path)
    (g0, w0, t0), (g1, w1, t1) = out[0], out[1]
    assert all(torch.equal(a, b) for a, b in zip(g0[0], g0[1]))   # the same grads after the swap
    assert all(torch.equal(a, b) for a, b in zip(g0[0], g1[0]))   # and on both ranks (averaged)
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))         # DDP synced rank 0's weights
    assert t0 == t1 == 3.0


def test_a_group_of_one_and_a_sandbox_serve_collectives_locally():
    x = torch.arange(4.0)
    out = [[torch.zeros(4), torch.zeros(4)]]
    serve_locally("allgather", (out, [x]), 2)
    assert all(torch.equal(o, x) for o in out[0])
    flat = torch.zeros(8)
    serve_locally("_allgather_base", (flat, x), 2)
    assert torch.equal(flat, torch.cat([x, x]))
    shard = torch.zeros(2)
    serve_locally("_reduce_scatter_base", (shard, x), 2)
    assert torch.equal(shard, x[:2])
    y = x.clone()
    serve_locally("allreduce", ([y],), 2)
    assert torch.equal(y, x)
    tg = TorchGroup("dp", 1)
    tg.bind(GroupTable(lambda *a: None, 1.0), None, (0,), 0)
    t = torch.ones(2)
    dist.all_reduce(t, group=tg)
    assert torch.equal(t, torch.ones(2)) and tg.rank() == 0 and tg.size() == 1


def test_an_unbound_group_says_when_it_can_be_used():
    with pytest.raises(RuntimeError, match="after tm_slurm.init"):
        TorchGroup("dp", 2).allreduce([torch.ones(1)])
