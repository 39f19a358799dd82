"""A planned migration in flight, from plan to measured completion (docs/design.md §4, planned).

preparing: Prepare sent; stayers, leaver and joiner build in the background while training runs.
switching: everyone needed is READY; the switch is pending in the store, so the next committed
           step boundary (the same on every rank) carries it.
switched:  the boundary passed (its step is in the store): the joiner holds the slot.
done:      leaver handed over and exited, joiner received the state and ran; stall measured.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..comm import vote as votes
from ..messages import CancelPlan, Prepare, Shutdown, SwapPlan, ToWorkers
from ..planner import ready_needed
from ..roles import JobState, Role

if TYPE_CHECKING:
    from .core import Controller


class PlannedSwap:
    def __init__(self, ctl: "Controller", plan: SwapPlan, request):
        self.ctl, self.plan, self.request = ctl, plan, request
        self.reason = request.reason or request.verb
        requested_wall = request.t
        self.t0 = time.monotonic()
        self.requested_wall = requested_wall      # when the event that asked for it happened
        self.plan_wall = time.time()
        self.needed = ready_needed(ctl.topo, plan, ctl.holder)
        self.ready: dict[tuple[str, int], dict] = {}
        self.t_ready: float | None = None
        self.t_switched: float | None = None
        self.switch_step: int | None = None
        self.switched: dict[int, dict] = {}
        self.left: dict[int, dict] = {}
        self.joined: dict[int, dict] = {}
        self.state = "preparing"
        self.steady_before = ctl.committed_step()
        self.stayers = [r for r in range(ctl.topo.world) if r not in plan.ranks]

    def start(self) -> None:
        ctl, plan = self.ctl, self.plan
        for m in plan.moves:
            ctl.nodes.set_role(m.leaver, Role.LEAVING, reason=self.reason, plan=plan.id)
            ctl.nodes.set_role(m.joiner, Role.JOINING, reason=self.reason, plan=plan.id, slot=m.slot)
        ctl.job.set(JobState.SWAPPING, plan=plan.id)
        ctl.log.emit("swap_planned", node=plan.leavers[0], plan=plan.id, kind_of="planned",
                     joiner=plan.joiners[0], ranks=list(plan.ranks), reason=self.reason,
                     gen_to=plan.gen_to, groups_rebuilt=[b.id for b in plan.builds],
                     groups_kept=list(plan.kept))
        ctl.broadcast(ToWorkers(Prepare(plan)))

    # ------------------------------------------------------------ reports
    def on_report(self, node: str, kind: str, rank: int | None, step, data: dict) -> None:
        if data.get("plan") != self.plan.id:
            return
        if kind == "ready":
            self.ready[(node, rank)] = data
        elif kind == "prepare_failed":
            self.cancel(f"{node} rank {rank} could not prepare: {data.get('error')}")
        elif kind == "switched":
            self.switched[rank] = data
        elif kind == "left":
            self.left[rank] = data
            if all(r in self.left for r in self.plan.ranks):
                for m in self.plan.moves:
                    self.ctl.send(m.leaver, Shutdown("evacuated"))
        elif kind == "joined":
            self.joined[rank] = dict(data, step=step)

    # ------------------------------------------------------------ progress
    def tick(self, now: float) -> None:
        ctl = self.ctl
        if self.state == "preparing":
            if self.needed <= set(self.ready):
                self.t_ready = now
                self.state = "switching"
                votes.set_pending(ctl.store, self.plan.gen_from, plan_id=self.plan.id,
                                  gen_to=self.plan.gen_to)
                ctl.log.emit("phase1_done", node=self.plan.leavers[0], plan=self.plan.id,
                             phase1_s=round(now - self.t0, 4),
                             build_s_max=round(max(d.get("build_s", 0) for d in self.ready.values()), 4))
            elif now - self.t0 > ctl.T.phase1_timeout_s:
                missing = sorted(self.needed - set(self.ready))
                self.cancel(f"phase 1 not done after {ctl.T.phase1_timeout_s}s; waiting for {missing}")
        if self.state == "switching":
            k = votes.switch_key(self.plan.id)
            if ctl.store.check([k]):
                self.on_switched(int(ctl.store.get(k)), now)
        if self.state == "switched" and self.complete():
            self.finish()

    def on_switched(self, step: int, now: float | None = None) -> None:
        """The commit of `step` carried the switch: the joiner holds the slot from step+1 on."""
        if self.state == "switched":
            return
        ctl, plan = self.ctl, self.plan
        self.state, self.switch_step = "switched", step
        self.t_switched = time.monotonic() if now is None else now
        ctl.adopt(plan)
        for m in plan.moves:
            # a joiner that died after the commit carrying the switch stays FAILED: its slot is
            # recovered like any other active node's
            if ctl.nodes.nodes[m.joiner].role != Role.FAILED:
                ctl.nodes.set_role(m.joiner, Role.ACTIVE, reason="switched", plan=plan.id, slot=m.slot)
        ctl.job.set(JobState.RUNNING, plan=plan.id)
        ctl.log.emit("switch", node=plan.leavers[0], step=step, plan=plan.id, joiner=plan.joiners[0],
                     pending_to_switch_s=round(self.t_switched - (self.t_ready or self.t0), 4))

    POST_WINDOW = 10    # steady step time is measured over the steps after the switch

    def _window(self) -> int:
        total = self.ctl.total_steps
        return max(0, min(self.POST_WINDOW, total - self.switch_step - 2)) if total else self.POST_WINDOW

    def complete(self) -> bool:
        k1 = self.switch_step + 1
        return (all(r in self.left for r in self.plan.ranks)
                and all(r in self.joined for r in self.plan.ranks)
                and self.ctl.progress.all_at(k1 + self._window(), range(self.ctl.topo.world)))

    def _measured(self) -> int:
        """Steps after the first one of the new membership that every rank has committed."""
        k1, world = self.switch_step + 1, range(self.ctl.topo.world)
        w = 0
        while w < self.POST_WINDOW and self.ctl.progress.all_at(k1 + 1 + w, world):
            w += 1
        return w

    def finish(self, interrupted: bool = False) -> None:
        """Stall = the switch step's time minus the steady step time after the swap (before it, a
        standby's warm-up may have shared the machine; on a cluster it has its own).
        `interrupted`: a failure or the job's end cut the measuring window short; the swap is
        recorded with what was measured."""
        ctl, plan = self.ctl, self.plan
        k1 = self.switch_step + 1
        w = self._measured() if interrupted else self._window()
        steady = ctl.progress.steady_between(k1 + 1, k1 + w) if w >= 3 else None
        if steady is None:
            steady = ctl.progress.steady(before=self.steady_before + 1 if self.steady_before is not None else None)
        slow = ctl.progress.slowest(k1, self.stayers) if self.stayers else None
        firsts = [ctl.progress.record(r, k1) for r in plan.ranks]
        joiner_first = max(x.compute_s for x in firsts) if all(firsts) else None
        stall = max(0.0, slow.dur_s - steady) if (slow and steady is not None) else None
        state_bytes = sum(d["bytes"] for d in self.left.values())
        transfer_s = max((d["transfer_s"] for d in self.left.values()), default=0.0)
        rec = {
            "kind": "planned", "node": plan.leavers[0], "joiner": plan.joiners[0], "plan": plan.id,
            "reason": self.reason, "switch_step": self.switch_step,
            "stall_s": _r(stall), "steady_step_s": _r(steady), "joiner_first_step_s": _r(joiner_first),
            "phases": {
                "phase1_s": _r(self.t_ready - self.t0) if self.t_ready else None,
                "wait_for_boundary_s": _r(self.t_switched - self.t_ready) if self.t_ready else None,
                "switch_s": _r(max((d.get("switch_s", 0.0) for d in self.switched.values()), default=0.0)),
                "transfer_s": _r(transfer_s),
                "switch_step_s": _r(slow.dur_s if slow else None),
            },
            "groups_rebuilt": len(plan.builds), "groups_kept": len(plan.kept),
            "groups_rebuilt_ids": [b.id for b in plan.builds], "groups_kept_ids": list(plan.kept),
            "state_bytes": state_bytes,
            "transfer_gbps": _r(state_bytes / transfer_s / 1e9 if transfer_s > 0 else None),
            "event_to_plan_s": _r(self.plan_wall - self.requested_wall),
            "interrupted": interrupted,
        }
        ctl.log.emit("swap_complete", node=rec["node"], step=k1,
                     **{key: val for key, val in rec.items() if key not in ("node", "kind")})
        ctl.interruptions.append(rec)
        ctl.swap = None

    def cancel(self, why: str) -> None:
        """Off before the switch: nothing changed for anybody; the prepared groups are dropped."""
        ctl, plan = self.ctl, self.plan
        if self.state == "switched":
            return
        if self.state == "switching":
            # take the pending switch back; if a commit already carried it, the switch stands
            ctl.store.set(votes.pending_key(plan.gen_from), "")
            k = votes.switch_key(plan.id)
            if ctl.store.check([k]):
                self.on_switched(int(ctl.store.get(k)))
                return
        self.state = "cancelled"
        ctl.broadcast(ToWorkers(CancelPlan(plan.id, why)))
        for m in plan.moves:
            if ctl.nodes.nodes[m.leaver].role == Role.LEAVING:
                ctl.nodes.set_role(m.leaver, Role.ACTIVE, reason="swap cancelled", plan=plan.id)
                ctl.intake.wanted_drains.setdefault(m.leaver, self.request)   # still to be drained
            if ctl.nodes.nodes[m.joiner].role == Role.JOINING:
                ctl.nodes.set_role(m.joiner, Role.STANDBY, reason="swap cancelled", plan=plan.id)
        if ctl.job.state == JobState.SWAPPING:
            ctl.job.set(JobState.RUNNING, plan=plan.id)
        ctl.log.emit("swap_cancelled", node=plan.leavers[0], plan=plan.id, why=why)
        ctl.swap = None


def _r(x, nd: int = 4):
    return None if x is None else round(float(x), nd)
