"""The worker side: the user's script calls `tm_slurm.run(build, step, steps)`; this module starts
its rank and trains it through the step boundary (commit vote, optimizer step, planned switch,
checkpoint) to the last step. Joining and recovery live in `promote.py`, the lost-controller path
in `lost.py`, the rank itself in `rank.py`.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from .. import jobdir
from ..comm import vote as votes
from ..control.auth import Keys, Sealer
from ..control.wire import Wire
from ..events import fsync_write
from ..messages import Crashed, SwapPlan
from ..errors import MisuseError
from . import checkpoint as ckpt
from . import lost, promote
from .rank import SCRIPT, BuildFn, StepFn, Worker, exit_clean, is_link, script
from .sandbox import Recorder
from .state import Rollback, digest, nbytes, send_state

ENV_FD = "TM_SLURM_AGENT_FD"


def start(w: Worker, build_fn: BuildFn, step_fn: StepFn) -> int:
    """Become an active rank (at launch) or warm up and park as a standby until promoted.
    Returns the first step to run."""
    if w.launch.role != "ACTIVE":
        return promote.wait_as_standby(w, build_fn, step_fn)
    w.set_rank(w.launch.ranks[w.local])
    c = w.topo.coord(w.rank)
    if w.cfg.standby.sandbox and w.topo.layout.pp > 1 and c.dp == 0 and c.tp == 0:
        w.table.recorder = Recorder()      # stand-ins for standbys, from the first step
    # groups first: the user's build may already use them (DDP broadcasts rank 0's parameters)
    t0 = time.perf_counter()
    w.install(w.build(w.store_client(w.T.admit_timeout_s), list(w.launch.groups)))
    build_s = time.perf_counter() - t0
    w.state = script(build_fn, w.ctx)
    start = w.launch.start_step
    if w.launch.checkpoint:
        start = ckpt.load(Path(w.launch.checkpoint), w.rank, w.topo, w.state)
    w.report("started", start, build_s=build_s, state_bytes=nbytes(w.state), steps=w.total_steps)
    return start


def train(w: Worker, step_fn: StepFn, steps: int, start: int) -> None:
    """`tm_slurm.run`'s loop: returns when the training is over (see `training`)."""
    run = training(w, steps, start)
    try:
        step = next(run)
        while True:
            step = run.send(script(step_fn, w.ctx, w.state, step))
    except StopIteration:
        return


def training(w: Worker, steps: int, start: int) -> Iterator[int]:
    """The training loop as a generator: it yields each step to run and is sent the step's
    result (its loss, or None), whoever runs the step: `train` calls a step function, the stock
    API's `opt.step()` sends on (stock.py), so a healthy step needs no hand-off between threads.
    It returns after the last step has committed and the final state is checkpointed (`_complete`),
    so that the script's code after its loop runs; a stop ends the process instead."""
    w.watch = lost.Watch()
    w.inbox.on_lost = lambda: w.watch.take_over(w)
    st = w.state
    w.rollback = Rollback(st)
    step = start
    t_prev = time.perf_counter()
    first = True
    # the hang watchdog skips a step that a rank may enter much later than its peers: the first
    # after a (re)start, a recovery or a switch (a joiner's first step may compile)
    watched = False
    while step < steps and w.inbox.stop_reason is None:
        w.step = step
        w.seeds.step(step, w.rank)
        w.rollback.take()
        t0 = time.perf_counter()
        (st.optimizer or st.model).zero_grad(set_to_none=True)
        w.table.begin_step(step, watched=watched)
        loss = yield step
        # what the step's collectives did, not what their futures said (NCCL's complete at enqueue)
        w.table.settle(w.T.collective_timeout_s)
        busy = time.perf_counter() - t0 - w.table.comm_s   # own work: stragglers show here
        d = _vote(w, step)
        if not d.commit:
            (st.optimizer or st.model).zero_grad(set_to_none=True)
            w.rollback.restore()
            step = promote.recover(w, step, d)
            t_prev = time.perf_counter()
            first, watched = True, False
            continue
        w.apply(step)
        if w.table.recorder is not None:
            w.table.recorder.save(w.job_dir, w.ctx.pp_rank)
            w.table.recorder = None
        now = time.perf_counter()
        lv = float(loss) if isinstance(loss, (torch.Tensor, float, int)) else None
        # (step, step-to-step s, this step's own time s, loss, wall time, first after a
        # (re)start, time not spent waiting for others)
        w.inbox.progress((step, now - t_prev, now - t0, lv, time.time(), first, busy))
        t_prev, first = now, False
        step += 1
        _boundary(w, step, d)
        watched = d.switch is None
    if w.inbox.stop_reason is not None:
        w.report("stopped", step, reason=w.inbox.stop_reason)
        exit_clean()
    _complete(w, step)


def _vote(w: Worker, step: int) -> votes.Decision:
    """The commit vote, on this thread; a lost controller is handled by `lost.Watch`."""
    w.watch.enter(w, step)
    try:
        d = w.node_vote(w.store, w.gen, step, w.cfg.layout.world, not w.table.broken,
                        w.T.vote_timeout_s, w.rank)
    except Exception as e:        # the store connection broke: the controller is gone
        w.watch.leave(w, step, e)
        raise                     # unreachable: leave() does not return on an error
    w.watch.leave(w, step)
    return d


def _boundary(w: Worker, next_step: int, d: votes.Decision) -> None:
    """Between two committed steps: periodic checkpoint, planned switch, requested checkpoint
    (all ranks act at the same boundary: it is part of the commit decision)."""
    w.checkpoint_done(wait=False)
    every = w.cfg.checkpoint.every_steps
    if every and next_step % every == 0:
        w.checkpoint(next_step, "periodic", background=True)
    if d.switch is not None:
        _switch(w, w.inbox.plans[d.switch], next_step)
    if d.checkpoint:
        w.checkpoint(next_step, d.checkpoint)
        if d.exit:
            w.report("exiting", next_step, reason=d.checkpoint)
            exit_clean()


def _switch(w: Worker, plan: SwapPlan, next_step: int) -> None:
    """Phase 2 of a planned swap: the leaver hands its state over and goes; everyone else
    swaps the prepared groups in."""
    t0 = time.perf_counter()
    built = w.prepared.pop(plan.id, {})
    w.gen = plan.gen_to
    if w.rank in plan.ranks:
        link = next(g for g in built.values() if is_link(g))
        info = send_state(link.pg, w.state, next_step, w.transfer_sealer(), peer=1,
                          timeout_s=w.T.collective_timeout_s)
        w.report("left", next_step, plan=plan.id, **info)
        w.checkpoint_done(wait=True)     # a shard being written is still the job's
        exit_clean()
    before = w.table.identities()
    w.install(built)
    w.report("switched", next_step, plan=plan.id, switch_s=time.perf_counter() - t0,
             rebuilt=sorted(g.id for g in built.values()),
             identity={gid: [before.get(gid), i] for gid, i in w.table.identities().items()})


def _complete(w: Worker, step: int) -> None:
    """The loop is over: checkpoint the final state (whatever checkpoint.every_steps is: the
    script's own save after its loop is one the runtime cannot verify), write its digest, and
    leave the process to the script's code after the loop. The rank reports `finished` when that
    code has run (`_finished`, at the interpreter's exit): the controller ends the job, and so
    every process of it, only when every rank has."""
    w.table.begin_step(None)      # the script's code after its loop is not watched for hangs
    w.checkpoint(step, "final")
    w.checkpoint_done(wait=True)
    dg = digest(w.state)
    fsync_write(jobdir.private_dir(w.job_dir / "final") / f"rank{w.rank}.sha256", (dg + "\n").encode())
    atexit.register(_finished, w, step, dg)


def _finished(w: Worker, step: int, dg: str) -> None:
    w.report("finished", step, digest=dg)
    exit_clean()


def connect(how: str) -> tuple[Wire, Keys]:
    """The worker's end of its agent's socket, keyed with the job's secret. `how`: the line that
    says how this script is launched, for a script started outside tm-slurm."""
    fd = os.environ.get(ENV_FD)
    if fd is None:
        raise SystemExit(f"this script runs under tm-slurm: `tm-slurm run --local 4+1 -- python "
                         f"{sys.argv[0]}` (or inside an sbatch job: see sbatch/train.sbatch); {how}")
    # Slurm's SIGTERM (a time limit, scancel) reaches every process of the step; the controller
    # hears of it through the agent and has this rank checkpoint before SIGKILL (agent.on_sigterm)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    wire = Wire(socket.socket(fileno=int(fd)))
    boot = wire.recv_bootstrap()        # the job secret and id: from the agent, never the environment
    keys = Keys.derive(boot[:32])
    node, local = os.environ.get("TM_SLURM_NODE", ""), os.environ.get("TM_SLURM_LOCAL", "0")
    wire.sealer = Sealer(keys, boot[32:].decode(), f"{node}/w{local}", peer=node)
    return wire, keys


def crashed(wire: Wire, exc: BaseException | None = None, w: Worker | None = None,
            by_script: bool = False, step: int | None = None) -> None:
    """Tell the agent why this worker ends (`exc`, or the exception being handled), and end. The
    script is at fault, and the job ends FAILED without a recovery or a requeue (a standby or a
    rerun would fail the same way), for a misuse of the API and for any exception its own code
    raised (`by_script`, or marked by `script`), unless it comes from the network (a
    torch.distributed error) or follows a collective that failed in this step: then a node is.
    `step`: the step the script was in, where the runtime has moved on (after `opt.step()`)."""
    if exc is None:
        exc = sys.exc_info()[1]
    text = "".join(traceback.format_exception(exc))
    own = by_script or getattr(exc, SCRIPT, False)
    comm = isinstance(exc, dist.DistError) or (w is not None and bool(w.table.broken))
    fault = isinstance(exc, MisuseError) or (own and not comm and not isinstance(exc, KeyboardInterrupt))
    if not fault:
        sys.stderr.write(text)     # the script's own error is tm-slurm's to print, once (its agent logs it)
    sys.stdout.flush()
    sys.stderr.flush()
    gen, rank = (w.gen, w.rank) if w is not None else (-1, None)
    step = step if step is not None else w.step if w is not None else None
    wire.send(Crashed(gen, rank, step, error=text[-2000:], script_error=fault))
    os._exit(1)


def run(build: BuildFn, step: StepFn, steps: int) -> None:
    """Entry point for the user's script (see the README's porting guide)."""
    if os.environ.get(ENV_FD) is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from .plain import run_plain      # launched by torchrun: plain training, no swaps
        return run_plain(build, step, steps)
    wire, keys = connect("under torchrun it trains without the runtime")
    w = None
    try:
        w = Worker(wire, keys)
        w.total_steps = steps
        train(w, step, steps, start(w, build, step))
    except SystemExit:
        raise
    except BaseException:
        crashed(wire, w=w)
    # the script's code after its loop: an exception there is its own, and ends the job FAILED
    # (not with the `finished` that the interpreter's exit would report)
    sys.excepthook = lambda typ, exc, tb: crashed(wire, exc, w=w, by_script=True)
