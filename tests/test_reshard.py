"""Sharded checkpoints (worker/checkpoint.py) across layouts, with real processes and FSDP2: a
checkpoint written by one replica of an HSDP job (2 replicas x 2 shards, or 2 shards x TP 2) is
read by jobs of other shapes (the survivors of a shrink: 1 replica x 2 shards, FSDP over 3, one
rank holding everything) and every rank ends with the same full tensors."""
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tm_slurm.config import Layout
from tm_slurm.topology import Topology
from tm_slurm import checkpoints
from tm_slurm.worker import checkpoint as ck
from tm_slurm.worker.state import TrainState


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # 10 and 6 rows do not divide by 3 or 4: FSDP2's uneven (padded) shards
        self.up = torch.nn.Linear(6, 10)
        self.down = torch.nn.Linear(10, 6)
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) * self.scale[0]


def _state(layout: Layout, mesh, seed: int) -> TrainState:
    torch.manual_seed(seed)
    m = Net()
    if layout.tp > 1:
        parallelize_module(m, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    dims = [d for d in ("dp_rep", "dp_shard", "dp") if mesh is not None and d in mesh.mesh_dim_names]
    if dims:
        fully_shard(m, mesh=mesh[tuple(dims)] if len(dims) > 1 else mesh[dims[0]])
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    return TrainState(m, opt, sched, {"seen": 0})


def _train(s: TrainState) -> None:
    torch.manual_seed(0)
    for _ in range(2):
        s.model(torch.randn(4, 6)).sum().backward()
        s.optimizer.step()
        s.optimizer.zero_grad()
        s.scheduler.step()
    s.extra["seen"] = 8


def _full(s: TrainState) -> dict:
    """Every tensor of the state, whole (DTensors gathered), by name."""
    from tm_slurm.worker.state import named
    out = {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in named(s)}
    out["lr"] = s.optimizer.param_groups[0]["lr"]
    out["extra"] = dict(s.extra)
    return out


def _mesh(layout: Layout):
    names, shape = [], []
    if layout.dp > 1:
        if 1 < layout.dp_shard < layout.dp:
            names += ["dp_rep", "dp_shard"]
            shape += [layout.dp // layout.dp_shard, layout.dp_shard]
        else:
            names.append("dp")
            shape.append(layout.dp)
    if layout.tp > 1:
        names.append("tp")
        shape.append(layout.tp)
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names)) if names else None


def _rank(phase, r, world, layout, d, port):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=world)
        topo = Topology(layout)
        mesh = _mesh(layout)
        if phase == "save":
            s = _state(layout, mesh, seed=1)
            _train(s)
            ck.save(d, 20, r, topo, s)
        else:
            s = _state(layout, mesh, seed=2)         # other weights: all of it must come from d
            assert ck.load(checkpoints.step_dir(d, 20), r, topo, s) == 20
        torch.save(_full(s), d / f"{phase}-{r}.pt")
        dist.barrier()
    except BaseException:
        (d / f"err-{phase}-{r}").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _run(phase, layout: Layout, d: Path) -> list[dict]:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=_rank, args=(phase, r, layout.world, layout, d, port)) for r in range(layout.world)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(120)
        if p.is_alive():
            p.kill()
    errs = [f.read_text() for f in d.glob(f"err-{phase}-*")]
    assert [p.exitcode for p in ps] == [0] * len(ps), errs
    return [torch.load(d / f"{phase}-{r}.pt") for r in range(layout.world)]


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("wrote,reads", [
    (Layout(dp=4, dp_shard=2, pp=1), [Layout(dp=2, dp_shard=2, pp=1), Layout(dp=3, dp_shard=3, pp=1),
                                      Layout(dp=1, pp=1)]),
    (Layout(dp=2, dp_shard=2, tp=2, pp=1, ranks_per_node=2), [Layout(dp=1, tp=2, pp=1, ranks_per_node=2)]),
], ids=["hsdp", "fsdp-x-tp"])
def test_a_sharded_checkpoint_reads_back_into_other_shard_layouts(tmp_path, wrote, reads):
    saved = _run("save", wrote, tmp_path)
    for r in saved[1:]:
        _same(saved[0], r)
    assert not checkpoints.bad_shards(checkpoints.step_dir(tmp_path, 20), Topology(wrote))
    for lay in reads:
        for got in _run("load", lay, tmp_path):
            _same(saved[0], got)
