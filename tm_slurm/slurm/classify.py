"""Pure classification of Slurm node state into the events the controller acts on.

`classify(states, reservations, job_nodes, now, horizon_s)` looks at the job's nodes only and
returns at most one NodeEvent per node, in job_nodes order. Each rule names the Slurm 22.05
state it matches (as `scontrol show node -o` prints State=; `sinfo --json` gives the same as
`state` + `state_flags`):

unplanned (the node is gone or going: its processes may already be dead)
  down            base state DOWN: `DOWN+NOT_RESPONDING` (~17 s after a crash/netcut/hang with
                  SlurmdTimeout=10), `DOWN` (admin `State=DOWN`), `DOWN+DRAIN...`.
  not_responding  flag NOT_RESPONDING on a node not (yet) DOWN: `MIXED+NOT_RESPONDING`, shown
                  ~9 s after the node stopped answering pings, ~8 s before DOWN.
                  CAUTION: Slurm 22.05 also sets it for a moment (observed 0.3-1 s) whenever an
                  admin RESUMEs (undrains) a node, even one running our job:
                  MIXED+DRAIN -> MIXED+NOT_RESPONDING -> MIXED. Feed the events through
                  `EventDebouncer` before acting on not_responding.
planned (the node still works; an admin wants it back: leave gracefully)
  fail            flag FAIL: `MIXED+FAIL` after `scontrol update State=FAIL` (Slurm's FAILING).
  reboot          flag REBOOT_REQUESTED or REBOOT_ISSUED: `MIXED+DRAIN+REBOOT_REQUESTED` after
                  `scontrol reboot ASAP ...` (plain `scontrol reboot` gives it without DRAIN).
  drain           flag DRAIN: `MIXED+DRAIN` / `ALLOCATED+DRAIN` after `scontrol update
                  State=DRAIN` (see NodeState.draining); also `IDLE+DRAIN` should a job node be
                  reported idle. Power-saving drains (flags POWER_DOWN, POWER_DRAIN,
                  POWERING_DOWN) count as drain as well.
  maintenance     a reservation with flag MAINT that contains the node, has not ended, and
                  starts within `horizon_s` of `now` (or has started). Before its start NOTHING
                  shows on the node in 22.05 (hence the reservation list); once active the node
                  shows `MIXED+MAINTENANCE+RESERVED` (a few seconds after StartTime), which
                  also counts on its own.
Precedence: unplanned wins over planned (down > not_responding > fail > reboot > drain >
maintenance); the event's `since` is the node's reason time (for maintenance: the window's
start) and `reason` Slurm's reason text (or a description of the reservation).
Not events: RESERVED alone (a normal reservation), PLANNED (the backfill scheduler has plans
for the node), COMPLETING, IDLE/MIXED/ALLOCATED without the flags above, and job nodes
missing from `states` (Slurm does not know them: nothing to say).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .backend import NodeState, Reservation

PLANNED, UNPLANNED, CLEARED = "planned", "unplanned", "cleared"
CAUSES = ("down", "not_responding", "fail", "reboot", "drain", "maintenance")

_POWER_DRAIN_FLAGS = frozenset({"POWER_DOWN", "POWER_DRAIN", "POWERING_DOWN"})


@dataclass(frozen=True)
class NodeEvent:
    node: str
    kind: str          # "planned" | "unplanned" | "cleared" (the earlier event's state is gone)
    cause: str         # "drain" | "reboot" | "maintenance" | "fail" | "down" | "not_responding"
    reason: str
    since: float | None

    @property
    def planned(self) -> bool:
        return self.kind == PLANNED


def _maint_for(node: str, reservations: Sequence[Reservation], now: float,
               horizon_s: float) -> Reservation | None:
    best = None
    for r in reservations:
        if "MAINT" not in r.flags or node not in r.nodes or r.end <= now:
            continue
        if r.start <= now + horizon_s and (best is None or r.start < best.start):
            best = r
    return best


def classify_node(st: NodeState, reservations: Sequence[Reservation], now: float,
                  horizon_s: float) -> NodeEvent | None:
    """The event for one node, or None (see the module docstring for the rules)."""
    f = st.flags
    if st.state == "DOWN":
        return NodeEvent(st.name, UNPLANNED, "down", st.reason or "node is DOWN", st.reason_time)
    if "NOT_RESPONDING" in f:
        return NodeEvent(st.name, UNPLANNED, "not_responding", st.reason or "node not responding",
                         st.reason_time)
    if "FAIL" in f:
        return NodeEvent(st.name, PLANNED, "fail", st.reason, st.reason_time)
    if "REBOOT_REQUESTED" in f or "REBOOT_ISSUED" in f:
        return NodeEvent(st.name, PLANNED, "reboot", st.reason, st.reason_time)
    if "DRAIN" in f or f & _POWER_DRAIN_FLAGS:
        return NodeEvent(st.name, PLANNED, "drain", st.reason, st.reason_time)
    r = _maint_for(st.name, reservations, now, horizon_s)
    if r is not None:
        when = "started" if r.start <= now else f"starts in {r.start - now:.0f} s"
        return NodeEvent(st.name, PLANNED, "maintenance",
                         f"maintenance reservation {r.name} {when}", r.start)
    if "MAINTENANCE" in f:
        return NodeEvent(st.name, PLANNED, "maintenance",
                         st.reason or "node is in an active maintenance reservation", None)
    return None


def classify(states: Mapping[str, NodeState], reservations: Sequence[Reservation],
             job_nodes: Sequence[str], now: float, horizon_s: float) -> list[NodeEvent]:
    """Events for the job's nodes: at most one per node, unplanned over planned, in job order.

    A MAINT reservation on a job node whose window has not ended and starts at or before
    `now + horizon_s` is planned maintenance; a reservation that does not include any of the
    job's nodes is ignored. Nodes missing from `states` give no event.
    """
    out: list[NodeEvent] = []
    for node in dict.fromkeys(job_nodes):
        st = states.get(node)
        if st is None:
            continue
        ev = classify_node(st, reservations, now, horizon_s)
        if ev is not None:
            out.append(ev)
    return out


class EventDebouncer:
    """Holds back `not_responding` events until they persisted `confirm_s` seconds.

    Slurm 22.05 flags a node NOT_RESPONDING for a fraction of a second on every RESUME, which
    would look like a node failure; a real failure keeps the flag ~8 s until DOWN. Every other
    event passes at once. Pure (time comes in as `now`); keep one instance per watcher.
    """

    def __init__(self, confirm_s: float = 2.0):
        self.confirm_s = float(confirm_s)
        self._first_seen: dict[str, float] = {}

    def filter(self, events: Iterable[NodeEvent], now: float) -> list[NodeEvent]:
        events = list(events)
        seen = {e.node for e in events if e.cause == "not_responding"}
        for node in list(self._first_seen):
            if node not in seen:
                del self._first_seen[node]
        out = []
        for e in events:
            if e.cause != "not_responding":
                out.append(e)
                continue
            first = self._first_seen.setdefault(e.node, now)
            if now - first >= self.confirm_s:
                out.append(e)
        return out


__all__ = ["NodeEvent", "classify", "classify_node", "EventDebouncer", "PLANNED", "UNPLANNED",
           "CLEARED", "CAUSES"]
