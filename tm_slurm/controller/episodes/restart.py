"""`recovery.strategy: restart`: what torchrun-style elastic training does on any interruption,
kept as the baseline the benchmark measures tm_slurm against. Every worker is stopped and started
again, in place (agents and their nodes stay), all groups are rendezvoused anew, and training
resumes from a checkpoint: for a planned event one written at the next step boundary, after a
failure the newest valid periodic one (the steps since are redone). A standby takes the leaving
or failed node's slot, cold.

The same machinery shrinks the job (`standby.when_exhausted: shrink`, no standby for a lost slot):
the survivors write the last committed state, every worker exits, and the job starts again in place
with the DP replicas that lost a node dropped (their surviving nodes become standbys). FSDP without
replicas (layout.dp_shard == dp) lost a shard with its node: every worker is stopped and the
remaining DP ranks resume from the newest complete checkpoint, resharded among them.

checkpointing (planned, shrink): the checkpoint is pending; workers write it and exit.
stopping:  every worker is being killed (after a failure).
starting:  new workers were launched on every node holding a slot; done when all have started.
"""
from __future__ import annotations

import enum

from ...comm import vote as votes
from ...messages import Exiting, Fence, Move, Report, Shutdown, ToWorkers, WriteCheckpoint
from ...planner import ShrinkPlan, choose_joiner
from ...roles import JobState, Role
from .base import Episode, Failure


class State(str, enum.Enum):
    NEW = "new"
    CHECKPOINTING = "checkpointing"
    STOPPING = "stopping"
    STARTING = "starting"
    DONE = "done"
    FAILED = "failed"              # the job ends instead (requeued)


S = State
TRANSITIONS = {
    S.NEW: frozenset({S.CHECKPOINTING, S.STOPPING, S.FAILED}),
    S.CHECKPOINTING: frozenset({S.STARTING, S.FAILED}),
    S.STOPPING: frozenset({S.STARTING, S.FAILED}),
    S.STARTING: frozenset({S.DONE, S.FAILED}),
    S.DONE: frozenset(),
    S.FAILED: frozenset(),
}


class FullRestart(Episode):
    State, TRANSITIONS, FINAL = State, TRANSITIONS, frozenset({S.DONE, S.FAILED})

    def __init__(self, port, kind: str, moves: list[Move], reason: str):
        super().__init__(port, S.NEW)
        self.kind, self.moves, self.reason = kind, list(moves), reason
        self.shrink: ShrinkPlan | None = None
        self.dp_from = port.cfg.layout.dp
        self.t0 = port.now()
        self.from_step: int | None = None
        self.aborted_step: int | None = None
        self.exit_step: int | None = None         # the boundary the checkpoint is taken at
        self.path: str | None = None
        self.writers: list[int] = []             # shrink: who saves each shard
        self.gen_aborted: int | None = None

    @classmethod
    def planned(cls, port, move: Move, reason: str) -> "FullRestart":
        return cls(port, "planned", [move], reason)

    @classmethod
    def after_failure(cls, port, f: Failure) -> "FullRestart | None":
        """A failure with nothing in flight: restart everything, a standby taking its slot (None:
        no standby, the job ends to be requeued)."""
        moves = _replacement(port, f, taken=[])
        if moves is None:
            return None
        ep = cls(port, "unplanned", moves, f.how)
        ep.aborted_step = f.aborted[1]
        return ep

    @classmethod
    def shrinking(cls, port, sp: ShrinkPlan, reason: str, gen: int, step: int, writers: list[int]) -> "FullRestart":
        """The ranks are aborted at `step` of `gen` (a recovery was collecting): checkpoint its start."""
        ep = cls(port, "unplanned", [], reason)
        ep.shrink, ep.writers = sp, writers
        ep.gen_aborted, ep.aborted_step = gen, step
        return ep

    def _slot_nodes(self) -> set[str]:
        return self.port.holders.nodes()

    # ------------------------------------------------------------ begin
    def start(self) -> None:
        p = self.port
        if self.shrink is not None:
            sp = self.shrink
            self.exit_step = self.aborted_step
            p.log.emit("shrink_planned", step=self.aborted_step, reason=self.reason, dp_from=self.dp_from,
                  dp_to=sp.layout.dp, dp_shard=sp.layout.dp_shard, dropped_replicas=list(sp.dropped),
                  writers=[] if sp.from_checkpoint else self.writers, from_checkpoint=sp.from_checkpoint,
                  freed=[n for n, x in p.nodes.nodes.items() if x.slot in sp.freed])
            if sp.from_checkpoint:       # a shard is gone with its only holder: stop, reshard
                for n in self._slot_nodes():
                    p.send(n, Fence(p.gen, "shrink: resume from the checkpoint, resharded"))
                self.to(S.STOPPING)
                return
            p.broadcast(ToWorkers(WriteCheckpoint(self.gen_aborted, self.aborted_step, tuple(self.writers),
                                                  f"shrink: {self.reason}")))
            self.to(S.CHECKPOINTING)
        elif self.kind == "planned":
            for m in self.moves:
                p.nodes.set_role(m.leaver, Role.LEAVING, reason=self.reason)
                p.nodes.set_role(m.joiner, Role.JOINING, reason=self.reason, slot=m.slot)
            p.job.set(JobState.RECOVERING, strategy="restart")
            votes.set_pending(p.store, p.gen, checkpoint=f"restart: {self.reason}", exit=True)
            p.log.emit("restart_planned", node=self.moves[0].leaver, reason=self.reason, kind_of="planned")
            self.to(S.CHECKPOINTING)
        else:
            if p.job.state != JobState.RECOVERING:
                p.job.set(JobState.RECOVERING, strategy="restart")
            for m in self.moves:
                p.nodes.set_role(m.joiner, Role.JOINING, reason=self.reason, slot=m.slot)
            for n in self._slot_nodes() | {m.joiner for m in self.moves}:
                p.send(n, Fence(p.gen, "restart everything"))
            p.log.emit("restart_planned", node=self.moves[0].leaver if self.moves else None,
                  reason=self.reason, kind_of="unplanned", step=self.aborted_step)
            self.to(S.STOPPING)

    def on_report(self, node: str, rep: Report) -> None:
        if isinstance(rep, Exiting):
            self.exit_step = rep.step

    def on_node_failed(self, f: Failure) -> bool:
        if f.aborted is None:
            return False
        p = self.port
        if self.shrink is not None:
            p.log.emit("shrink_failed", node=f.node, step=f.aborted[1],
                       why=f"{f.node} failed during the shrink")
            self.to(S.FAILED)
            p.stop(f"{f.node} failed during a shrink ({f.how})", JobState.REQUEUED, code=p.requeue_code)
            return True
        if any(m.leaver == f.node for m in self.moves):
            return True                  # its slot is being handed over already
        moves = _replacement(p, f, taken=[m.joiner for m in self.moves])
        for m in moves or ():
            p.nodes.set_role(m.joiner, Role.JOINING, reason=f.how, slot=m.slot)
            self.moves.append(m)
        return True

    # ------------------------------------------------------------ progress
    def _apply_shrink(self) -> None:
        """From here on the job is the smaller one: layout, ranks, slots, holders."""
        p, sp = self.port, self.shrink
        p.reshape(sp.layout)
        by_slot = {}
        for name, n in sorted(p.nodes.nodes.items()):
            if n.role != Role.ACTIVE:
                continue
            if n.slot in sp.freed:
                p.nodes.set_role(name, Role.STANDBY, reason="shrink: its DP replica was dropped")
                p.nodes.set_ready(name, False, why="a standby again: not warm yet")
                p.forget_warmup(name)
                p.relaunch(name)
            else:
                p.nodes.set_slot(name, sp.slots[n.slot], reason="shrink: ranks renumbered")
                by_slot[sp.slots[n.slot]] = name
        p.holders.reset(p.topo, by_slot)

    def _all_exited(self) -> bool:
        p = self.port
        for n in self._slot_nodes() | {m.joiner for m in self.moves}:
            if p.nodes.nodes[n].role == Role.FAILED:
                continue
            if not all(p.has_exited(n, w) for w in p.worker_locals(n)):
                return False
        return True

    def tick(self, now: float) -> None:
        p = self.port
        if self.state == S.CHECKPOINTING:
            if p.checkpoint_done(self.exit_step) and self._all_exited():
                self.from_step = self.exit_step
                self.path = p.checkpoint_path(self.from_step)
                self.relaunch()
            elif self._all_exited() and now - self.t0 > p.T.shutdown_s:
                # every worker is gone, its shard never came (a writer died writing it)
                p.log.emit("restart_failed", step=self.exit_step,
                           why="the checkpoint to restart from is incomplete")
                self.to(S.FAILED)
                p.stop("restart checkpoint incomplete", JobState.REQUEUED, code=p.requeue_code)
        elif self.state == S.STOPPING and (self._all_exited() or now - self.t0 > p.T.shutdown_s):
            found = p.latest_checkpoint()
            self.from_step, self.path = found if found else (0, None)
            self.relaunch()
        elif self.state == S.STARTING and p.all_started():
            self.record()

    def relaunch(self) -> None:
        p = self.port
        p.enter_gen(p.new_gen(), self.from_step or 0)
        if self.shrink is not None:
            self._apply_shrink()
        for m in self.moves:
            p.holders.hold(m.slot, m.joiner)
            if p.nodes.nodes[m.leaver].role == Role.LEAVING:
                p.nodes.set_role(m.leaver, Role.RELEASED, reason=self.reason)
                p.send(m.leaver, Shutdown("evacuated"))
                p.release(m.leaver, "evacuated (restart)")
            p.nodes.set_role(m.joiner, Role.ACTIVE, reason="restart", slot=m.slot)
        p.restart_workers(self.path, self.from_step or 0)
        self.t_launch = p.now()
        self.to(S.STARTING)

    def record(self) -> None:
        p = self.port
        p.job.set(JobState.RUNNING, strategy="restart")
        lost = None if self.aborted_step is None else self.aborted_step - (self.from_step or 0) + 1
        rec = {"kind": self.kind, "node": self.moves[0].leaver if self.moves else None,
               "joiners": [m.joiner for m in self.moves], "strategy": "restart",
               "resume_step": self.from_step, "lost_steps": lost if lost is not None else 0,
               "phases": {"stop_s": round(self.t_launch - self.t0, 4),
                          "start_s": round(p.now() - self.t_launch, 4)},
               "stall_s": None}
        if self.shrink is not None:
            rec.update(strategy="shrink", fallback="shrink", dp_from=self.dp_from, dp_to=p.cfg.layout.dp)
        p.log.emit("shrink_complete" if self.shrink else "restart_complete", node=rec["node"],
                   step=self.from_step, **{k: v for k, v in rec.items() if k not in ("node", "kind")})
        p.record_interruption(rec)
        self.to(S.DONE)


def _replacement(port, f: Failure, taken: list[str]) -> list[Move] | None:
    """The move that puts a standby in the failed node's slot ([] if it held none; None and the
    job ends if no standby is left)."""
    slot = port.holders.slot_of(f.node)
    if slot is None:
        return []
    joiner = choose_joiner(port.nodes.nodes.values(), exclude=taken)
    if joiner is None:
        port.log.emit("standbys_exhausted", step=f.aborted[1], policy="restart", action="exit")
        port.stop("no standby to restart on", JobState.REQUEUED, code=port.requeue_code)
        return None
    return [Move(slot, f.node, joiner)]
