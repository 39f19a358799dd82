"""`recovery.strategy: restart`: what torchrun-style elastic training does on any interruption,
kept as the baseline the benchmark measures tm_slurm against. Every worker is stopped and started
again, in place (agents and their nodes stay), all groups are rendezvoused anew, and training
resumes from a checkpoint: for a planned event one written at the next step boundary, after a
failure the newest valid periodic one (the steps since are redone). A standby takes the leaving
or failed node's slot, cold.

The same machinery shrinks the job (`standby.when_exhausted: shrink`, no standby for a lost slot):
the survivors write the last committed state, every worker exits, and the job starts again in place
with the DP replicas that lost a node dropped (their surviving nodes become standbys).

checkpointing (planned, shrink): the checkpoint is pending; workers write it and exit.
stopping:  every worker is being killed (after a failure).
starting:  new workers were launched on every node holding a slot; done when all have started.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from ..comm import vote as votes
from ..messages import Fence, GroupBuild, Move, Shutdown, ToWorkers, WriteCheckpoint
from ..planner import ShrinkPlan
from ..roles import JobState, Role
from ..topology import Topology
from ..worker import checkpoint as ckpt

if TYPE_CHECKING:
    from .core import Controller


class FullRestart:
    def __init__(self, ctl: "Controller", kind: str, moves: list[Move], reason: str, t_event: float,
                 shrink: ShrinkPlan | None = None):
        self.ctl, self.kind, self.moves, self.reason = ctl, kind, list(moves), reason
        self.shrink = shrink
        self.dp_from = ctl.cfg.layout.dp
        self.t_event = t_event
        self.t0 = time.monotonic()
        self.state = ""
        self.from_step: int | None = None
        self.aborted_step: int | None = None
        self.exit_step: int | None = None         # planned: the boundary the checkpoint was taken at
        self.path: str | None = None

    def _slot_nodes(self) -> set[str]:
        return set(self.ctl.holder.values())

    # ------------------------------------------------------------ begin
    def start_planned(self) -> None:
        ctl = self.ctl
        for m in self.moves:
            ctl.nodes.set_role(m.leaver, Role.LEAVING, reason=self.reason)
            ctl.nodes.set_role(m.joiner, Role.JOINING, reason=self.reason, slot=m.slot)
        ctl.job.set(JobState.RECOVERING, strategy="restart")
        votes.set_pending(ctl.store, ctl.gen, checkpoint=f"restart: {self.reason}", exit=True)
        ctl.log.emit("restart_planned", node=self.moves[0].leaver, reason=self.reason, kind_of="planned")
        self.state = "checkpointing"

    def start_unplanned(self, aborted_step: int) -> None:
        ctl = self.ctl
        self.aborted_step = aborted_step
        if ctl.job.state != JobState.RECOVERING:
            ctl.job.set(JobState.RECOVERING, strategy="restart")
        for m in self.moves:
            ctl.nodes.set_role(m.joiner, Role.JOINING, reason=self.reason, slot=m.slot)
        for n in self._slot_nodes() | {m.joiner for m in self.moves}:
            ctl.send(n, Fence(ctl.gen, "restart everything"))
        ctl.log.emit("restart_planned", node=self.moves[0].leaver if self.moves else None,
                     reason=self.reason, kind_of="unplanned", step=aborted_step)
        self.state = "stopping"

    def start_shrink(self, gen: int, step: int, writers: list[int]) -> None:
        """The ranks are aborted at `step` of `gen` (a recovery was collecting): checkpoint its start."""
        ctl, sp = self.ctl, self.shrink
        self.aborted_step = self.exit_step = step
        ctl.log.emit("shrink_planned", step=step, reason=self.reason, dp_from=self.dp_from,
                     dp_to=sp.layout.dp, dropped_replicas=list(sp.dropped), writers=writers,
                     freed=[n for n, x in ctl.nodes.nodes.items() if x.slot in sp.freed])
        ctl.broadcast(ToWorkers(WriteCheckpoint(gen, step, tuple(writers), f"shrink: {self.reason}")))
        self.state = "checkpointing"

    def _apply_shrink(self) -> None:
        """From here on the job is the smaller one: layout, ranks, slots, holders."""
        ctl, sp = self.ctl, self.shrink
        ctl.cfg = replace(ctl.cfg, layout=sp.layout)
        ctl.topo = Topology(sp.layout)
        ctl.holder.clear()
        ctl.progress.clear()          # its records are keyed by the old rank numbers
        for name, n in sorted(ctl.nodes.nodes.items()):
            if n.role != Role.ACTIVE:
                continue
            if n.slot in sp.freed:
                ctl.nodes.set_role(name, Role.STANDBY, reason="shrink: its DP replica was dropped")
                ctl.nodes.set_ready(name, False, why="a standby again: not warm yet")
                ctl.standby_up.pop(name, None)
                ctl.send(name, ctl._launch_msg(name))
            else:
                ctl.nodes.set_slot(name, sp.slots[n.slot], reason="shrink: ranks renumbered")
                for r in ctl.topo.slot_ranks(sp.slots[n.slot]):
                    ctl.holder[r] = name

    # ------------------------------------------------------------ progress
    def _all_exited(self) -> bool:
        live = self._slot_nodes() | {m.joiner for m in self.moves}
        ctl = self.ctl
        for n in live:
            if ctl.nodes.nodes[n].role == Role.FAILED:
                continue
            for w in ctl.workers.get(n, {}).values():
                if (n, w.local) not in ctl.exited:
                    return False
        return True

    def tick(self, now: float) -> None:
        ctl = self.ctl
        if self.state == "checkpointing":
            if self.exit_step in ctl.checkpoints_done and self._all_exited():
                self.from_step = self.exit_step
                self.path = str(ckpt.step_dir(ckpt.root(ctl.cfg, ctl.job_dir), self.from_step))
                self.relaunch()
            elif self._all_exited() and now - self.t0 > ctl.T.shutdown_s:
                # every worker is gone, its shard never came (a writer died writing it)
                ctl.log.emit("restart_failed", step=self.exit_step, why="the checkpoint to restart from is incomplete")
                ctl.stop("restart checkpoint incomplete", JobState.REQUEUED, code=ctl.requeue_code)
        elif self.state == "stopping" and (self._all_exited() or now - self.t0 > ctl.T.shutdown_s):
            found, rejected = ckpt.latest_valid(ckpt.root(ctl.cfg, ctl.job_dir), ctl.topo)
            for s, why in rejected:
                ctl.log.emit("checkpoint_rejected", step=s, why=why)
            self.from_step, self.path = (found[0], str(found[1])) if found else (0, None)
            self.relaunch()
        elif self.state == "starting" and all(r in ctl.started for r in range(ctl.topo.world)):
            self.finish()

    def relaunch(self) -> None:
        ctl = self.ctl
        gen = ctl.new_gen()
        ctl.gen = ctl.log.gen = gen
        if self.shrink is not None:
            self._apply_shrink()
        for m in self.moves:
            for r in ctl.topo.slot_ranks(m.slot):
                ctl.holder[r] = m.joiner
            if ctl.nodes.nodes[m.leaver].role == Role.LEAVING:
                ctl.nodes.set_role(m.leaver, Role.RELEASED, reason=self.reason)
                ctl.send(m.leaver, Shutdown("evacuated"))
                ctl.release(m.leaver, "evacuated (restart)")
            ctl.nodes.set_role(m.joiner, Role.ACTIVE, reason="restart", slot=m.slot)
        ctl.groups = {g.id: GroupBuild(g.id, g.members, f"r{gen}/{g.id}") for g in ctl.topo.groups}
        ctl.resume_checkpoint, ctl.start_step = self.path, self.from_step or 0
        ctl.started.clear()
        ctl.exited.clear()
        for n in sorted(set(ctl.holder.values())):
            ctl.send(n, ctl._launch_msg(n))
        self.t_launch = time.monotonic()
        self.state = "starting"

    def finish(self) -> None:
        ctl = self.ctl
        ctl.job.set(JobState.RUNNING, strategy="restart")
        lost = None if self.aborted_step is None else self.aborted_step - (self.from_step or 0) + 1
        rec = {"kind": self.kind, "node": self.moves[0].leaver if self.moves else None,
               "joiners": [m.joiner for m in self.moves], "strategy": "restart",
               "resume_step": self.from_step, "lost_steps": lost if lost is not None else 0,
               "phases": {"stop_s": round(self.t_launch - self.t0, 4),
                          "start_s": round(time.monotonic() - self.t_launch, 4)},
               "stall_s": None}
        if self.shrink is not None:
            rec.update(strategy="shrink", fallback="shrink", dp_from=self.dp_from, dp_to=ctl.cfg.layout.dp)
        ctl.log.emit("shrink_complete" if self.shrink else "restart_complete", node=rec["node"], step=self.from_step,
                     **{k: v for k, v in rec.items() if k not in ("node", "kind")})
        ctl.interruptions.append(rec)
        ctl.restart = None
