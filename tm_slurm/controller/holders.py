"""Which node computes each slot's ranks: the controller's one record of rank ownership.

`Node.slot` is the slot a node's role refers to (a joiner's target, a leaver's until it is
released); this says who computes the slot now. A failed node keeps its slot here until a plan
gives the slot to someone else: its ranks are the ones to recover.
"""
from __future__ import annotations

from ..topology import Topology


class Holders:
    def __init__(self, topo: Topology, by_slot: dict[int, str]):
        self.by_slot: dict[int, str] = {}
        self.ranks: dict[int, str] = {}               # global rank -> node
        self.version = 0                              # changes whenever `ranks` does
        self.since: dict[str, int] = {n: 0 for n in by_slot.values()}   # first step computed
        self.reset(topo, by_slot)

    def reset(self, topo: Topology, by_slot: dict[int, str]) -> None:
        """A new layout (a shrink): the ranks are renumbered."""
        self.topo = topo
        self.version += 1
        self.by_slot, self.ranks = {}, {}
        for slot, node in by_slot.items():
            self.hold(slot, node)

    def hold(self, slot: int, node: str, since: int | None = None) -> None:
        self.version += 1
        self.by_slot[slot] = node
        for r in self.topo.slot_ranks(slot):
            self.ranks[r] = node
        if since is not None:
            self.since[node] = since

    def slot_of(self, node: str) -> int | None:
        return next((s for s, n in self.by_slot.items() if n == node), None)

    def nodes(self) -> set[str]:
        return set(self.by_slot.values())

    def __contains__(self, node: str) -> bool:
        return node in self.by_slot.values()
