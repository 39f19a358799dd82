"""A live rank that never joins a collective: its process is up and its heartbeats flow (a
training thread stuck in the script's code, a wedged kernel before its collective), so neither
heartbeats nor the agent see it; its peers wait in that collective until its timeout, and on
NCCL even past it.

Each worker's watchdog reports a collective of its step pending for more than
timeouts.hang_timeout_s (`Stalled`: the group and its members). The members of that group that
report no stall on it are the ones the others wait for. One heartbeat timeout after the first
report (the others' reports arrive within a beat or two), if those are all on one node and
none of them is itself waiting in a collective (then it is not the hung one: the chain is
followed through its own stall), that node is the hung one. A wait every member reports (a
collective wedged on every rank) names nobody: the collective timeout ends it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class _Stall:
    first_t: float
    members: frozenset[int]
    waiting: set[int] = field(default_factory=set)


def culprit(members: frozenset[int], waiting: set[int], stalled_anywhere: set[int],
            node_of: Callable[[int], str | None]) -> str | None:
    """The node the `waiting` members of a group wait for, or None if that is not one node
    that is not itself waiting."""
    absent = members - waiting
    nodes = {node_of(r) for r in absent}
    if not absent or len(nodes) != 1 or None in nodes or absent & stalled_anywhere:
        return None
    return nodes.pop()


class Hangs:
    """The stalls reported in the current generation, at most one entry a group."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.gen: int | None = None
        self.stalls: dict[str, _Stall] = {}
        self.stalled: set[int] = set()

    def _at(self, gen: int) -> bool:
        """Forget another generation's stalls (its groups are gone); whether `gen` was current."""
        if gen == self.gen:
            return True
        self.gen, self.stalls, self.stalled = gen, {}, set()
        return False

    def note(self, gen: int, group: str, members: list[int], rank: int, now: float) -> None:
        self._at(gen)
        s = self.stalls.setdefault(group, _Stall(now, frozenset(members)))
        s.waiting.add(rank)
        self.stalled.add(rank)

    def due(self, now: float, gen: int, node_of: Callable[[int], str | None]) -> list[tuple[str, str, int]]:
        """(node, group, ranks waiting) for each stall whose grace has passed and that names a
        node; every stall past its grace is settled (forgotten) either way."""
        if not self._at(gen):
            return []
        out = []
        for group, s in list(self.stalls.items()):
            if now - s.first_t < self.grace_s:
                continue
            del self.stalls[group]
            node = culprit(s.members, s.waiting, self.stalled, node_of)
            if node is not None:
                out.append((node, group, len(s.waiting)))
        return out
