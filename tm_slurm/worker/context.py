"""`Context`: what the user's build and step functions see of their rank and its groups."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.handles import Comm, GroupTable, PipeComm
from ..comm.torchgroup import TorchGroup
from ..topology import Topology


@dataclass
class Context:
    """`dp`, `pp` and `tp` stay the same objects for the whole run; the groups behind them change
    at swaps. `sandbox` is True while a standby rehearses (its collectives are mocked)."""
    rank: int
    world: int
    dp_rank: int
    dp_size: int
    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int
    role: str                 # first | middle | last | only
    device: torch.device
    dp: Comm
    pp: PipeComm
    tp: Comm
    seed: int
    sandbox: bool = False
    groups: dict = None       # kind -> TorchGroup (dp, tp; dp_shard, dp_rep with HSDP)
    mesh: list = None         # the global ranks of this rank's DP (x TP) mesh (Topology.mesh)
    mesh_dims: tuple = ()     # its dims' group kinds (Topology.mesh_dims)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def torch_groups(topo: Topology) -> dict[str, TorchGroup]:
    """A worker's torch process groups, made once: training code keeps them for the whole run."""
    lay, n = topo.layout, topo.layout.dp_shard
    sizes = {"dp": lay.dp, "tp": lay.tp}
    if 1 < n < lay.dp:
        sizes.update(dp_shard=n, dp_rep=lay.dp // n)
    return {kind: TorchGroup(kind, size) for kind, size in sizes.items()}


def make_context(topo: Topology, rank: int, table: GroupTable, device: torch.device, seed: int,
                 sandbox: bool = False, groups: dict[str, TorchGroup] | None = None) -> Context:
    """`rank`'s context on `table`; `groups` (the worker's `torch_groups`) are bound to it too."""
    c = topo.coord(rank)
    lay = topo.layout
    groups = groups or torch_groups(topo)
    mine = {g.kind: g for g in topo.groups_of(rank) if g.kind in groups}
    ids = {k: g.id for k, g in mine.items()}
    for kind, tg in groups.items():
        g = mine.get(kind)
        tg.bind(table, g and g.id, g.members if g else (rank,), rank)
    prev_id = next_id = None
    for g in topo.groups_of(rank):
        if g.kind == "pp":
            if g.members[1] == rank:
                prev_id = g.id
            else:
                next_id = g.id
    return Context(
        rank=rank, world=lay.world, dp_rank=c.dp, dp_size=lay.dp, pp_rank=c.pp, pp_size=lay.pp,
        tp_rank=c.tp, tp_size=lay.tp, role=topo.role(rank).name, device=device,
        dp=Comm(table, ids.get("dp"), lay.dp, c.dp), pp=PipeComm(table, prev_id, next_id),
        tp=Comm(table, ids.get("tp"), lay.tp, c.tp), seed=seed, sandbox=sandbox,
        groups=groups, mesh=topo.mesh(rank), mesh_dims=topo.mesh_dims())
