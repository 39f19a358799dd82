"""Recovery from unplanned failures (docs/design.md §4, unplanned), from detection to measured completion.

collecting: the in-flight step is aborted everywhere; wait until every surviving rank has said so
            (and which groups it saw break).
building:   Recover sent: a standby takes each lost slot, affected groups are rebuilt, donors
            (DP replicas) and joiners build transfer links. A failure here re-plans.
resumed:    everyone built their part; Resume sent; state moves; training resumes at the
            aborted step. Done when every rank has committed it again (stall measured).
waiting:    no standby yet (policy "wait"): until one is READY or the wait runs out.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..messages import CancelPlan, Move, Recover, Resume, ToWorkers, WriteCheckpoint
from ..planner import (PlanError, ShrinkPlan, choose_joiner, exhausted_action, plan_recovery, plan_shrink,
                       recovery_needed)
from ..roles import JobState, Role
from ..worker import checkpoint as ckpt
from .restart import FullRestart

if TYPE_CHECKING:
    from .core import Controller


class Recovery:
    def __init__(self, ctl: "Controller", gen: int, step: int, t_fail_wall: float):
        self.ctl = ctl
        self.gen, self.step = gen, step            # the aborted step, to be redone
        self.t0 = self.reabort_at = time.monotonic()
        self.t_fail_wall = t_fail_wall
        self.failed: dict[str, dict] = {}          # node -> how it was detected
        self.slots: dict[str, int] = {}            # failed node -> slot it held
        self.aborted: dict[int, list[str]] = {}
        self.plan = None
        self.needed: frozenset = frozenset()
        self.built: dict = {}
        self.done: dict = {}
        self.state = "collecting"
        self.t_plan = self.t_resume = None
        self.waiting_since: float | None = None
        self.fallback: str | None = None
        self.plans_tried = 0

    # ------------------------------------------------------------ inputs
    def add_failure(self, node: str, info: dict, slot: int | None) -> None:
        self.failed[node] = info
        if slot is not None:
            self.slots[node] = slot
        if self.state == "building":
            self.replan(f"{node} failed during recovery")
        elif self.state == "waiting":
            self.state = "collecting"

    def live_ranks(self) -> list[int]:
        return [r for r, n in self.ctl.holder.items() if n not in self.failed]

    def on_report(self, node: str, kind: str, rank, step, data: dict, gen: int) -> None:
        if kind == "aborted" and gen == self.gen and rank is not None:
            self.aborted[rank] = data.get("broken", [])
            self.step = min(self.step, step) if len(self.aborted) > 1 else step   # the ranks' word
        if self.plan is None or data.get("plan") != self.plan.id:
            return
        if kind == "recover_built":
            self.built[(node, rank)] = data
        elif kind == "recover_failed" and self.state == "building":
            self.replan(f"{node} rank {rank}: {data.get('error')}")
        elif kind in ("recovered", "joined"):
            self.done[(node, rank)] = data

    # ------------------------------------------------------------ progress
    def tick(self, now: float) -> None:
        ctl, T = self.ctl, self.ctl.T
        if self.state == "collecting":
            live = self.live_ranks()
            if set(live) <= set(self.aborted):
                self.decide(now)
            elif now - self.t0 > 2 * T.collective_timeout_s + T.heartbeat_timeout_s:
                # alive (it heartbeats) yet neither aborted nor failed through a per-op timeout
                # twice over: stuck for good, fence its node
                for r in sorted(set(live) - set(self.aborted)):
                    ctl.fail(ctl.holder[r], "no_abort", rank=r)
            elif now - self.reabort_at > T.heartbeat_timeout_s:
                # a rank may sit in the vote of a step the first abort did not cover
                self.reabort_at = now
                g, _ = ctl.abort_in_flight("recovery: re-abort")
                if g != self.gen:
                    self.gen, self.aborted = g, {}
        elif self.state == "waiting":
            if choose_joiner(ctl.nodes.nodes.values()) is not None:
                self.decide(now)
            elif now - self.waiting_since > ctl.cfg.standby.wait_s:
                ctl.log.emit("standbys_exhausted", step=self.step, policy="wait", action="checkpoint_exit",
                             waited_s=round(now - self.waiting_since, 3))
                self.checkpoint_exit(f"no standby became ready within {ctl.cfg.standby.wait_s}s")
        elif self.state == "building":
            if self.needed <= set(self.built):
                self.resume(now)
            elif now - self.t_plan > T.rebuild_timeout_s + T.heartbeat_timeout_s:
                for node, r in sorted(self.needed - set(self.built)):
                    ctl.fail(node, "recovery_stuck", rank=r)
        elif self.state == "resumed":
            if self.ctl.progress.all_at(self.plan.resume_step, range(ctl.topo.world)) and \
                    all(k in self.done for k in self.needed):
                self.finish()

    def decide(self, now: float) -> None:
        ctl = self.ctl
        moves, taken = [], []
        for node, slot in sorted(self.slots.items(), key=lambda kv: kv[1]):
            j = choose_joiner(ctl.nodes.nodes.values(), exclude=taken)
            if j is None:
                break
            taken.append(j)
            moves.append(Move(slot, node, j))
        if len(moves) < len(self.slots):
            waited = 0.0 if self.waiting_since is None else now - self.waiting_since
            action = exhausted_action(ctl.cfg.standby.when_exhausted, waited, ctl.cfg.standby.wait_s,
                                      ctl.cfg.layout.dp)
            ctl.log.emit("standbys_exhausted", step=self.step, policy=ctl.cfg.standby.when_exhausted,
                         action=action, lost_slots=sorted(self.slots.values()))
            if action == "wait":
                self.state, self.waiting_since = "waiting", self.waiting_since or now
                return
            if action == "shrink":
                sp = plan_shrink(ctl.topo, self.slots.values())
                if not isinstance(sp, str):
                    return self.shrink(sp)
                ctl.log.emit("shrink_impossible", step=self.step, why=sp)
            self.checkpoint_exit("no standby left")
            return
        broken = {g for gs in self.aborted.values() for g in gs}
        alive = self.live_ranks()
        moving = {r for m in moves for r in ctl.topo.slot_ranks(m.slot)}
        needs_ckpt = any(all(x not in alive or x in moving for x in ctl.topo.replicas(r))
                         for r in moving)
        found = None
        if needs_ckpt:
            found, rejected = ckpt.latest_valid(ckpt.root(ctl.cfg, ctl.job_dir), ctl.topo)
            for s, why in rejected:
                ctl.log.emit("checkpoint_rejected", step=s, why=why)
        ctl.plan_seq += 1
        try:
            plan = plan_recovery(ctl.topo, ctl.plan_seq, self.gen, ctl.new_gen(), moves, alive, broken,
                                 self.step, (found[0], str(found[1])) if found else None,
                                 reason=", ".join(f"{n}: {i['how']}" for n, i in self.failed.items()))
        except PlanError as e:
            ctl.log.emit("recovery_impossible", step=self.step, why=str(e))
            ctl.stop(f"unrecoverable: {e}", JobState.FAILED, code=1)
            self.state = "failed"
            return
        self.plan, self.built, self.done = plan, {}, {}
        self.plans_tried += 1
        self.fallback = "checkpoint" if plan.checkpoint else None
        holder = {r: n for r, n in ctl.holder.items() if n not in self.failed}
        self.needed = recovery_needed(ctl.topo, plan, holder)
        for m in moves:
            ctl.nodes.set_role(m.joiner, Role.JOINING, reason="recovery", plan=plan.id, slot=m.slot)
        ctl.log.emit("recovery_planned", step=plan.resume_step, plan=plan.id,
                     moves=[[m.leaver, m.joiner, m.slot] for m in moves],
                     donors={t.rank: t.src_rank for t in plan.transfers},
                     groups_rebuilt=[b.id for b in plan.builds], groups_kept=list(plan.kept),
                     fallback=self.fallback, checkpoint=plan.checkpoint)
        ctl.broadcast(ToWorkers(Recover(plan)))
        self.state, self.t_plan = "building", time.monotonic()

    def replan(self, why: str) -> None:
        ctl = self.ctl
        if self.plan is not None:
            ctl.broadcast(ToWorkers(CancelPlan(self.plan.id, why)))
            for m in self.plan.moves:
                if ctl.nodes.nodes[m.joiner].role == Role.JOINING:
                    ctl.nodes.set_role(m.joiner, Role.STANDBY, reason="recovery re-planned")
            ctl.log.emit("recovery_replan", step=self.step, plan=self.plan.id, why=why)
        self.plan, self.state = None, "collecting"

    def resume(self, now: float) -> None:
        ctl, plan = self.ctl, self.plan
        ctl.broadcast(ToWorkers(Resume(plan.id, plan.gen_to)))
        ctl.adopt(plan)
        for m in plan.moves:
            ctl.pool.holder_since[m.joiner] = plan.resume_step
        for m in plan.moves:
            ctl.nodes.set_role(m.joiner, Role.ACTIVE, reason="recovered", plan=plan.id, slot=m.slot)
        ctl.job.set(JobState.RUNNING, plan=plan.id)
        self.state, self.t_resume = "resumed", now

    def finish(self, interrupted: bool = False) -> None:
        ctl, plan = self.ctl, self.plan
        k = plan.resume_step
        walls = [ctl.progress.record(r, k).wall for r in range(ctl.topo.world)
                 if ctl.progress.record(r, k) is not None]
        donors = [d for d in self.done.values() if d.get("donor")]
        first = next(iter(self.failed.values()), {})
        joiner_steps = [ctl.progress.record(r, k) for r in plan.ranks]
        rec = {
            "kind": "unplanned", "node": next(iter(self.failed), None), "how": first.get("how"),
            "failed_nodes": sorted(self.failed), "joiners": list(plan.joiners), "plan": plan.id,
            "detect_s": first.get("detect_s"),
            "stall_s": _r(max(walls) - self.t_fail_wall) if walls and not interrupted else None,
            "lost_steps": self.step - k + 1, "resume_step": k, "fallback": self.fallback,
            "joiner_first_step_s": _r(max(x.compute_s for x in joiner_steps))
            if joiner_steps and all(joiner_steps) else None,
            "phases": {
                "collect_s": _r(self.t_plan - self.t0), "build_s": _r(self.t_resume - self.t_plan),
                "resume_s": _r(max((d.get("resume_s", d.get("recv_s", 0.0)) for d in self.done.values()),
                                   default=None)),
                "transfer_s": _r(max((d["transfer_s"] for d in donors), default=None)),
            },
            "groups_rebuilt": len(plan.builds), "groups_kept": len(plan.kept),
            "groups_rebuilt_ids": [b.id for b in plan.builds], "groups_kept_ids": list(plan.kept),
            "state_bytes": sum(d["bytes"] for d in donors), "plans_tried": self.plans_tried,
            "interrupted": interrupted,
        }
        ctl.log.emit("recovery_complete", node=rec["node"], step=k,
                     **{key: val for key, val in rec.items() if key not in ("node", "kind")})
        ctl.interruptions.append(rec)
        ctl.recovery = None

    def _writers(self) -> tuple[list[int], list[str]]:
        """One live replica per checkpoint shard, and the shards that have none."""
        alive = set(self.live_ranks())
        writers, missing = [], []
        for shard in ckpt.shards(self.ctl.topo):
            holders = sorted(r for r in alive if ckpt.shard_name(self.ctl.topo, r) == shard)
            (writers.append(holders[0]) if holders else missing.append(shard))
        return writers, missing

    def shrink(self, sp: ShrinkPlan) -> None:
        """No standby: go on without the DP replicas that lost a node (see restart.py)."""
        ctl = self.ctl
        why = ", ".join(f"{n}: {i['how']}" for n, i in self.failed.items())
        ctl.recovery = None
        ctl.restart = FullRestart(ctl, "unplanned", [], why, self.t_fail_wall, shrink=sp)
        ctl.restart.start_shrink(self.gen, self.step, self._writers()[0])

    def checkpoint_exit(self, why: str) -> None:
        """Nothing can take the lost slots: the survivors write the last committed state (one live
        replica per shard) and the job ends with a status that requeues it."""
        ctl = self.ctl
        writers, missing = self._writers()
        if missing:
            ctl.log.emit("checkpoint_partial", step=self.step, missing_shards=missing,
                         why="no live replica; a requeued job resumes from the last complete checkpoint")
            writers = []
        ctl.log.emit("checkpoint_exit", step=self.step, why=why, writers=writers)
        ctl.broadcast(ToWorkers(WriteCheckpoint(self.gen, self.step, tuple(writers), why)))
        self.state = "stopping"
        ctl.stop(why, JobState.REQUEUED, code=ctl.requeue_code, wait_workers=True)


def _r(x, nd: int = 4):
    return None if x is None else round(float(x), nd)
