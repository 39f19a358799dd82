"""A worker's rank: what its agent assigned it, its groups (built at launch, in phase 1 of a
planned swap or for a recovery, then installed), its clients of the job's store, the optimizer
step and checkpoint of its state, and its reports; and what everything acting on it shares
(`exit_clean`, `is_link`, the user's function types). The training loop (`loop.py`), joining and
recovery (`promote.py`) and the lost-controller path (`lost.py`) all act on it.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from .. import checkpoints
from .. import config as cfgmod
from .. import faults
from ..comm.groups import Group, Reaper, bind_device, build_group, pick_backend
from ..comm.handles import GroupTable
from ..comm.nodevote import NodeVote
from ..comm.torchgroup import WorldGroup
from ..comm.torchgroup import set_rank as set_world_rank
from ..control.auth import Keys, Sealer
from ..control.wire import Wire
from ..store.client import StoreClient
from ..messages import AbortComms, Assign, GroupBuild, Launch, Prepare, SwapPlan, report
from ..topology import Topology
from . import checkpoint as ckpt
from .context import Context, make_context, torch_groups
from .inbox import Inbox
from .rng import Seeds
from .state import Rollback, TrainState

StepFn = Callable[[Context, TrainState, int], object]
BuildFn = Callable[[Context], TrainState]


SCRIPT = "_tm_slurm_script"    # set on an exception raised by the script's own code


def script(f, *a):
    """Call the script's code (its build or step function): what it raises is marked as the
    script's, for `crashed`."""
    try:
        return f(*a)
    except BaseException as e:
        setattr(e, SCRIPT, True)
        raise


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
        self.seeds = Seeds(self.device, self.cfg.seed)
        self.backend = pick_backend(self.cfg.comm.backend, self.device)
        self.iface = self.cfg.comm.interface or socket.gethostname()
        self.store = self.store_client(self.T.vote_timeout_s)
        self.table = GroupTable(self._on_comm_error, self.T.collective_timeout_s)
        self.torch_groups = torch_groups(self.topo)      # the same objects for the whole run
        self.world: WorldGroup | None = None             # the default group, where registered
        self.total_steps: int | None = None
        self.reaper = Reaper(self.device)
        self.ckpt_writer = ckpt.Writer(self.device)
        self._ckpt = None                # the background checkpoint write in flight
        self._written: int | None = None  # the step of this rank's last shard written
        self.prepared: dict[int, dict[str, Group]] = {}
        self.state: TrainState | None = None
        self.rollback: Rollback | None = None   # the training loop's, once it runs
        self.applying = False
        self.ctx: Context | None = None
        self.parked: tuple[str, TrainState] | None = None   # a standby's rehearsed (role, state)
        self.job_dir = Path(os.environ.get("TM_SLURM_JOB_DIR", "."))
        self.inbox = Inbox(wire, self.node, self._on_prepare, self._on_abort)
        self.inbox.start(self.T.heartbeat_interval_s, lambda: (self.gen, self.rank, self.step,
                                                                self.committed), self.device, self.watch)
        # the node's workers agree on each step before one of them votes for the node; they all
        # start together and meet here (beating already: a slow node-mate is not a dead one)
        self.node_vote = NodeVote(self.store, first.spawn, self.local, self.launch.local_ranks,
                                  self.T.vote_timeout_s + self.T.collective_timeout_s)

    def _device(self) -> torch.device:
        if torch.cuda.is_available() and self.cfg.comm.backend in ("auto", "nccl"):
            dev = torch.device("cuda", self.local % torch.cuda.device_count())
            torch.cuda.set_device(dev)
            return dev
        return torch.device("cpu")

    def store_client(self, timeout: float) -> StoreClient:
        """Another client of the job's store (a build that may be abandoned gets its own)."""
        return StoreClient(*self.launch.store, self.keys.store, timeout)

    def transfer_sealer(self) -> Sealer:
        """Seals or opens the manifest on a transfer link (one per transfer)."""
        return Sealer(self.keys, self.launch.job, f"{self.node}/w{self.local}")

    def report(self, kind: str, step: int | None = None, **data) -> None:
        self.inbox.send(report(kind, self.gen, self.rank, step, **data))

    def _on_comm_error(self, gid: str, e: BaseException) -> None:
        self.report("comm_error", self.step, group=gid, error=f"{type(e).__name__}: {str(e)[:300]}",
                    t=time.time())

    def _on_abort(self, msg: AbortComms) -> None:
        """The inbox's thread: a node holding `msg.ranks` failed; the training thread may be
        blocked in a collective with it (on NCCL it stays blocked until the group is aborted)."""
        if msg.gen != self.gen or self.rank is None:
            return
        hit = self.table.abort_members(msg.ranks, msg.why)
        if hit:
            self.report("comms_aborted", self.step, groups=hit, why=msg.why, t=time.time())

    def watch(self) -> None:
        """The heartbeat thread's, after each beat: a collective of the step pending for longer
        than hang_timeout_s is reported (controller/hangs.py names the member that never came)."""
        if self.rank is None:
            return
        for gid, members, waited in self.table.overdue(self.T.hang_timeout_s):
            self.report("stalled", self.step, group=gid, members=list(members), waited_s=waited)

    def context(self, rank: int, sandbox=None) -> Context:
        """`rank`'s context, this worker's torch groups bound to its table or to a `sandbox`
        table (a rehearsal, or a model built before its real groups are installed); the default
        group, where registered, says `rank` too."""
        ctx = make_context(self.topo, rank, self.table if sandbox is None else sandbox, self.device,
                           self.cfg.seed, sandbox=sandbox is not None, groups=self.torch_groups)
        if self.world is not None:
            set_world_rank(self.world, rank)
        return ctx

    def set_rank(self, rank: int) -> None:
        self.rank = rank
        self.ctx = self.context(rank)

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
        bind_device(self.device)
        mine = self.plan_builds(plan, joiner=False)
        if not mine:
            return
        t0 = time.perf_counter()
        built: dict[str, Group] = {}
        try:
            self.build(self.store_client(self.T.phase1_timeout_s), mine, out=built, plan_id=plan.id)
        except Exception as e:
            self.reaper.drop(built.values())
            self.report("prepare_failed", self.step, plan=plan.id, error=error_text(e))
            return
        if plan.id in self.inbox.cancelled:
            self.reaper.drop(built.values())
            return
        faults.at("phase1.build", self.node)
        self.prepared[plan.id] = built
        self.report("ready", self.step, plan=plan.id, build_s=time.perf_counter() - t0,
                    groups=sorted(g.id for g in built.values()))

    # ------------------------------------------------------------ state
    def apply(self, step: int) -> None:
        """The optimizer step of a committed step (only ever under a commit decision)."""
        st = self.state
        self.step_optimizer(st.optimizer, st.scheduler)
        self.committed = step

    def step_optimizer(self, optimizer, scheduler=None) -> None:
        """The runtime's step of an optimizer and its scheduler: the stock API's refuse any other
        (stock.py)."""
        self.applying = True
        try:
            if optimizer is not None:
                optimizer.step()
            if scheduler is not None:
                scheduler.step()
        finally:
            self.applying = False

    def checkpoint(self, next_step: int, reason: str, writer: bool | None = None,
                   background: bool = False) -> None:
        """Write this rank's shard, now or (`background`, replica 0's periodic ones) from a copy
        on a thread while training goes on. A write that fails (a full disk) is reported, not
        raised: the rank trains on and the previous checkpoint stays the valid one."""
        self.checkpoint_done(wait=True)          # one in flight at most
        t0 = time.perf_counter()
        root = checkpoints.root(self.cfg, self.job_dir)
        d = checkpoints.step_dir(root, next_step)
        if (self._written == next_step and writer is not False
                and (d / checkpoints.shard_name(self.topo, self.rank) / checkpoints.INDEX_SUM).exists()):
            # this rank's shard of that step is on disk already (a periodic write, then a shrink
            # at the same boundary): the state at a step's start is one state, and writing it
            # again would first remove the shard that the controller may be verifying
            self.report("checkpoint", next_step, reason=reason, path=str(d), save_s=0.0)
            return
        if background and writer is None:
            faults.at("checkpoint.periodic", self.node)
            fut = self.ckpt_writer.submit(root, next_step, self.rank, self.topo, self.state)
            if fut is not None:
                self._ckpt = (next_step, reason, t0, time.perf_counter() - t0, fut)
                return
        try:
            path = ckpt.save(root, next_step, self.rank, self.topo, self.state, writer=writer)
        except Exception as e:            # a failed write is the checkpoint's, not the rank's
            self.report("checkpoint", next_step, reason=reason, path=None,
                        save_s=time.perf_counter() - t0, error=error_text(e))
            return
        if path:
            self._written = next_step
        self.report("checkpoint", next_step, reason=reason, path=str(path) if path else None,
                    save_s=time.perf_counter() - t0)

    def checkpoint_done(self, wait: bool) -> None:
        """Report the background write once it has ended (`wait`: block until it has)."""
        if self._ckpt is None or not (wait or self._ckpt[-1].done()):
            return
        (step, reason, t0, stall, fut), self._ckpt = self._ckpt, None
        try:
            path, error = str(fut.result()), None
            self._written = step
        except Exception as e:
            path, error = None, error_text(e)
        self.report("checkpoint", step, reason=reason, path=path, save_s=time.perf_counter() - t0,
                    error=error, stall_s=stall)


def error_text(e: BaseException) -> str:
    """What a report carries of an exception: its type and message, cut to a size the event log
    keeps on one line."""
    return f"{type(e).__name__}: {e}"[:300]


def exit_clean(code: int = 0) -> None:
    """Leave without running interpreter teardown (gloo threads, the store): what had to be said
    has been said, and teardown after a failure can hang on a dead peer."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
