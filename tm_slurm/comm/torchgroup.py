"""Process groups for stock torch code (docs/design.md §3): `DistributedDataParallel(process_group=
job.group("dp"))`, `dist.all_reduce(t, group=...)`.

A `TorchGroup` is a real `dist.ProcessGroup` (torch's C++ side calls its collectives through the
pybind trampoline) that stays the same Python object for the whole life of the worker, rehearsal
included. Each collective looks its group up in the bound table at call time, so a swap that
replaces the group's instance (only groups with a moving rank: the delta rule) is seen at the
next collective, and a group the swap keeps is untouched. Failures fail through
(`GroupTable.call`): DDP's backward completes, and the vote discards the step.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from ..errors import MisuseError
from .handles import FailThroughWork, done
from .nccllike import outputs

# the collectives torch's own code calls on a group: DDP (allreduce, broadcast, allgather), FSDP2
# (all_gather_single, reduce_scatter_single), DTensor and the C++ functional collectives (the
# *_coalesced, all_to_all_single; the pybind trampoline prefers torch 2.13's names and falls back
# to the older ones), DCP (gather, scatter), dist.*. A name without an override would run the
# pybind base method, which looks for a backend this group does not have.
SAME_AS = {"all_gather_single": "_allgather_base", "reduce_scatter_single": "_reduce_scatter_base",
           "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
           "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
           "allgather_coalesced": "allgather", "all_to_all_single": "alltoall_base"}
OPS = ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
       "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
       "reduce_scatter_tensor_coalesced", "alltoall_base", "alltoall", "scatter", "gather", "reduce",
       "barrier", "send", "recv", *SAME_AS)


def _pairs(args: tuple):
    return zip(args[0], args[1]) if isinstance(args[0], list) else [(args[0], args[1])]


def serve_locally(op: str, args: tuple, size: int) -> None:
    """`op` as if every other member held this rank's values: what a group of one computes, and
    what a sandbox serves in place of the real group (docs/design.md §5). recv is the caller's."""
    op = SAME_AS.get(op, op)
    if op == "allgather":                      # (out lists, inputs, opts)
        for outs, t in zip(args[0], args[1]):
            for o in outs:
                o.copy_(t)
    elif op in ("_allgather_base", "allgather_into_tensor_coalesced"):   # (out(s), input(s))
        for out, t in _pairs(args):
            for chunk in out.reshape(size, -1):
                chunk.copy_(t.reshape(-1))
    elif op == "reduce_scatter":               # (outputs, input lists, opts)
        for out, ins in zip(args[0], args[1]):
            out.copy_(ins[0])
    elif op in ("_reduce_scatter_base", "reduce_scatter_tensor_coalesced"):
        for out, t in _pairs(args):
            out.copy_(t.reshape(size, -1)[0].view_as(out))
    elif op in ("alltoall_base", "alltoall"):  # this rank's own part stands in for everyone's
        for out, t in _pairs(args):
            out.copy_(t)
    elif op == "scatter" and args[1]:          # (outputs, [inputs] on the root, opts)
        args[0][0].copy_(args[1][0][0])
    elif op == "gather" and args[0]:           # ([outputs] on the root, inputs, opts)
        for o in args[0][0]:
            o.copy_(args[1][0])
    # allreduce, broadcast, reduce, barrier, send: the local values are the result


class TorchGroup(dist.ProcessGroup):
    """One of a rank's groups (`kind`: "dp" or "tp") as a torch ProcessGroup. `bind` points it
    at a table, a group id and the group's members: the sandbox's while a standby rehearses,
    the worker's once it holds a rank. Registered (`register`), torch's own lookups by name and
    by group (DeviceMesh, the functional collectives, `dist.get_rank(group)`) find it."""

    def __init__(self, kind: str, size: int):
        super().__init__(0, size)
        self.kind = kind
        self._table = None
        self._gid: str | None = None
        self.members: tuple[int, ...] = (0,)
        self._grank = 0

    def bind(self, table, gid: str | None, members: tuple[int, ...], rank: int) -> None:
        self._table, self._gid, self.members, self._grank = table, gid, members, members.index(rank)
        if self in c10d._world.pg_group_ranks:
            c10d._world.pg_group_ranks[self] = {m: i for i, m in enumerate(members)}

    def rank(self) -> int:        # Python callers; the C++ rank, fixed at construction, is unused
        return self._grank

    @property
    def group_name(self) -> str:  # C++ reads a name off a backend, and this group has none
        return f"tm_slurm:{self.kind}"

    @property
    def group_desc(self) -> str:
        return self.group_name

    def getBackendName(self) -> str:
        return "tm_slurm"

    def __repr__(self) -> str:
        return f"TorchGroup({self.kind}, {self._gid or 'local'}, rank {self._grank} of {self.size()})"

    def _call(self, op: str, args: tuple) -> FailThroughWork:
        outs = outputs(args)
        if self._table is None:
            raise RuntimeError(f"{self!r} is not bound to a table yet: use it from the training "
                               "script after tm_slurm.init() returned")
        if self._gid is None:                  # a group of one
            serve_locally(op, args, 1)
            return done(outs)
        return self._table.call(self._gid, op, args, outs)


def _op(name: str):
    def op(self, *args, **kwargs):             # dist.barrier passes opts=
        return self._call(name, args + tuple(kwargs.values()))
    op.__name__ = op.__qualname__ = name
    return op


for _name in OPS:
    setattr(TorchGroup, _name, _op(_name))


class WorldGroup(dist.ProcessGroup):
    """The default group, for rank identity only (`dist.get_rank()`, DeviceMesh, DCP's "is this
    distributed" check). It carries no collective: a job-wide group would have to be rebuilt at
    every swap, which is what the delta rule avoids."""

    def __init__(self, world: int):
        super().__init__(0, world)
        self.global_rank = 0

    def rank(self) -> int:
        return self.global_rank

    @property
    def group_name(self) -> str:
        return "tm_slurm:world"

    def _call(self, op: str, args: tuple):
        raise MisuseError(f"a collective ({op}) on the default (world) group: under tm_slurm pass "
                          "group=job.group('dp') (to DistributedDataParallel: process_group="
                          "job.group('dp'); to DeviceMesh.from_group: job.group('dp'))")


for _name in OPS:
    setattr(WorldGroup, _name, _op(_name))


def _register(pg, ranks: dict[int, int]) -> None:
    """What torch's own group creation records (c10d's `_world` tables, the C++ registry the
    functional collectives resolve names in), written out: the helper that does it in 2.13
    (`_register_pg_in_world`) is private and absent from older versions."""
    w, name = c10d._world, pg.group_name
    w.pg_map[pg] = ("tm_slurm", None)
    w.pg_names[pg] = name
    w.pg_backend_config[pg] = "tm_slurm"
    w.pg_group_ranks[pg] = ranks
    w.tags_to_pg.setdefault(f"ptd:{name}", []).append(pg)
    w.pg_to_tag[pg] = f"ptd:{name}"
    torch._C._distributed_c10d._register_process_group(name, pg)


_MESHES: weakref.WeakSet = weakref.WeakSet()


def register(groups: dict[str, TorchGroup], world: WorldGroup) -> None:
    """Make `groups` torch's registered groups and `world` its default group, once per process;
    `set_rank` then says which global rank this process holds. Every DeviceMesh made from here on
    is remembered: a mesh, and each slice of it, caches its rank's coordinate when it is made."""
    _register(world, {i: i for i in range(world.size())})
    c10d._update_default_pg(world)
    for g in groups.values():
        _register(g, {m: i for i, m in enumerate(g.members)})
    made = DeviceMesh.__init__

    def remembered(self, *args, **kwargs):
        made(self, *args, **kwargs)
        _MESHES.add(self)
    DeviceMesh.__init__ = remembered


def set_rank(world: WorldGroup, rank: int) -> None:
    """This process now holds global `rank` (a standby: rehearsed as one, promoted to another).
    Its meshes move with it: a DTensor's place in the global tensor is its mesh coordinate
    (FSDP2's shard offsets, what a checkpoint records), and a standby built its model as the
    rank it rehearsed."""
    world.global_rank = rank
    c10d._update_default_pg(world)
    for m in list(_MESHES):
        if m._rank != rank:
            m._rank = rank
            m._coordinate_on_dim = m._compute_coordinate_on_dim()
