"""What the controller is asked to do, and when: requests dropped into the job's requests
directory, Slurm's view of the nodes (the watcher), and the drains and checkpoints they want,
one at a time when nothing else is in flight. Intake only decides: it returns `Decision`s,
the controller acts on them."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping

from ..messages import Move
from ..planner import check_drain, choose_joiner
from ..roles import Node, Role
from ..slurm.classify import CLEARED
from .requests import Request


@dataclass(frozen=True)
class Fail:
    node: str
    how: str
    detail: dict


@dataclass(frozen=True)
class Stop:
    why: str


@dataclass(frozen=True)
class ReleaseStandby:
    node: str
    reason: str


@dataclass(frozen=True)
class Migrate:
    """Move a slot off a node: a planned swap (or a full restart, by the recovery strategy)."""
    move: Move
    request: Request


@dataclass(frozen=True)
class TakeCheckpoint:
    reason: str
    exit: bool


Decision = Fail | Stop | ReleaseStandby | Migrate | TakeCheckpoint


class Intake:
    def __init__(self, log: Callable[..., None]):
        self.log = log
        self.wanted_drains: dict[str, Request] = {}
        self.deferred_drains: set[str] = set()
        self.wanted_checkpoint: Request | None = None
        self._last_watch_error: tuple[str, str] | None = None

    # ------------------------------------------------------------ sources
    def requests(self, ok: list[Request], refused, nodes: Mapping[str, Node]) -> list[Decision]:
        for r in refused:
            self.log("request_refused", file=r.file, uid=r.uid, why=r.why,
                     **({"count": r.count} if r.count > 1 else {}))
        out = []
        for r in ok:
            self.log("request", verb=r.verb, node=r.node, reason=r.reason, uid=r.uid,
                     age_s=round(time.time() - r.t, 4), **r.extra)
            out += self.handle(r, nodes)
        return out

    def watcher(self, evs, errs, nodes: Mapping[str, Node]) -> list[Decision]:
        for kind, e in errs:
            if (kind, e) != self._last_watch_error:
                self.log(kind, error=e[:500])
            self._last_watch_error = (kind, e)
        out = []
        for ev, t_seen, query_s in evs:
            if ev.kind == CLEARED:
                self._cleared(ev.node)
                continue
            n = nodes.get(ev.node)
            self.log("slurm_event", node=ev.node, cause=ev.cause, planned=ev.planned,
                     reason=ev.reason, since=ev.since, role=n.role.value if n else None,
                     seen_after_s=round(t_seen - ev.since, 3) if ev.since else None,
                     query_s=round(query_s, 4))
            if n is None or n.role in (Role.FAILED, Role.RELEASED):
                continue
            if ev.planned:
                out += self.handle(Request("drain", ev.node, f"slurm {ev.cause}: {ev.reason}",
                                           ev.since or t_seen, 0, "", {"cause": ev.cause}), nodes)
            else:
                out.append(Fail(ev.node, f"slurm_{ev.cause}", {"reason": ev.reason}))
        return out

    def handle(self, r: Request, nodes: Mapping[str, Node]) -> list[Decision]:
        if r.verb == "drain":
            why = check_drain(nodes, r.node)
            if why:
                self.log("request_rejected", node=r.node, why=why)
                return []
            self.wanted_drains.setdefault(r.node, r)
        elif r.verb == "fail":
            # a site's trigger saw Slurm declare the node down (failing a node already known to
            # be gone does nothing, so a repeated notice does nothing)
            if r.node not in nodes:
                self.log("request_rejected", node=r.node, why=f"unknown node {r.node!r}")
                return []
            return [Fail(r.node, "slurm_down_notified", {"reason": r.reason, "source": r.extra.get("source")})]
        elif r.verb == "checkpoint":
            self.wanted_checkpoint = r
        elif r.verb == "stop":
            return [Stop(r.reason or "stop requested")]
        return []

    def _cleared(self, node: str) -> None:
        """Slurm no longer drains (or reserves) the node: a drain it asked for and that is still
        waiting (deferred: no standby was ready) is no longer wanted. A user's drain stays."""
        r = self.wanted_drains.get(node)
        if r is not None and "cause" in r.extra:
            del self.wanted_drains[node]
            self.deferred_drains.discard(node)
            self.log("drain_cancelled", node=node, why="resumed in Slurm before it was done")

    def want_drain(self, node: str, r: Request) -> None:
        """A drain that could not complete (its swap was cancelled): still to be done."""
        self.wanted_drains.setdefault(node, r)

    # ------------------------------------------------------------ what to start now
    def next(self, nodes: Mapping[str, Node]) -> list[Decision]:
        """Called only when nothing is in flight and the job is running: drained standbys go at
        once, then at most one migration, else a wanted checkpoint."""
        out: list[Decision] = []
        for node, req in sorted(self.wanted_drains.items()):
            n = nodes.get(node)
            if n is None or n.role in (Role.FAILED, Role.RELEASED):
                del self.wanted_drains[node]
                continue
            if n.role == Role.STANDBY:
                del self.wanted_drains[node]
                out.append(ReleaseStandby(node, req.reason))
                continue
            joiner = choose_joiner(nodes.values(), exclude=[d.node for d in out])
            if joiner is None:
                if node not in self.deferred_drains:
                    self.deferred_drains.add(node)
                    self.log("drain_deferred", node=node, why="no READY standby")
                continue
            del self.wanted_drains[node]
            self.deferred_drains.discard(node)
            return out + [Migrate(Move(n.slot, node, joiner), req)]
        r, self.wanted_checkpoint = self.wanted_checkpoint, None
        if r is not None:
            out.append(TakeCheckpoint(r.reason, bool(r.extra.get("exit", False))))
        return out
