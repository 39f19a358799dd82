"""Pure decisions: which standby replaces which node, what a swap rebuilds, where state comes from,
when phase 1 is done, what to do without standbys. Plain functions of state, no side effects;
the controller executes what they return.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Iterable, Mapping

from .config import Layout
from .messages import GroupBuild, Move, SwapPlan, Transfer
from .roles import Node, Role
from .topology import Coord, Topology


class PlanError(ValueError):
    pass


def choose_joiner(nodes: Iterable[Node], exclude: Iterable[str] = ()) -> str | None:
    """A READY standby, the same one for the same state (sorted by name): any standby can take any
    role (general standby), so there is nothing smarter to pick by here."""
    ex = set(exclude)
    ready = sorted(n.name for n in nodes if n.role == Role.STANDBY and n.ready and n.name not in ex)
    return ready[0] if ready else None


def check_drain(nodes: Mapping[str, Node], name: str) -> str | None:
    """Why `name` cannot be drained right now (None: it can)."""
    n = nodes.get(name)
    if n is None:
        return f"unknown node {name!r}; nodes of this job: {', '.join(sorted(nodes))}"
    if n.role == Role.STANDBY:
        return None    # a standby is released directly, nothing to migrate
    if n.role != Role.ACTIVE:
        return f"node {name} is {n.role.value}, not ACTIVE"
    return None


def _prefix(plan_id: int, what: str) -> str:
    return f"p{plan_id}/{what}"


def plan_planned(topo: Topology, plan_id: int, gen: int, gen_to: int, moves: list[Move],
                 reason: str = "") -> SwapPlan:
    """Planned migration of one or more slots: rebuild exactly the groups that contain a moving
    rank; each leaver sends its own state to its joiner."""
    ranks = tuple(r for m in moves for r in topo.slot_ranks(m.slot))
    rebuilt, _ = topo.delta(ranks)
    return SwapPlan(
        id=plan_id, kind="planned", gen_from=gen, gen_to=gen_to, moves=tuple(moves), ranks=ranks,
        builds=tuple(GroupBuild(g.id, g.members, _prefix(plan_id, g.id)) for g in rebuilt),
        transfers=tuple(Transfer(r, r, _prefix(plan_id, f"xfer{r}")) for r in ranks),
        reason=reason)


def donors(topo: Topology, moving: Iterable[int], alive: Iterable[int]) -> dict[int, int | None]:
    """For each moving rank, a live DP replica (same stage and tp shard) not itself moving."""
    mv, al = set(moving), set(alive)
    return {r: next((x for x in topo.replicas(r) if x in al and x not in mv), None) for r in sorted(mv)}


def plan_recovery(topo: Topology, plan_id: int, gen: int, gen_to: int, moves: list[Move],
                  alive: Iterable[int],
                  broken: Iterable[str], resume_step: int,
                  checkpoint: tuple[int, str] | None = None, reason: str = "") -> SwapPlan:
    """After a failure: joiners take the failed slots; groups with a moving rank, and groups a
    survivor saw break, are rebuilt; state comes from a DP replica. Without a replica for every
    moving rank, everyone loads `checkpoint` (PlanError if there is none)."""
    ranks = tuple(r for m in moves for r in topo.slot_ranks(m.slot))
    rebuilt, _ = topo.delta(ranks)
    ids = {g.id for g in rebuilt} | set(broken)
    unknown = ids - set(topo.group_by_id)
    if unknown:
        raise PlanError(f"unknown groups reported broken: {sorted(unknown)}")
    groups = [g for g in topo.groups if g.id in ids]
    d = donors(topo, ranks, alive)
    missing = [r for r, x in d.items() if x is None]
    ckpt_path = None
    transfers: tuple[Transfer, ...] = ()
    if missing:
        if checkpoint is None:
            raise PlanError(f"no live replica holds the state of ranks {missing} and there is no "
                            "valid checkpoint")
        resume_step, ckpt_path = checkpoint
    else:
        transfers = tuple(Transfer(r, d[r], _prefix(plan_id, f"xfer{r}")) for r in ranks)
    return SwapPlan(
        id=plan_id, kind="unplanned", gen_from=gen, gen_to=gen_to, moves=tuple(moves), ranks=ranks,
        builds=tuple(GroupBuild(g.id, g.members, _prefix(plan_id, g.id)) for g in groups),
        transfers=transfers, resume_step=resume_step, checkpoint=ckpt_path, reason=reason)


def kept(topo: Topology, plan: SwapPlan) -> list[str]:
    """Ids of the groups `plan` keeps as they are: every group it does not rebuild."""
    built = {b.id for b in plan.builds}
    return [g.id for g in topo.groups if g.id not in built]


def initial_builds(topo: Topology) -> tuple[GroupBuild, ...]:
    return tuple(GroupBuild(g.id, g.members, f"g0/{g.id}") for g in topo.groups)


def ready_needed(topo: Topology, plan: SwapPlan, holder: Mapping[int, str]) -> frozenset[tuple[str, int]]:
    """`holder[rank]` is the node holding each rank now. Stayers that are members of a rebuilt
    group, every leaver rank (its transfer link) and every joiner rank must be ready."""
    moving = set(plan.ranks)
    need = {(holder[r], r) for b in plan.builds for r in b.members if r not in moving}
    for m in plan.moves:
        for r in topo.slot_ranks(m.slot):
            need.add((m.leaver, r))
            need.add((m.joiner, r))
    return frozenset(need)


def recovery_needed(topo: Topology, plan: SwapPlan, holder: Mapping[int, str]) -> frozenset[tuple[str, int]]:
    """Recovery: every surviving rank takes part (it must at least learn the new generation),
    and each joiner for the ranks of its slot."""
    moving = set(plan.ranks)
    need = {(n, r) for r, n in holder.items() if r not in moving}
    for m in plan.moves:
        need |= {(m.joiner, r) for r in topo.slot_ranks(m.slot)}
    return frozenset(need)


def exhausted_action(policy: str, waited_s: float, wait_s: float, dp: int) -> str:
    """No READY standby for a failed or draining slot: "wait" (for one to become ready),
    "shrink" or "checkpoint_exit"."""
    if policy == "wait":
        return "wait" if waited_s < wait_s else "checkpoint_exit"
    if policy == "shrink" and dp > 1:
        return "shrink"
    return "checkpoint_exit"


@dataclass(frozen=True)
class ShrinkPlan:
    """Drop whole DP replicas: `layout` is what remains, `slots` maps each surviving old slot to
    its new one (ranks renumbered as if the job had been started at the smaller size, so its
    data and RNG keys are those of a fresh run of that size), `freed` the old slots of the
    dropped replicas that are still alive. `from_checkpoint`: the survivors do not hold the whole
    state (FSDP without replicas lost a shard): the job resumes from the newest complete
    checkpoint, resharded to the smaller layout."""
    layout: Layout
    dropped: tuple[int, ...]                 # DP indices
    slots: Mapping[int, int]
    freed: tuple[int, ...]
    from_checkpoint: bool = False


def plan_shrink(topo: Topology, lost_slots: Iterable[int]) -> ShrinkPlan | str:
    """Shrink DP by every replica that lost a slot; a string says why the layout does not allow
    it (then the caller checkpoints and exits instead). With layout.dp_shard > 1 a replica is a
    whole shard group (HSDP: the others keep their shards as they are); FSDP over the whole DP
    group has one replica, so the DP ranks that are left shard the state among themselves."""
    lay = topo.layout
    lost = set(lost_slots)
    hit = {topo.coord(r).dp for s in lost for r in topo.slot_ranks(s)}
    n = lay.dp_shard
    unreplicated = 1 < n == lay.dp         # FSDP over the whole DP group: one replica
    if unreplicated:
        keep = [d for d in range(lay.dp) if d not in hit]
        new = replace(lay, dp=len(keep), dp_shard=max(len(keep), 1))
    else:
        groups_hit = {h // n for h in hit}
        keep = [d for d in range(lay.dp) if d // n not in groups_hit]
        new = replace(lay, dp=len(keep))
    dropped = sorted(set(range(lay.dp)) - set(keep))
    if not keep:
        return f"every DP replica lost a node (dp={lay.dp})"
    if new.world % new.ranks_per_node:
        return (f"dp={new.dp} x pp={new.pp} x tp={new.tp} does not fill nodes of "
                f"{new.ranks_per_node} ranks")
    small = Topology(new)

    def renumber(r: int) -> int | None:
        c = topo.coord(r)
        return small.rank(Coord(keep.index(c.dp), c.pp, c.tp)) if c.dp in keep else None

    slots, freed = {}, []
    for s in range(topo.slots):
        new_ranks = [renumber(r) for r in topo.slot_ranks(s)]
        if all(r is None for r in new_ranks):
            if s not in lost:
                freed.append(s)
            continue
        if None in new_ranks or tuple(new_ranks) != small.slot_ranks(small.slot_of(new_ranks[0])):
            return f"node slot {s} holds ranks of replicas that are kept and dropped alike"
        slots[s] = small.slot_of(new_ranks[0])
    return ShrinkPlan(new, tuple(dropped), slots, tuple(freed), from_checkpoint=unreplicated)


def straggler(busy_by_node: Mapping[str, list[float]], margin: float, window: int) -> tuple[str, float] | None:
    """The node whose own work per step (median over its last `window` steps, the slowest of its
    ranks) exceeds the median of the other nodes by more than `margin` (0.5: 50% slower), and
    by how much; None if no node does, or too few steps are known. Synchronous training waits for
    the slowest rank at every collective, so only time outside collectives tells who it is."""
    meds = {n: statistics.median(xs[-window:]) for n, xs in busy_by_node.items() if len(xs) >= window}
    if len(meds) < 3 or len(meds) < len(busy_by_node):
        return None
    worst = max(meds, key=meds.get)
    rest = statistics.median(v for n, v in meds.items() if n != worst)
    if rest > 0 and meds[worst] > (1 + margin) * rest:
        return worst, meds[worst] / rest - 1
    return None
