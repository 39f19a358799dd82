"""What the controller is asked to do, and when it does it: requests dropped into the job's
requests directory, Slurm's view of the nodes (the watcher), and the drains and checkpoints
they want, started one at a time when nothing else is in flight."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..comm import vote as votes
from ..messages import Move, Shutdown
from ..planner import check_drain, choose_joiner, plan_planned
from ..roles import JobState, Role
from .requests import Request
from .restart import FullRestart
from .swap import PlannedSwap

if TYPE_CHECKING:
    from .core import Controller


class Intake:
    def __init__(self, ctl: "Controller"):
        self.ctl = ctl
        self.wanted_drains: dict[str, Request] = {}
        self.deferred_drains: set[str] = set()
        self.wanted_checkpoint: Request | None = None
        self._last_watch_error: str | None = None

    def busy(self) -> bool:
        c = self.ctl
        return bool(c.swap or c.recovery or c.restart or c.ending is not None)

    # ------------------------------------------------------------ sources
    def poll_requests(self) -> None:
        ctl = self.ctl
        ok, refused = ctl.requests.poll()
        for name, uid, why in refused:
            ctl.log.emit("request_refused", file=name, uid=uid, why=why)
        for r in ok:
            ctl.log.emit("request", verb=r.verb, node=r.node, reason=r.reason, uid=r.uid,
                         age_s=round(time.time() - r.t, 4), **r.extra)
            self.handle(r)

    def poll_watcher(self) -> None:
        ctl = self.ctl
        held = [n for n, x in ctl.nodes.nodes.items() if x.role not in (Role.FAILED, Role.RELEASED)]
        evs, errs = ctl.watcher.poll(held)
        for e in errs:
            if e != self._last_watch_error:
                ctl.log.emit("slurm_query_failed", error=e[:500])
            self._last_watch_error = e
        for ev, t_seen, query_s in evs:
            n = ctl.nodes.nodes.get(ev.node)
            ctl.log.emit("slurm_event", node=ev.node, cause=ev.cause, planned=ev.planned,
                         reason=ev.reason, since=ev.since, role=n.role.value if n else None,
                         seen_after_s=round(t_seen - ev.since, 3) if ev.since else None,
                         query_s=round(query_s, 4))
            if n is None or n.role in (Role.FAILED, Role.RELEASED):
                continue
            if ev.planned:
                self.handle(Request("drain", ev.node, f"slurm {ev.cause}: {ev.reason}",
                                    ev.since or t_seen, 0, "", {"cause": ev.cause}))
            else:
                ctl.fail(ev.node, f"slurm_{ev.cause}", reason=ev.reason)

    def handle(self, r: Request) -> None:
        ctl = self.ctl
        if r.verb == "drain":
            why = check_drain(ctl.nodes.nodes, r.node)
            if why:
                ctl.log.emit("request_rejected", node=r.node, why=why)
                return
            self.wanted_drains.setdefault(r.node, r)
        elif r.verb == "fail":
            # a site's trigger saw Slurm declare the node down (fail() ignores a node it already
            # knows to be gone, so a repeated notice does nothing)
            if r.node not in ctl.nodes.nodes:
                ctl.log.emit("request_rejected", node=r.node, why=f"unknown node {r.node!r}")
                return
            ctl.fail(r.node, "slurm_down_notified", reason=r.reason, source=r.extra.get("source"))
        elif r.verb == "checkpoint":
            self.wanted_checkpoint = r
        elif r.verb == "stop":
            ctl.abort_and_stop(r.reason or "stop requested")

    # ------------------------------------------------------------ acting
    def drive(self) -> None:
        if self.busy():
            return
        ctl = self.ctl
        if ctl.job.state != JobState.RUNNING or ctl.committed_step() is None:
            return
        if self._drains():
            return
        self._checkpoint()

    def _drains(self) -> bool:
        """Start the next wanted drain; True if something started."""
        ctl = self.ctl
        for node, req in sorted(self.wanted_drains.items()):
            n = ctl.nodes.nodes.get(node)
            if n is None or n.role in (Role.FAILED, Role.RELEASED):
                del self.wanted_drains[node]
                continue
            if n.role == Role.STANDBY:
                del self.wanted_drains[node]
                ctl.send(node, Shutdown(f"drained: {req.reason}"))
                ctl.nodes.set_role(node, Role.RELEASED, reason=f"drained standby: {req.reason}")
                ctl.release(node, "standby drained")
                continue
            joiner = choose_joiner(ctl.nodes.nodes.values())
            if joiner is None:
                if node not in self.deferred_drains:
                    self.deferred_drains.add(node)
                    ctl.log.emit("drain_deferred", node=node, why="no READY standby")
                continue
            del self.wanted_drains[node]
            self.deferred_drains.discard(node)
            move = [Move(n.slot, node, joiner)]
            if ctl.cfg.recovery.strategy == "restart":
                ctl.restart = FullRestart(ctl, "planned", move, req.reason or "drain", req.t)
                ctl.restart.start_planned()
                return True
            ctl.plan_seq += 1
            plan = plan_planned(ctl.topo, ctl.plan_seq, ctl.gen, ctl.new_gen(), move,
                                reason=req.reason or req.verb)
            ctl.swap = PlannedSwap(ctl, plan, req)
            ctl.swap.start()
            return True
        return False

    def _checkpoint(self) -> None:
        ctl, r = self.ctl, self.wanted_checkpoint
        if r is None:
            return
        self.wanted_checkpoint = None
        exit_after = bool(r.extra.get("exit", False))
        votes.set_pending(ctl.store, ctl.gen, checkpoint=r.reason or "requested", exit=exit_after)
        ctl.log.emit("checkpoint_requested", reason=r.reason, exit=exit_after)
        if exit_after:
            ctl.stop(r.reason or "checkpoint and exit", JobState.REQUEUED, code=ctl.requeue_code,
                     wait_workers=True)
