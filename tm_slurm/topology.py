"""DP x PP x TP layout: ranks, node slots, communication groups, and the delta of a swap.

Pure functions of the layout; no processes. A *slot* is one active node's share of ranks; a swap
moves a slot from one physical node to another, so the set of groups never changes, only which
of them must be rebuilt because a member moved.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

from .config import Layout


@dataclass(frozen=True)
class Coord:
    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class GroupSpec:
    """One communication group. `members[i]` is the global rank holding group rank i."""
    id: str
    kind: str            # "dp" | "pp" | "tp" | "dp_shard" | "dp_rep" (HSDP)
    members: tuple[int, ...]

    def group_rank(self, rank: int) -> int:
        return self.members.index(rank)


@dataclass(frozen=True)
class Role:
    """What a rank does, as far as the user's code is concerned: the general standby rehearses
    the distinct roles (first, middle, last pipeline stage) before it is needed."""
    pp_rank: int
    pp_size: int

    @property
    def name(self) -> str:
        if self.pp_size == 1:
            return "only"
        if self.pp_rank == 0:
            return "first"
        return "last" if self.pp_rank == self.pp_size - 1 else "middle"


@dataclass(frozen=True)
class Topology:
    layout: Layout

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def slots(self) -> int:
        return self.world // self.layout.ranks_per_node

    def coord(self, rank: int) -> Coord:
        lay = self.layout
        if not 0 <= rank < lay.world:
            raise ValueError(f"rank {rank} outside world of {lay.world}")
        return Coord(dp=(rank // lay.tp) % lay.dp, pp=rank // (lay.tp * lay.dp), tp=rank % lay.tp)

    def rank(self, c: Coord) -> int:
        lay = self.layout
        return c.pp * lay.dp * lay.tp + c.dp * lay.tp + c.tp

    def slot_ranks(self, slot: int) -> tuple[int, ...]:
        r = self.layout.ranks_per_node
        return tuple(range(slot * r, (slot + 1) * r))

    def slot_of(self, rank: int) -> int:
        return rank // self.layout.ranks_per_node

    def role(self, rank: int) -> Role:
        return Role(self.coord(rank).pp, self.layout.pp)

    @cached_property
    def groups(self) -> tuple[GroupSpec, ...]:
        lay = self.layout
        out: list[GroupSpec] = []
        if lay.dp > 1:
            for p in range(lay.pp):
                for t in range(lay.tp):
                    out.append(GroupSpec(f"dp/pp{p}.tp{t}", "dp",
                                         tuple(self.rank(Coord(d, p, t)) for d in range(lay.dp))))
        # pipeline p2p as one group per adjacent stage pair: a leaver touches only its neighbours
        for d in range(lay.dp):
            for t in range(lay.tp):
                for s in range(lay.pp - 1):
                    out.append(GroupSpec(f"pp/dp{d}.tp{t}.s{s}-{s + 1}", "pp",
                                         (self.rank(Coord(d, s, t)), self.rank(Coord(d, s + 1, t)))))
        if lay.tp > 1:
            for d in range(lay.dp):
                for p in range(lay.pp):
                    out.append(GroupSpec(f"tp/dp{d}.pp{p}", "tp",
                                         tuple(self.rank(Coord(d, p, t)) for t in range(lay.tp))))
        n = lay.dp_shard
        if 1 < n < lay.dp:           # HSDP: each replica's shard group, each shard's replicate group
            for p in range(lay.pp):
                for t in range(lay.tp):
                    for r in range(lay.dp // n):
                        out.append(GroupSpec(f"dp_shard/pp{p}.tp{t}.r{r}", "dp_shard",
                                             tuple(self.rank(Coord(r * n + s, p, t)) for s in range(n))))
                    for s in range(n):
                        out.append(GroupSpec(f"dp_rep/pp{p}.tp{t}.s{s}", "dp_rep",
                                             tuple(self.rank(Coord(d, p, t)) for d in range(s, lay.dp, n))))
        return tuple(out)

    def mesh_dims(self) -> tuple[str, ...]:
        """The group kinds of a rank's data and tensor parallel mesh, outermost first: the DP
        dimension ("dp", or "dp_rep" x "dp_shard" for HSDP), then "tp" when there is one."""
        lay, n = self.layout, self.layout.dp_shard
        dims = ("dp_rep", "dp_shard") if 1 < n < lay.dp else ("dp",)
        return dims + (("tp",) if lay.tp > 1 else ())

    def mesh(self, rank: int) -> list:
        """The global ranks of `rank`'s mesh (`mesh_dims`) as torch's DeviceMesh wants them."""
        c, lay = self.coord(rank), self.layout
        dims = self.mesh_dims()
        sizes = {"dp": lay.dp, "dp_rep": lay.dp // lay.dp_shard, "dp_shard": lay.dp_shard, "tp": lay.tp}

        def ranks(idx: dict) -> int:
            d = idx.get("dp", idx.get("dp_rep", 0) * lay.dp_shard + idx.get("dp_shard", 0))
            return self.rank(Coord(d, c.pp, idx.get("tp", 0)))

        def nest(i: int, idx: dict):
            if i == len(dims):
                return ranks(idx)
            return [nest(i + 1, {**idx, dims[i]: k}) for k in range(sizes[dims[i]])]
        return nest(0, {})

    @cached_property
    def group_by_id(self) -> dict[str, GroupSpec]:
        return {g.id: g for g in self.groups}

    def groups_of(self, rank: int) -> tuple[GroupSpec, ...]:
        return tuple(g for g in self.groups if rank in g.members)

    def state_key(self, rank: int) -> str:
        """Which part of the training state `rank` holds: its pipeline stage and tp shard, and
        with `layout.dp_shard` > 1 its position in the DP shard group. Ranks of one key hold the
        same state (replicas); a checkpoint has one shard per key."""
        c, n = self.coord(rank), self.layout.dp_shard
        return f"pp{c.pp}.tp{c.tp}" + (f".dp{c.dp % n}" if n > 1 else "")

    def replica_index(self, rank: int) -> int:
        return self.coord(rank).dp // self.layout.dp_shard

    def replicas(self, rank: int) -> tuple[int, ...]:
        """Ranks holding the same state as `rank` (the same key, in the other replicas)."""
        c, n = self.coord(rank), self.layout.dp_shard
        return tuple(self.rank(Coord(d, c.pp, c.tp)) for d in range(c.dp % n, self.layout.dp, n)
                     if d != c.dp)

    def delta(self, moving_ranks: Iterable[int]) -> tuple[tuple[GroupSpec, ...], tuple[GroupSpec, ...]]:
        """(rebuilt, kept): a swap rebuilds exactly the groups containing a moving rank."""
        moving = set(moving_ranks)
        rebuilt = tuple(g for g in self.groups if moving & set(g.members))
        kept = tuple(g for g in self.groups if not moving & set(g.members))
        return rebuilt, kept

    def slot_delta(self, slots: Iterable[int]):
        return self.delta(r for s in slots for r in self.slot_ranks(s))
