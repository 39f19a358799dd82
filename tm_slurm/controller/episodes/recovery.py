"""Recovery from unplanned failures (docs/design.md §4, unplanned), from detection to measured completion.

collecting: the in-flight step is aborted everywhere; wait until every surviving rank has said so
            (and which groups it saw break).
building:   Recover sent: a standby takes each lost slot, affected groups are rebuilt, donors
            (DP replicas) and joiners build transfer links. A failure here re-plans.
resumed:    everyone built their part; Resume sent; state moves; training resumes at the
            aborted step. Done when every rank has committed it again (stall measured).
waiting:    no standby yet (policy "wait"): until one is READY or the wait runs out.
stopping:   nothing can take the lost slots: the survivors checkpoint and the job ends.
shrunk:     no standby: handed over to a shrinking restart (restart.py).
failed:     no plan is possible; the job ends.
"""
from __future__ import annotations

import enum

from ... import checkpoints as ckpt
from ...messages import (Aborted, CancelPlan, Joined, Move, Recover, RecoverBuilt, RecoverFailed, Recovered,
                         Report, Resume, ToWorkers, WriteCheckpoint)
from ...planner import (PlanError, ShrinkPlan, choose_joiner, exhausted_action, kept, plan_recovery, plan_shrink,
                        recovery_needed)
from ...roles import JobState, Role
from .base import Episode, Failure, rounded
from .restart import FullRestart


class State(str, enum.Enum):
    COLLECTING = "collecting"
    WAITING = "waiting"
    BUILDING = "building"
    RESUMED = "resumed"
    STOPPING = "stopping"
    FAILED = "failed"
    SHRUNK = "shrunk"
    DONE = "done"


S = State
_DECIDED = frozenset({S.WAITING, S.BUILDING, S.STOPPING, S.FAILED, S.SHRUNK})
TRANSITIONS = {
    S.COLLECTING: _DECIDED,
    S.WAITING: _DECIDED | {S.COLLECTING},      # COLLECTING: another failure while waiting
    S.BUILDING: frozenset({S.RESUMED, S.COLLECTING}),   # COLLECTING: re-plan
    S.RESUMED: frozenset({S.DONE}),
    S.STOPPING: frozenset(),       # until the job has ended
    S.FAILED: frozenset(),
    S.SHRUNK: frozenset(),
    S.DONE: frozenset(),
}


class Recovery(Episode):
    State, TRANSITIONS, FINAL = State, TRANSITIONS, frozenset({S.DONE, S.SHRUNK})

    def __init__(self, port, gen: int, step: int, t_fail_wall: float):
        super().__init__(port, S.COLLECTING)
        self.gen, self.step = gen, step            # the aborted step, to be redone
        self.t0 = self.reabort_at = port.now()
        self.t_fail_wall = t_fail_wall
        self.failed: dict[str, dict] = {}          # node -> how it was detected
        self.aborted: dict[int, list[str]] = {}
        self.plan = None
        self.needed: frozenset = frozenset()
        self.built: dict = {}
        self.done_by: dict[tuple[str, int], Recovered | Joined] = {}
        self.t_plan = self.t_resume = None
        self.waiting_since: float | None = None
        self.fallback: str | None = None
        self.plans_tried = 0

    @classmethod
    def after_failure(cls, port, f: Failure) -> "Recovery":
        """A failure with no recovery in flight: recover the step it aborted."""
        ep = cls(port, *f.aborted, f.t)
        ep.failed[f.node] = f.info
        return ep

    def start(self) -> None:
        if self.port.job.state != JobState.RECOVERING:
            self.port.job.set(JobState.RECOVERING, step=self.step)

    # ------------------------------------------------------------ inputs
    def on_node_failed(self, f: Failure) -> bool:
        if f.aborted is None:
            return False
        if self.state == S.RESUMED:
            self.record(interrupted=True)
            return False                 # a new recovery takes it
        gen, step = f.aborted
        if gen != self.gen:
            self.gen, self.step, self.aborted = gen, step, {}
        self.failed[f.node] = f.info
        if f.node in self.port.holders:
            if self.state == S.BUILDING:
                self.replan(f"{f.node} failed during recovery")
            elif self.state == S.WAITING:
                self.to(S.COLLECTING)
        return True

    def slots(self) -> dict[str, int]:
        """Failed node -> the slot it held, for those that held one."""
        return {n: s for n in self.failed if (s := self.port.holders.slot_of(n)) is not None}

    def live_ranks(self) -> list[int]:
        return [r for r, n in self.port.holders.ranks.items() if n not in self.failed]

    def on_report(self, node: str, rep: Report) -> None:
        if isinstance(rep, Aborted) and rep.gen == self.gen and rep.rank is not None:
            self.aborted[rep.rank] = rep.broken
            self.step = min(self.step, rep.step) if len(self.aborted) > 1 else rep.step   # the ranks' word
        if self.plan is None or getattr(rep, "plan", None) != self.plan.id:
            return
        if isinstance(rep, RecoverBuilt):
            self.built[(node, rep.rank)] = rep
        elif isinstance(rep, RecoverFailed) and self.state == S.BUILDING:
            self.replan(f"{node} rank {rep.rank}: {rep.error}")
        elif isinstance(rep, (Recovered, Joined)):
            self.done_by[(node, rep.rank)] = rep

    # ------------------------------------------------------------ progress
    def tick(self, now: float) -> None:
        p, T = self.port, self.port.T
        if self.state == S.COLLECTING:
            live = self.live_ranks()
            if set(live) <= set(self.aborted):
                self.decide(now)
            elif now - self.t0 > 2 * T.collective_timeout_s + T.heartbeat_timeout_s:
                # alive (it heartbeats) yet neither aborted nor failed through a per-op timeout
                # twice over: stuck for good, fence its node
                for r in sorted(set(live) - set(self.aborted)):
                    p.fail(p.holders.ranks[r], "no_abort", rank=r)
            elif now - self.reabort_at > T.heartbeat_timeout_s:
                # a rank may sit in the vote of a step the first abort did not cover
                self.reabort_at = now
                g, _ = p.abort_in_flight("recovery: re-abort")
                if g != self.gen:
                    self.gen, self.aborted = g, {}
        elif self.state == S.WAITING:
            if choose_joiner(p.nodes.nodes.values()) is not None:
                self.decide(now)
            elif now - self.waiting_since > p.cfg.standby.wait_s:
                p.log.emit("standbys_exhausted", step=self.step, policy="wait", action="checkpoint_exit",
                      waited_s=round(now - self.waiting_since, 3))
                self.checkpoint_exit(f"no standby became ready within {p.cfg.standby.wait_s}s")
        elif self.state == S.BUILDING:
            if self.needed <= set(self.built):
                self.resume(now)
            elif now - self.t_plan > T.rebuild_timeout_s + T.heartbeat_timeout_s:
                for node, r in sorted(self.needed - set(self.built)):
                    p.fail(node, "recovery_stuck", rank=r)
        elif self.state == S.RESUMED:
            if p.progress.all_at(self.plan.resume_step, range(p.topo.world)) and \
                    all(k in self.done_by for k in self.needed):
                self.record(interrupted=False)

    def decide(self, now: float) -> None:
        p = self.port
        moves, taken = [], []
        slots = self.slots()
        for node, slot in sorted(slots.items(), key=lambda kv: kv[1]):
            j = choose_joiner(p.nodes.nodes.values(), exclude=taken)
            if j is None:
                break
            taken.append(j)
            moves.append(Move(slot, node, j))
        if len(moves) < len(slots):
            waited = 0.0 if self.waiting_since is None else now - self.waiting_since
            action = exhausted_action(p.cfg.standby.when_exhausted, waited, p.cfg.standby.wait_s,
                                      p.cfg.layout.dp)
            p.log.emit("standbys_exhausted", step=self.step, policy=p.cfg.standby.when_exhausted,
                  action=action, lost_slots=sorted(slots.values()))
            if action == "wait":
                self.to(S.WAITING)
                self.waiting_since = self.waiting_since or now
                return
            if action == "shrink":
                sp = plan_shrink(p.topo, slots.values())
                if not isinstance(sp, str):
                    return self.shrink(sp)
                p.log.emit("shrink_impossible", step=self.step, why=sp)
            self.checkpoint_exit("no standby left")
            return
        broken = {g for gs in self.aborted.values() for g in gs}
        alive = self.live_ranks()
        moving = {r for m in moves for r in p.topo.slot_ranks(m.slot)}
        needs_ckpt = any(all(x not in alive or x in moving for x in p.topo.replicas(r)) for r in moving)
        found = p.latest_checkpoint() if needs_ckpt else None
        try:
            plan = plan_recovery(p.topo, p.next_plan_id(), self.gen, p.new_gen(), moves, alive, broken,
                                 self.step, found,
                                 reason=", ".join(f"{n}: {i['how']}" for n, i in self.failed.items()))
        except PlanError as e:
            p.log.emit("recovery_impossible", step=self.step, why=str(e))
            p.stop(f"unrecoverable: {e}", JobState.FAILED, code=1)
            self.to(S.FAILED)
            return
        self.plan, self.built, self.done_by = plan, {}, {}
        self.plans_tried += 1
        self.fallback = "checkpoint" if plan.checkpoint else None
        holder = {r: n for r, n in p.holders.ranks.items() if n not in self.failed}
        self.needed = recovery_needed(p.topo, plan, holder)
        for m in moves:
            p.nodes.set_role(m.joiner, Role.JOINING, reason="recovery", plan=plan.id, slot=m.slot)
        p.log.emit("recovery_planned", step=plan.resume_step, plan=plan.id,
              moves=[[m.leaver, m.joiner, m.slot] for m in moves],
              donors={t.rank: t.src_rank for t in plan.transfers},
              groups_rebuilt=[b.id for b in plan.builds], groups_kept=len(kept(p.topo, plan)),
              fallback=self.fallback, checkpoint=plan.checkpoint)
        p.broadcast(ToWorkers(Recover(plan)))
        self.to(S.BUILDING)
        self.t_plan = p.now()

    def replan(self, why: str) -> None:
        p = self.port
        p.broadcast(ToWorkers(CancelPlan(self.plan.id, why)))
        for m in self.plan.moves:
            if p.nodes.nodes[m.joiner].role == Role.JOINING:
                p.nodes.set_role(m.joiner, Role.STANDBY, reason="recovery re-planned")
        p.log.emit("recovery_replan", step=self.step, plan=self.plan.id, why=why)
        self.plan = None
        self.to(S.COLLECTING)

    def resume(self, now: float) -> None:
        p, plan = self.port, self.plan
        p.broadcast(ToWorkers(Resume(plan.id, plan.gen_to)))
        p.adopt(plan, since=plan.resume_step)
        for m in plan.moves:
            p.nodes.set_role(m.joiner, Role.ACTIVE, reason="recovered", plan=plan.id, slot=m.slot)
        p.job.set(JobState.RUNNING, plan=plan.id)
        self.to(S.RESUMED)
        self.t_resume = now

    def record(self, interrupted: bool) -> None:
        p, plan = self.port, self.plan
        k = plan.resume_step
        walls = [p.progress.record(r, k).wall for r in range(p.topo.world)
                 if p.progress.record(r, k) is not None]
        donors = [d for d in self.done_by.values() if isinstance(d, Recovered) and d.donor]
        first = next(iter(self.failed.values()), {})
        joiner_steps = [p.progress.record(r, k) for r in plan.ranks]
        rec = {
            "kind": "unplanned", "node": next(iter(self.failed), None), "how": first.get("how"),
            "failed_nodes": sorted(self.failed), "joiners": list(plan.joiners), "plan": plan.id,
            "detect_s": first.get("detect_s"),
            "stall_s": rounded(max(walls) - self.t_fail_wall) if walls and not interrupted else None,
            "lost_steps": self.step - k + 1, "resume_step": k, "fallback": self.fallback,
            "joiner_first_step_s": rounded(max(x.compute_s for x in joiner_steps))
            if joiner_steps and all(joiner_steps) else None,
            "phases": {
                "collect_s": rounded(self.t_plan - self.t0), "build_s": rounded(self.t_resume - self.t_plan),
                "resume_s": rounded(max((d.resume_s if isinstance(d, Recovered) else d.recv_s
                                         for d in self.done_by.values()), default=None)),
                "transfer_s": rounded(max((d.transfer_s for d in donors), default=None)),
            },
            "groups_rebuilt": len(plan.builds), "groups_kept": len(kept_ids := kept(p.topo, plan)),
            "groups_rebuilt_ids": [b.id for b in plan.builds], "groups_kept_ids": kept_ids,
            "state_bytes": sum(d.bytes for d in donors), "plans_tried": self.plans_tried,
            "interrupted": interrupted,
        }
        p.log.emit("recovery_complete", node=rec["node"], step=k,
              **{key: val for key, val in rec.items() if key not in ("node", "kind")})
        p.record_interruption(rec)
        self.to(S.DONE)

    def _writers(self) -> tuple[list[int], list[str]]:
        """One live replica per checkpoint shard, and the shards that have none."""
        alive = set(self.live_ranks())
        topo = self.port.topo
        writers, missing = [], []
        for shard in ckpt.shards(topo):
            holders = sorted(r for r in alive if ckpt.shard_name(topo, r) == shard)
            (writers.append(holders[0]) if holders else missing.append(shard))
        return writers, missing

    def shrink(self, sp: ShrinkPlan) -> None:
        """No standby: go on without the DP replicas that lost a node (see restart.py)."""
        why = ", ".join(f"{n}: {i['how']}" for n, i in self.failed.items())
        self.to(S.SHRUNK)
        self.port.start(FullRestart.shrinking(self.port, sp, why, self.gen, self.step, self._writers()[0]))

    def checkpoint_exit(self, why: str) -> None:
        """Nothing can take the lost slots: the survivors write the last committed state (one live
        replica per shard) and the job ends with a status that requeues it."""
        p = self.port
        writers, missing = self._writers()
        if missing:
            p.log.emit("checkpoint_partial", step=self.step, missing_shards=missing,
                  why="no live replica; a requeued job resumes from the last complete checkpoint")
            writers = []
        p.log.emit("checkpoint_exit", step=self.step, why=why, writers=writers)
        p.broadcast(ToWorkers(WriteCheckpoint(self.gen, self.step, tuple(writers), why)))
        self.to(S.STOPPING)
        p.stop(why, JobState.REQUEUED, code=p.requeue_code, wait_workers=True)
