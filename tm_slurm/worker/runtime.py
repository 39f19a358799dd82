"""The worker side: the user's script calls `tm_slurm.run(build, step, steps)`; this module owns
the rest: its rank's groups, the step boundary (commit vote, optimizer step, planned switch,
checkpoint) and reporting. Joining and recovery live in `promote.py`.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from .. import config as cfgmod
from .. import jobdir
from ..comm import vote as votes
from ..comm.groups import Group, Reaper, build_group, pick_backend
from ..comm.handles import GroupTable
from ..comm.sealed import SealedStore
from ..control.auth import Keys, Sealer
from ..control.wire import Wire
from ..data import key
from ..events import fsync_write
from ..messages import Assign, Crashed, GroupBuild, Launch, Prepare, SwapPlan, report
from ..topology import Topology
from . import checkpoint as ckpt
from .context import Context, make_context
from .inbox import EXIT_AGENT_GONE, Inbox
from .sandbox import Recorder
from .state import TrainState, digest, nbytes, send_state

ENV_FD = "TM_SLURM_AGENT_FD"

StepFn = Callable[[Context, TrainState, int], object]
BuildFn = Callable[[Context], TrainState]


def store_client(addr: tuple[str, int], timeout: float, keys: Keys) -> SealedStore:
    return SealedStore(dist.TCPStore(addr[0], addr[1], is_master=False, wait_for_workers=False,
                                     timeout=timedelta(seconds=timeout)), keys)


def is_link(g) -> bool:
    return g.id.startswith("xfer")


class Worker:
    def __init__(self, wire: Wire, keys: Keys):
        self.keys = keys
        first = wire.recv()
        if not isinstance(first, Assign):
            raise RuntimeError(f"expected Assign from the agent, got {type(first).__name__}")
        self.launch: Launch = first.launch
        self.node, self.local = first.node, first.local
        self.cfg = cfgmod.from_dict(self.launch.config)
        self.T = self.cfg.timeouts
        self.topo = Topology(self.cfg.layout)
        self.gen = self.launch.gen
        self.rank: int | None = None
        self.step: int | None = None           # the step being worked on
        self.committed: int | None = None      # the last committed step
        self.device = self._device()
        self.backend = pick_backend(self.cfg.comm.backend, self.device)
        self.iface = self.cfg.comm.interface or socket.gethostname()
        self.store = self.store_client(self.T.vote_timeout_s)
        self.table = GroupTable(self._on_comm_error, self.T.collective_timeout_s)
        self.reaper = Reaper()
        self.prepared: dict[int, dict[str, Group]] = {}
        self.state: TrainState | None = None
        self.ctx: Context | None = None
        self.parked: tuple[str, TrainState] | None = None   # a standby's rehearsed (role, state)
        self.job_dir = Path(os.environ.get("TM_SLURM_JOB_DIR", "."))
        self._voter = ThreadPoolExecutor(1, thread_name_prefix="tm-vote")
        self.inbox = Inbox(wire, self.node, self._on_prepare)
        self.inbox.start(self.T.heartbeat_interval_s, lambda: (self.gen, self.rank, self.step,
                                                                self.committed))

    def _device(self) -> torch.device:
        if torch.cuda.is_available() and self.cfg.comm.backend != "gloo":
            dev = torch.device("cuda", self.local % torch.cuda.device_count())
            torch.cuda.set_device(dev)
            return dev
        return torch.device("cpu")

    def store_client(self, timeout: float) -> SealedStore:
        """Another client of the job's store (a build that may be abandoned gets its own)."""
        return store_client(self.launch.store, timeout, self.keys)

    def transfer_sealer(self) -> Sealer:
        """Seals or opens the manifest on a transfer link (one per transfer)."""
        return Sealer(self.keys, self.launch.job, f"{self.node}/w{self.local}")

    def report(self, kind: str, step: int | None = None, **data) -> None:
        self.inbox.send(report(kind, self.gen, self.rank, step, **data))

    def _on_comm_error(self, gid: str, e: BaseException) -> None:
        self.report("comm_error", self.step, group=gid, error=f"{type(e).__name__}: {str(e)[:300]}",
                    t=time.time())

    def set_rank(self, rank: int) -> None:
        self.rank = rank
        self.ctx = make_context(self.topo, rank, self.table, self.device, self.cfg.seed)

    # ------------------------------------------------------------ groups
    def build(self, store, builds: list[GroupBuild], joiner: bool = False,
              out: dict[str, Group] | None = None, plan_id: int | None = None) -> dict[str, Group]:
        """Build, in the job-wide order of prefixes (so no two ranks wait on each other in a
        cycle), every group of `builds` this rank belongs to, into `out` (which keeps what was
        built if a later build fails). A transfer link's sender is group rank 0 and the joiner
        group rank 1: both may hold the same global rank number."""
        out = {} if out is None else out
        abandon = None if plan_id is None else (lambda: plan_id in self.inbox.cancelled)
        for b in sorted(builds, key=lambda b: b.prefix):
            if is_link(b):
                grank = 1 if joiner else 0
            elif self.rank in b.members:
                grank = b.members.index(self.rank)
            else:
                continue
            out[b.prefix] = build_group(store, b, grank, device=self.device, backend=self.backend,
                                        timeout=self.T.collective_timeout_s,
                                        gloo_threads=self.cfg.comm.gloo_threads, iface=self.iface,
                                        abandon=abandon)
        return out

    def plan_builds(self, plan: SwapPlan, joiner: bool) -> list[GroupBuild]:
        """This rank's part of `plan`: its rebuilt groups, plus the transfer links it sends on
        (src_rank is ours; in a planned swap only the current holder, not the joiner) or
        receives on (the joiner of that rank)."""
        links = [GroupBuild(f"xfer{t.rank}", (t.src_rank, t.rank), t.prefix) for t in plan.transfers
                 if (t.rank == self.rank if joiner else t.src_rank == self.rank)]
        if not joiner and self.rank in plan.ranks:
            return links          # a leaver's rank is the joiner's in the new groups
        return [b for b in plan.builds if self.rank in b.members] + links

    def install(self, built: dict[str, Group]) -> None:
        """Swap the rebuilt groups in (a pointer change); the old instances go to the reaper."""
        self.reaper.drop(self.table.swap({g.id: g for g in built.values() if not is_link(g)}))

    def _on_prepare(self, msg: Prepare) -> None:
        if self.rank is not None:
            threading.Thread(target=self._phase1, args=(msg.plan,), name="tm-phase1", daemon=True).start()

    def _phase1(self, plan: SwapPlan) -> None:
        """Planned swap, phase 1, on a background thread while training continues: build the new
        instances of this rank's affected groups and the leaver's transfer link."""
        mine = self.plan_builds(plan, joiner=False)
        if not mine:
            return
        t0 = time.perf_counter()
        built: dict[str, Group] = {}
        try:
            self.build(self.store_client(self.T.phase1_timeout_s), mine, out=built, plan_id=plan.id)
        except Exception as e:
            self.reaper.drop(built.values())
            self.report("prepare_failed", self.step, plan=plan.id, error=f"{type(e).__name__}: {e}"[:300])
            return
        if plan.id in self.inbox.cancelled:
            self.reaper.drop(built.values())
            return
        self.prepared[plan.id] = built
        self.report("ready", self.step, plan=plan.id, build_s=time.perf_counter() - t0,
                    groups=sorted(g.id for g in built.values()))

    # ------------------------------------------------------------ start
    def start(self, build_fn: BuildFn, step_fn: StepFn) -> int:
        """Become an active rank (at launch) or warm up and park as a standby until promoted.
        Returns the first step to run."""
        from . import promote
        if self.launch.role != "ACTIVE":
            return promote.wait_as_standby(self, build_fn, step_fn)
        self.set_rank(self.launch.ranks[self.local])
        c = self.topo.coord(self.rank)
        if self.cfg.standby.sandbox and self.topo.layout.pp > 1 and c.dp == 0 and c.tp == 0:
            self.table.recorder = Recorder()      # stand-ins for standbys, from the first step
        self.state = build_fn(self.ctx)
        start = self.launch.start_step
        if self.launch.checkpoint:
            start = ckpt.load(Path(self.launch.checkpoint), self.rank, self.topo, self.state)
        t0 = time.perf_counter()
        self.install(self.build(self.store_client(self.T.admit_timeout_s),
                                list(self.launch.groups)))
        self.report("started", start, build_s=time.perf_counter() - t0, state_bytes=nbytes(self.state),
                    steps=self.total_steps)
        return start

    # ------------------------------------------------------------ the loop
    total_steps: int | None = None

    def train(self, step_fn: StepFn, steps: int, start: int) -> None:
        from . import promote
        st = self.state
        step = start
        t_prev = time.perf_counter()
        first = True
        while step < steps and self.inbox.stop_reason is None:
            self.step = step
            torch.manual_seed(key(self.cfg.seed, step, self.rank))
            t0 = time.perf_counter()
            (st.optimizer or st.model).zero_grad(set_to_none=True)
            self.table.broken.clear()
            self.table.comm_s = 0.0
            loss = step_fn(self.ctx, st, step)
            busy = time.perf_counter() - t0 - self.table.comm_s   # own work: stragglers show here
            d = self._vote(step)
            if not d.commit:
                (st.optimizer or st.model).zero_grad(set_to_none=True)
                step = promote.recover(self, step, d)
                t_prev = time.perf_counter()
                first = True
                continue
            self.apply(step)
            if self.table.recorder is not None:
                self.table.recorder.save(self.job_dir, self.ctx.pp_rank)
                self.table.recorder = None
            now = time.perf_counter()
            lv = float(loss) if isinstance(loss, (torch.Tensor, float, int)) else None
            # (step, step-to-step s, this step's own time s, loss, wall time, first after a
            # (re)start, time not spent waiting for others)
            self.inbox.progress((step, now - t_prev, now - t0, lv, time.time(), first, busy))
            t_prev, first = now, False
            step += 1
            self._boundary(step, d)
        if self.inbox.stop_reason is not None:
            self.report("stopped", step, reason=self.inbox.stop_reason)
            exit_clean()
        self._finish(step)

    def _vote(self, step: int) -> votes.Decision:
        """The commit vote runs on a thread of its own: if the controller's host dies, its store
        can hang a blocking wait for minutes, and the main thread must still hear its agent
        say so (and write the survivors' checkpoint)."""
        fut = self._voter.submit(votes.vote, self.store, self.gen, step, self.cfg.layout.world,
                                 not self.table.broken, self.T.vote_timeout_s, self.rank)
        error = None
        while True:
            try:
                return fut.result(timeout=0.05)
            except FutureTimeout:
                if self.inbox.lost_controller is not None:
                    break
            except Exception as e:        # the store connection broke: the controller is gone
                error = e
                break
        from . import lost
        lost.controller_lost(self, pending=step, error=error)

    def apply(self, step: int) -> None:
        """The optimizer step of a committed step (only ever under a commit decision)."""
        st = self.state
        if st.optimizer is not None:
            st.optimizer.step()
        if st.scheduler is not None:
            st.scheduler.step()
        self.committed = step

    def _boundary(self, next_step: int, d: votes.Decision) -> None:
        """Between two committed steps: periodic checkpoint, planned switch, requested checkpoint
        (all ranks act at the same boundary: it is part of the commit decision)."""
        every = self.cfg.checkpoint.every_steps
        if every and next_step % every == 0:
            self.checkpoint(next_step, "periodic")
        if d.switch is not None:
            self._switch(self.inbox.plans[d.switch], next_step)
        if d.checkpoint:
            self.checkpoint(next_step, d.checkpoint)
            if d.exit:
                self.report("exiting", next_step, reason=d.checkpoint)
                exit_clean()

    def _switch(self, plan: SwapPlan, next_step: int) -> None:
        """Phase 2 of a planned swap: the leaver hands its state over and goes; everyone else
        swaps the prepared groups in."""
        t0 = time.perf_counter()
        built = self.prepared.pop(plan.id, {})
        self.gen = plan.gen_to
        if self.rank in plan.ranks:
            link = next(g for g in built.values() if is_link(g))
            info = send_state(link.pg, self.state, next_step, self.transfer_sealer(), peer=1)
            self.report("left", next_step, plan=plan.id, **info)
            exit_clean()
        before = self.table.identities()
        self.install(built)
        self.report("switched", next_step, plan=plan.id, switch_s=time.perf_counter() - t0,
                    rebuilt=sorted(g.id for g in built.values()),
                    identity={gid: [before.get(gid), i] for gid, i in self.table.identities().items()})

    def checkpoint(self, next_step: int, reason: str, writer: bool | None = None) -> None:
        t0 = time.perf_counter()
        path = ckpt.save(ckpt.root(self.cfg, self.job_dir), next_step, self.rank, self.topo,
                         self.state, writer=writer)
        self.report("checkpoint", next_step, reason=reason, path=str(path) if path else None,
                    save_s=time.perf_counter() - t0)

    def _finish(self, step: int) -> None:
        dg = digest(self.state)
        out = self.job_dir / "final"
        fsync_write(jobdir.private_dir(out) / f"rank{self.rank}.sha256", (dg + "\n").encode())
        self.report("finished", step, digest=dg)
        exit_clean()


def exit_clean(code: int = 0) -> None:
    """Leave without running interpreter teardown (gloo threads, the store): what had to be said
    has been said, and teardown after a failure can hang on a dead peer."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(build: BuildFn, step: StepFn, steps: int) -> None:
    """Entry point for the user's script (see the README's porting guide)."""
    fd = os.environ.get(ENV_FD)
    if fd is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from .plain import run_plain      # launched by torchrun: plain training, no swaps
        run_plain(build, step, steps)
    if fd is None:
        raise SystemExit("this script runs under tm-slurm: `tm-slurm run --local 4+1 -- python "
                         f"{sys.argv[0]}` (or inside an sbatch job: see sbatch/train.sbatch); "
                         "under torchrun it trains without the runtime")
    # Slurm's SIGTERM (a time limit, scancel) reaches every process of the step; the controller
    # hears of it through the agent and has this rank checkpoint before SIGKILL (agent.on_sigterm)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    wire = Wire(socket.socket(fileno=int(fd)))
    boot = wire.recv_bootstrap()        # the job secret and id: from the agent, never the environment
    keys = Keys.derive(boot[:32])
    node, local = os.environ.get("TM_SLURM_NODE", ""), os.environ.get("TM_SLURM_LOCAL", "0")
    wire.sealer = Sealer(keys, boot[32:].decode(), f"{node}/w{local}", peer=node)
    try:
        w = Worker(wire, keys)
        w.total_steps = steps
        w.train(step, steps, w.start(build, step))
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        wire.send(Crashed(-1, None, None, error=traceback.format_exc()[-2000:]))
        os._exit(1)
    os._exit(EXIT_AGENT_GONE)  # unreachable: train() always exits the process
