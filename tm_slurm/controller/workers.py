"""What the controller knows of every node's workers, kept from their heartbeats
(messages.Heartbeat names only what changed): status.json shows it, and an abort of the steps
in flight reads how far the ranks are."""
from __future__ import annotations

from ..messages import MOVE_FIELDS


class Seen:
    """One worker, as its last beats said. Mutable: a beat's moves change it in place, where a
    new frozen WorkerInfo per move is what the flat moves are there to save."""
    __slots__ = ("local", "pid", "rank", "step", "committed", "alive")

    def __init__(self, local, pid, rank, step, committed, alive):
        self.local, self.pid, self.rank = local, pid, rank
        self.step, self.committed, self.alive = step, committed, alive


def merge(view: dict[int, Seen] | None, hb) -> dict[int, Seen]:
    """A node's view after its beat `hb`: a full beat replaces it; another one updates the
    workers it names and moves the steps of those in its moves."""
    if hb.full or view is None:
        view = {}
    for w in hb.workers:
        view[w.local] = Seen(w.local, w.pid, w.rank, w.step, w.committed, w.alive)
    m = hb.moves
    for i in range(0, len(m) - MOVE_FIELDS + 1, MOVE_FIELDS):
        if (s := view.get(m[i])) is not None:
            s.step, s.committed = m[i + 1], m[i + 2]
    return view
