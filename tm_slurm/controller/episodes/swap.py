"""A planned migration, from plan to measured completion (docs/design.md §4, planned).

preparing: Prepare sent; stayers, leaver and joiner build in the background while training runs.
switching: everyone needed is READY; the switch is pending in the store, so the next committed
           step boundary (the same on every rank) carries it.
switched:  the boundary passed (its step is in the store): the joiner holds the slot.
done:      leaver handed over and exited, joiner received the state and ran; stall measured.
cancelled: off before the switch: nothing changed for anybody.
"""
from __future__ import annotations

import enum

from ...comm import vote as votes
from ...messages import (CancelPlan, Joined, Left, Prepare, PrepareFailed, Ready, Report, Shutdown,
                         SwapPlan, Switched, ToWorkers)
from ...planner import kept, ready_needed
from ...roles import JobState, Role
from .base import Episode, Failure, rounded


class State(str, enum.Enum):
    PREPARING = "preparing"
    SWITCHING = "switching"
    SWITCHED = "switched"
    DONE = "done"
    CANCELLED = "cancelled"


S = State
TRANSITIONS = {
    S.PREPARING: frozenset({S.SWITCHING, S.CANCELLED}),
    S.SWITCHING: frozenset({S.SWITCHED, S.CANCELLED}),   # SWITCHED: a commit carried the switch
    S.SWITCHED: frozenset({S.DONE}),
    S.DONE: frozenset(),
    S.CANCELLED: frozenset(),
}

POST_WINDOW = 10    # steady step time is measured over the steps after the switch


class PlannedSwap(Episode):
    State, TRANSITIONS, FINAL = State, TRANSITIONS, frozenset({S.DONE, S.CANCELLED})

    def __init__(self, port, plan: SwapPlan, request):
        super().__init__(port, S.PREPARING)
        self.plan, self.request = plan, request
        self.reason = request.reason or request.verb
        self.t0 = port.now()
        self.requested_wall = request.t           # when the event that asked for it happened
        self.plan_wall = port.wall()
        self.needed = ready_needed(port.topo, plan, port.holders.ranks)
        self.ready: dict[tuple[str, int], Ready] = {}
        self.t_ready: float | None = None
        self.t_switched: float | None = None
        self.switch_step: int | None = None
        self.switched: dict[int, Switched] = {}
        self.left: dict[int, Left] = {}
        self.joined: dict[int, Joined] = {}
        self.steady_before = port.committed_step()
        self.stayers = [r for r in range(port.topo.world) if r not in plan.ranks]

    def start(self) -> None:
        p, plan = self.port, self.plan
        for m in plan.moves:
            p.nodes.set_role(m.leaver, Role.LEAVING, reason=self.reason, plan=plan.id)
            p.nodes.set_role(m.joiner, Role.JOINING, reason=self.reason, plan=plan.id, slot=m.slot)
        p.job.set(JobState.SWAPPING, plan=plan.id)
        p.log.emit("swap_planned", node=plan.leavers[0], plan=plan.id, kind_of="planned",
              joiner=plan.joiners[0], ranks=list(plan.ranks), reason=self.reason,
              gen_to=plan.gen_to, groups_rebuilt=[b.id for b in plan.builds],
              groups_kept=len(kept(p.topo, plan)))
        p.broadcast(ToWorkers(Prepare(plan)))

    def involves(self, node: str) -> bool:
        return node in self.plan.joiners + self.plan.leavers

    # ------------------------------------------------------------ reports
    def on_report(self, node: str, rep: Report) -> None:
        if getattr(rep, "plan", None) != self.plan.id:
            return
        if isinstance(rep, Ready):
            self.ready[(node, rep.rank)] = rep
        elif isinstance(rep, PrepareFailed):
            self.cancel(f"{node} rank {rep.rank} could not prepare: {rep.error}")
        elif isinstance(rep, Switched):
            self.switched[rep.rank] = rep
        elif isinstance(rep, Left):
            self.left[rep.rank] = rep
            if all(r in self.left for r in self.plan.ranks):
                for m in self.plan.moves:
                    self.port.send(m.leaver, Shutdown("evacuated"))
        elif isinstance(rep, Joined):
            self.joined[rep.rank] = rep

    # ------------------------------------------------------------ progress
    def tick(self, now: float) -> None:
        p = self.port
        if self.state == S.PREPARING:
            if self.needed <= set(self.ready):
                self.t_ready = now
                self.to(S.SWITCHING)
                votes.set_pending(p.store, self.plan.gen_from, plan_id=self.plan.id, gen_to=self.plan.gen_to)
                p.log.emit("phase1_done", node=self.plan.leavers[0], plan=self.plan.id,
                      phase1_s=round(now - self.t0, 4),
                      build_s_max=round(max(d.build_s for d in self.ready.values()), 4))
            elif now - self.t0 > p.T.phase1_timeout_s:
                missing = sorted(self.needed - set(self.ready))
                self.cancel(f"phase 1 not done after {p.T.phase1_timeout_s}s; waiting for {missing}")
        if self.state == S.SWITCHING:
            k = votes.switch_key(self.plan.id)
            if p.store.check([k]):
                self.on_switched(int(p.store.get(k)), now)
        if self.state == S.SWITCHED and self.complete():
            self.record(interrupted=False)

    def on_switched(self, step: int, now: float | None = None) -> None:
        """The commit of `step` carried the switch: the joiner holds the slot from step+1 on."""
        if self.state == S.SWITCHED:
            return
        p, plan = self.port, self.plan
        self.to(S.SWITCHED)
        self.switch_step = step
        self.t_switched = p.now() if now is None else now
        p.adopt(plan, since=(p.committed_step() or 0) + 1, first_step=step + 1)
        for m in plan.moves:
            # a joiner that died after the commit carrying the switch stays FAILED: its slot is
            # recovered like any other active node's
            if p.nodes.nodes[m.joiner].role != Role.FAILED:
                p.nodes.set_role(m.joiner, Role.ACTIVE, reason="switched", plan=plan.id, slot=m.slot)
        p.job.set(JobState.RUNNING, plan=plan.id)
        p.log.emit("switch", node=plan.leavers[0], step=step, plan=plan.id, joiner=plan.joiners[0],
              pending_to_switch_s=round(self.t_switched - (self.t_ready or self.t0), 4))

    def on_node_failed(self, f: Failure) -> bool:
        if f.aborted is None:
            if f.node in self.plan.joiners:
                self.cancel(f"joiner {f.node} failed ({f.how})")
            return False
        gen, _ = f.aborted
        if self.state == S.SWITCHING or (self.state == S.PREPARING and gen == self.port.gen):
            # unless a commit carried the switch already (the abort then followed it into the
            # new generation): take_back says which
            self.cancel(f"{f.node} failed ({f.how})")
        if self.state == S.SWITCHED:
            # the switch stands: the failed node's ranks are its holdings after it
            self.record(interrupted=True)
        return False

    def finish(self, why: str) -> None:
        if self.state == S.SWITCHED and self.joined:
            self.record(interrupted=True)   # the job ended inside the measuring window

    # ------------------------------------------------------------ measuring
    def _window(self) -> int:
        total = self.port.total_steps
        return max(0, min(POST_WINDOW, total - self.switch_step - 2)) if total else POST_WINDOW

    def complete(self) -> bool:
        k1 = self.switch_step + 1
        return (all(r in self.left for r in self.plan.ranks)
                and all(r in self.joined for r in self.plan.ranks)
                and self.port.progress.all_at(k1 + self._window(), range(self.port.topo.world)))

    def _measured(self) -> int:
        """Steps after the first one of the new membership that every rank has committed."""
        k1, world = self.switch_step + 1, range(self.port.topo.world)
        w = 0
        while w < POST_WINDOW and self.port.progress.all_at(k1 + 1 + w, world):
            w += 1
        return w

    def record(self, interrupted: bool) -> None:
        """Stall = the switch step's time minus the steady step time after the swap (before it, a
        standby's warm-up may have shared the machine; on a cluster it has its own).
        `interrupted`: a failure or the job's end cut the measuring window short; the swap is
        recorded with what was measured."""
        p, plan, progress = self.port, self.plan, self.port.progress
        k1 = self.switch_step + 1
        w = self._measured() if interrupted else self._window()
        steady = progress.steady_between(k1 + 1, k1 + w) if w >= 3 else None
        if steady is None:
            steady = progress.steady(before=self.steady_before + 1 if self.steady_before is not None else None)
        slow = progress.slowest(k1, self.stayers) if self.stayers else None
        firsts = [progress.record(r, k1) for r in plan.ranks]
        joiner_first = max(x.compute_s for x in firsts) if all(firsts) else None
        stall = max(0.0, slow.dur_s - steady) if (slow and steady is not None) else None
        state_bytes = sum(d.bytes for d in self.left.values())
        transfer_s = max((d.transfer_s for d in self.left.values()), default=0.0)
        rec = {
            "kind": "planned", "node": plan.leavers[0], "joiner": plan.joiners[0], "plan": plan.id,
            "reason": self.reason, "switch_step": self.switch_step,
            "stall_s": rounded(stall), "steady_step_s": rounded(steady),
            "joiner_first_step_s": rounded(joiner_first),
            "phases": {
                "phase1_s": rounded(self.t_ready - self.t0) if self.t_ready else None,
                "wait_for_boundary_s": rounded(self.t_switched - self.t_ready) if self.t_ready else None,
                "switch_s": rounded(max((d.switch_s for d in self.switched.values()), default=0.0)),
                "transfer_s": rounded(transfer_s),
                "switch_step_s": rounded(slow.dur_s if slow else None),
            },
            "groups_rebuilt": len(plan.builds), "groups_kept": len(kept_ids := kept(p.topo, plan)),
            "groups_rebuilt_ids": [b.id for b in plan.builds], "groups_kept_ids": kept_ids,
            "state_bytes": state_bytes,
            "transfer_gbps": rounded(state_bytes / transfer_s / 1e9 if transfer_s > 0 else None),
            "event_to_plan_s": rounded(self.plan_wall - self.requested_wall),
            "interrupted": interrupted,
        }
        p.log.emit("swap_complete", node=rec["node"], step=k1,
              **{key: val for key, val in rec.items() if key not in ("node", "kind")})
        p.record_interruption(rec)
        self.to(S.DONE)

    def cancel(self, why: str) -> None:
        """Off before the switch: the prepared groups are dropped; the leaver is still to be drained."""
        p, plan = self.port, self.plan
        if self.state == S.SWITCHED:
            return
        if self.state == S.SWITCHING:
            # take the pending switch back; if a commit already carried it, the switch stands
            step = votes.take_back(p.store, plan.gen_from, plan.id, f"swap cancelled: {why}")
            if step is not None:
                self.on_switched(step)
                return
        self.to(S.CANCELLED)
        p.broadcast(ToWorkers(CancelPlan(plan.id, why)))
        for m in plan.moves:
            if p.nodes.nodes[m.leaver].role == Role.LEAVING:
                p.nodes.set_role(m.leaver, Role.ACTIVE, reason="swap cancelled", plan=plan.id)
                p.request_drain(m.leaver, self.request)
            if p.nodes.nodes[m.joiner].role == Role.JOINING:
                p.nodes.set_role(m.joiner, Role.STANDBY, reason="swap cancelled", plan=plan.id)
        if p.job.state == JobState.SWAPPING:
            p.job.set(JobState.RUNNING, plan=plan.id)
        p.log.emit("swap_cancelled", node=plan.leavers[0], plan=plan.id, why=why)
