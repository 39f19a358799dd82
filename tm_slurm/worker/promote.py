"""Becoming a rank, and staying one: a standby's promotion (planned swap or recovery) and an active
rank's recovery after an aborted step.

A plan takes effect atomically: a planned one at the boundary its commit decision names, a
recovery when the controller sends Resume after every member has built its part. Anything that
fails before that leaves each worker at its last committed generation, ready for the next plan.
"""
from __future__ import annotations

import os
import queue
import time
from pathlib import Path

from .. import faults
from ..comm import vote as votes
from ..exits import Exit
from ..messages import CancelPlan, Checkpoint, Prepare, Recover, Resume, Stop, WriteCheckpoint
from . import checkpoint as ckpt
from . import lost, sandbox
from .rank import BuildFn, StepFn, Worker, error_text, exit_clean, is_link, script
from .state import recv_state, send_state



class _Again(Exception):
    """The current promotion is off; `next` is the message to act on instead (or None)."""

    def __init__(self, nxt=None):
        super().__init__()
        self.next = nxt


def wait_as_standby(w: Worker, build_fn: BuildFn, step_fn: StepFn) -> int:
    warm = {}
    if w.cfg.standby.sandbox:
        t0 = time.perf_counter()
        warm = sandbox.rehearse(w, build_fn, step_fn, w.cfg.standby.sandbox_steps)
        warm["total_s"] = round(time.perf_counter() - t0, 3)
    faults.at("standby.warm", w.node)
    w.report("standby_ready", warm=bool(warm), sandbox=warm)
    msg = None
    while True:
        if msg is None:
            msg = w.inbox.assignments.get()
        if isinstance(msg, (Stop, Checkpoint)):
            exit_clean()                 # the job ends, or its controller is gone: nothing held here
        if (not isinstance(msg, (Prepare, Recover)) or w.node not in msg.plan.joiners
                or msg.plan.id in w.inbox.cancelled):
            msg = None
            continue
        try:
            start = _join(w, msg, build_fn)
            w.inbox.promoted = True
            return start
        except _Again as again:
            w.reaper.drop(w.table.drop(list(w.table.groups)))
            w.rank = None
            msg = again.next
            if msg is None:
                w.report("standby_ready", warm=w.parked is not None)


def _joiner_next(w: Worker, plan_id: int, block: bool):
    """The joiner's view of its inbox while a plan is in flight: Resume for `plan_id` returns it;
    a cancel, a newer plan or the end of the job calls the promotion off."""
    try:
        msg = w.inbox.assignments.get(block=block, timeout=1.0 if block else None)
    except queue.Empty:
        return None
    if isinstance(msg, Stop):
        exit_clean()
    if isinstance(msg, Resume) and msg.plan_id == plan_id:
        return msg
    if isinstance(msg, CancelPlan) and msg.plan_id == plan_id:
        raise _Again()
    if isinstance(msg, (Prepare, Recover)):
        raise _Again(msg)
    return None


def _join(w: Worker, msg: Prepare | Recover, build_fn: BuildFn) -> int:
    plan = msg.plan
    move = next(m for m in plan.moves if m.joiner == w.node)
    w.set_rank(w.topo.slot_ranks(move.slot)[w.local])
    t0 = time.perf_counter()
    if w.parked is not None and w.parked[0] == w.ctx.role:
        w.state = w.parked[1]              # the rehearsed tensors become the joiner's
        reused = True
    else:
        w.parked = None                    # free the parked role before building another
        # built as a rehearsed one is, on local groups: its state comes over the link, and its
        # real groups are not installed yet (a DDP would broadcast on them)
        w.state = script(build_fn, w.context(w.rank, sandbox=sandbox.local_table(w.topo)))
        w.set_rank(w.rank)
        reused = False
    t_model = time.perf_counter() - t0
    built: dict = {}
    try:
        w.build(w.store_client(w.T.phase1_timeout_s if isinstance(msg, Prepare)
                             else w.T.rebuild_timeout_s), w.plan_builds(plan, joiner=True), True, built, plan.id)
    except Exception as e:
        w.reaper.drop(built.values())
        w.report("prepare_failed" if isinstance(msg, Prepare) else "recover_failed", None,
                 plan=plan.id, error=error_text(e))
        raise _Again() from None
    t_groups = time.perf_counter() - t0 - t_model
    groups = sorted(g.id for g in built.values())
    if isinstance(msg, Prepare):
        faults.at("join.built", w.node)
        w.report("ready", None, plan=plan.id, build_s=t_groups, build_model_s=t_model, groups=groups)
        faults.at("join.ready", w.node)
        _wait_switch(w, plan.id)
    else:
        w.report("recover_built", None, plan=plan.id, build_s=t_groups, build_model_s=t_model,
                 groups=groups)
        while _joiner_next(w, plan.id, block=True) is None:
            pass
    t1 = time.perf_counter()
    info: dict = {}
    if plan.checkpoint:
        start = ckpt.load(Path(plan.checkpoint), w.rank, w.topo, w.state)
    else:
        link = next(g for g in built.values() if is_link(g))
        start, info = recv_state(link.pg, w.state, w.transfer_sealer(), peer=0,
                                 timeout_s=w.T.collective_timeout_s)
        w.reaper.drop([link])
    w.install(built)
    w.gen = plan.gen_to
    w.parked = None
    w.report("joined", start, plan=plan.id, build_model_s=t_model, build_s=t_groups, reused_sandbox=reused,
             wait_s=t1 - t0 - t_model - t_groups, recv_s=time.perf_counter() - t1, **info)
    faults.at("join.joined", w.node)
    return start


def _wait_switch(w: Worker, plan_id: int) -> None:
    """A planned joiner waits for the boundary the commit decision picks (written by the
    committing voter), watching its inbox for a cancel."""
    k = votes.switch_key(plan_id)
    deadline = time.monotonic() + w.T.phase1_timeout_s + w.T.vote_timeout_s
    while not w.store.check([k]):
        _joiner_next(w, plan_id, block=False)
        if time.monotonic() > deadline:
            w.report("prepare_failed", None, plan=plan_id, error="no switch within the deadline")
            raise _Again()
        time.sleep(0.002)


def recover(w: Worker, step: int, d: votes.Decision) -> int:
    """The step was aborted on every rank: report, build this rank's part of the controller's
    plan, wait for Resume, move state (as a donor) and resume where the plan says."""
    w.report("aborted", step, broken=sorted(w.table.broken), why=d.why, t=time.time())
    plan, built = None, {}
    deadline = time.monotonic() + w.T.recovery_timeout_s
    while True:
        try:
            msg = w.inbox.recoveries.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            w.report("recovery_timeout", step)
            os._exit(Exit.GAVE_UP)
        if isinstance(msg, Stop):
            exit_clean()
        if isinstance(msg, Checkpoint):
            lost.controller_lost(w, pending=None, error=None)
        if isinstance(msg, Recover) and msg.plan.gen_from == w.gen:
            w.reaper.drop(built.values())
            plan, built = msg.plan, {}
            if w.rank in plan.ranks:
                os._exit(Exit.FENCED)      # our slot was given away: this process is fenced
            t0 = time.perf_counter()
            try:
                w.build(w.store_client(w.T.rebuild_timeout_s),
                        w.plan_builds(plan, joiner=False), out=built, plan_id=plan.id)
            except Exception as e:
                w.reaper.drop(built.values())
                w.report("recover_failed", step, plan=plan.id, error=error_text(e))
                plan, built = None, {}
                continue
            faults.at("recover.build", w.node)
            w.report("recover_built", step, plan=plan.id, build_s=time.perf_counter() - t0,
                     groups=sorted(g.id for g in built.values()))
            deadline = time.monotonic() + w.T.recovery_timeout_s
        elif isinstance(msg, Resume) and plan is not None and msg.plan_id == plan.id:
            break
        elif isinstance(msg, CancelPlan) and plan is not None and msg.plan_id == plan.id:
            w.reaper.drop(built.values())
            plan, built = None, {}
        elif isinstance(msg, WriteCheckpoint) and msg.gen == w.gen:
            w.checkpoint(msg.step, msg.reason, writer=w.rank in msg.writers)
            w.report("exiting", msg.step, reason=msg.reason)
            exit_clean()
    t0 = time.perf_counter()
    w.reaper.drop(w.table.drop(b.id for b in plan.builds))
    w.install(built)
    info: dict = {}
    for g in built.values():
        if is_link(g):
            info = send_state(g.pg, w.state, plan.resume_step, w.transfer_sealer(), peer=1,
                              timeout_s=w.T.collective_timeout_s)
            w.reaper.drop([g])
    resume = plan.resume_step
    if plan.checkpoint:
        resume = ckpt.load(Path(plan.checkpoint), w.rank, w.topo, w.state)
    w.gen = plan.gen_to
    w.report("recovered", resume, plan=plan.id, resume_s=time.perf_counter() - t0,
             donor=bool(info), **info)
    return resume
