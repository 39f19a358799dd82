"""The controller's main loop: admit agents, relay plans, watch liveness, and act on events.

It is the only process that decides: which node failed, which standby replaces it, when the job
ends. Membership changes are episodes (`episodes/`), started here from intake's decisions and
from failures, driven by this loop, and reaching the controller only through `port.Port`, which
this class implements. Every state change is recorded in the event log.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable


from .. import config as cfgmod
from .. import checkpoints as ckpt
from .. import jobdir
from .. import output
from ..comm import vote as votes
from ..control import auth, codec
from ..control import mpi as mpictl
from ..events import EventLog
from ..osutil import raise_fd_limit
from ..store import process as storeserver
from ..store.client import StoreClient
from ..exits import Exit
from ..messages import (AbortComms, Aborted, AgentBye, Fence, GroupBuild, Heartbeat, Launch, Output, Ping, Report,
                        Shutdown, Signalled, SwapPlan, ToWorkers, WorkerExited, WorkerReport, WorkerSuspect)
from ..planner import initial_builds, plan_planned
from ..roles import JobState, JobStatus, NodeTable, Role
from ..topology import Topology
from .admission import Admission
from .episodes.base import Episode, Failure
from .episodes.ending import Ending
from .episodes.recovery import Recovery
from .episodes.restart import FullRestart
from .episodes.swap import PlannedSwap
from .holders import Holders
from .liveness import controller_cut_off
from .intake import Decision, Fail, Intake, Migrate, ReleaseStandby, Stop, TakeCheckpoint
from .hangs import Hangs
from .pool import Pool
from .progress import CommittedMin, Progress, keep_for
from .records import Records
from .releases import Releases
from .votekeys import VoteKeys
from . import workers
from .reports import ON_REPORT
from .requests import Inbox as RequestInbox, Request, slurm_user_uid

LINKS_EVERY_S = 0.05      # how often the loop looks at every link's silence and breakage


class Controller:
    def __init__(self, cfg: cfgmod.Config, *, job_id: str, job_dir: Path, command: list[str],
                 cwd: str, env: dict[str, str], nodes: list[str], standbys: int, launcher,
                 store_host: str = "127.0.0.1", watcher=None, resume_checkpoint: str | None = None,
                 on_tick: Callable[["Controller"], None] | None = None, secret: bytes | None = None):
        cfg.check_nodes(len(nodes), standbys)
        if len(set(nodes)) != len(nodes):
            raise cfgmod.ConfigError(f"node names must be unique, got {nodes}")
        self.cfg, self.T = cfg, cfg.timeouts
        self.topo = Topology(cfg.layout)
        self.job_id, self.job_dir = job_id, jobdir.make_private(job_dir)
        self.keys = auth.Keys.derive(secret or auth.new_secret())
        self.command, self.cwd, self.env = list(command), cwd, dict(env)
        self.launcher, self.watcher = launcher, watcher
        self.store_host = store_host
        self.on_tick = on_tick
        self.log = EventLog(jobdir.events_file(self.job_dir), job_id)
        self.console = output.Console(jobdir.log_dir(self.job_dir))     # the ranks' output, for the user
        self.nodes = NodeTable(self.log)
        self.job = JobStatus(self.log)
        n_active = len(nodes) - standbys
        for i, n in enumerate(nodes[:n_active]):
            self.nodes.add(n, Role.ACTIVE, slot=i)
        for n in nodes[n_active:]:
            self.nodes.add(n, Role.STANDBY)
        self.holders = Holders(self.topo, dict(enumerate(nodes[:n_active])))
        self.gen = 0
        self._gen_seq = 0
        self.plan_seq = 0
        self.groups = {b.id: b for b in initial_builds(self.topo)}
        self.channels: dict[str, mpictl.Channel] = {}
        self.last_hb: dict[str, float] = {}
        self.workers: dict[str, dict[int, workers.Seen]] = {}
        self.started: set[int] = set()
        self.standby_up: dict[str, set[int]] = {}
        self.progress = Progress(keep_for(self.topo.world))
        self._committed = CommittedMin(self.progress)
        self.finished: dict[int, str] = {}
        self.exited: set[tuple[str, int]] = set()
        self.episodes: list[Episode] = []        # in the order they started
        self.interruptions: list[dict] = []
        self.checkpoints_done: set[int] = set()
        self.resume_checkpoint = resume_checkpoint
        self.start_step = 0
        self.total_steps: int | None = None
        self.requeue_code = int(Exit.REQUEUE)
        self.exit_code: int | None = None
        self._agents_gone: set[str] = set()
        allowed = {os.getuid(), 0} | ({u} if (u := slurm_user_uid()) is not None else set())
        self.requests = RequestInbox(self.job_dir, allowed)
        self.records = Records(self)
        self.releases = Releases(launcher, self.log.emit, cfg.slurm.release_nodes)
        self.time_limit_signal = False
        self.signals: list[int] = []     # received, not yet acted on (a node's SIGTERM too: Signalled)
        self.requeue_wanted = True       # a REQUEUED end runs again, unless a signal said otherwise
        self.intake = Intake(self.log.emit)
        self.pool = Pool(self)
        self.hangs = Hangs(self.T.heartbeat_timeout_s)
        # when the main loop next pings, writes status.json, reads requests, checks every link;
        # until when it is busy
        self._loop = {"last": time.monotonic(), "ping": 0.0, "status": 0.0, "req": 0.0,
                      "links": 0.0, "busy_until": 0.0, "ping_seq": 0}

    # ------------------------------------------------------------ episodes
    def live(self) -> list[Episode]:
        self.episodes = [e for e in self.episodes if not e.done]
        return self.episodes

    def find(self, kind: type) -> Episode | None:
        return next((e for e in self.live() if isinstance(e, kind)), None)

    @property
    def ending(self) -> Ending | None:
        return self.find(Ending)

    def start(self, episode: Episode) -> None:
        self.episodes.append(episode)
        episode.start()

    def busy(self) -> bool:
        return bool(self.live())

    # ------------------------------------------------------------ the port (see port.py)
    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def new_gen(self) -> int:
        self._gen_seq += 1
        return self._gen_seq

    def enter_gen(self, gen: int, first_step: int) -> None:
        self.gen = self.log.gen = gen
        self.vote_keys.enter(gen, first_step)
        for ch in self.channels.values():
            ch.sealer.gen = gen

    def next_plan_id(self) -> int:
        self.plan_seq += 1
        return self.plan_seq

    def committed_step(self) -> int | None:
        return self._committed.get(self.holders)

    def send(self, node: str, msg) -> None:
        ch = self.channels.get(node)
        if ch is not None and not ch.dead:
            ch.send(msg)

    def broadcast(self, msg) -> None:
        enc = codec.prepare(msg)
        for n in list(self.channels):
            self.send(n, enc)

    def adopt(self, plan: SwapPlan, since: int, first_step: int | None = None) -> None:
        """A plan took effect: new generation (its ranks vote from `first_step`, by default
        `since`), new slot holders (from step `since`), new group instances."""
        self.enter_gen(plan.gen_to, since if first_step is None else first_step)
        for m in plan.moves:
            self.holders.hold(m.slot, m.joiner, since)
        for b in plan.builds:
            self.groups[b.id] = b

    def request_drain(self, node: str, request: Request) -> None:
        self.intake.want_drain(node, request)

    def record_interruption(self, rec: dict) -> None:
        self.interruptions.append(rec)

    def worker_locals(self, node: str) -> list[int]:
        return list(self.workers.get(node, {}))

    def has_exited(self, node: str, local: int) -> bool:
        return (node, local) in self.exited

    def all_started(self) -> bool:
        return all(r in self.started for r in range(self.topo.world))

    def agents_alive(self) -> list[str]:
        return [n for n in self.channels if n not in self._agents_gone]

    def set_exit_code(self, code: int) -> None:
        self.exit_code = code

    def checkpoint_done(self, step: int) -> bool:
        return step in self.checkpoints_done

    def checkpoint_path(self, step: int) -> str:
        return str(ckpt.step_dir(ckpt.root(self.cfg, self.job_dir), step))

    def latest_checkpoint(self) -> tuple[int, str] | None:
        found, rejected = ckpt.latest_valid(ckpt.root(self.cfg, self.job_dir), self.topo)
        for s, why in rejected:
            self.log.emit("checkpoint_rejected", step=s, why=why)
        return (found[0], str(found[1])) if found else None

    def reshape(self, layout: cfgmod.Layout) -> None:
        self.cfg = replace(self.cfg, layout=layout)
        self.topo = Topology(layout)
        self.progress.clear()          # its records are keyed by the old rank numbers

    def relaunch(self, node: str) -> None:
        self.send(node, self._launch_msg(node))

    def forget_warmup(self, node: str) -> None:
        self.standby_up.pop(node, None)

    def restart_workers(self, checkpoint: str | None, start_step: int) -> None:
        """Every slot's node starts its workers anew, on fresh groups, from `checkpoint`."""
        self.groups = {g.id: GroupBuild(g.id, g.members, f"r{self.gen}/{g.id}") for g in self.topo.groups}
        self.resume_checkpoint, self.start_step = checkpoint, start_step
        self.started.clear()
        self.exited.clear()
        for n in sorted(self.holders.nodes()):
            self.relaunch(n)

    # ------------------------------------------------------------ setup
    def open_store(self) -> None:
        self.store_server = storeserver.spawn(self.keys.store, self.store_host)
        self.store_addr = self.store_server.addr
        self.store = StoreClient(*self.store_addr, self.keys.store, self.T.vote_timeout_s)
        self.vote_keys = VoteKeys(self.store, self.gen, self.start_step)

    def _open(self) -> None:
        if self.resume_checkpoint:
            self.start_step = int(Path(self.resume_checkpoint).name.removeprefix("step"))
        self.open_store()
        jobdir.control_dir(self.job_dir)
        self.port = mpictl.Port(jobdir.port_file(self.job_dir))
        self.admission = Admission(self.port, self.keys, self.job_id, jobdir.join_dir(self.job_dir),
                                   self.T.auth_timeout_s, self.log.emit)
        if (granted := jobdir.grant_slurm_user(self.job_dir, slurm_user_uid())) is not None:
            self.log.emit("job_dir_access", slurm_user_uid=granted[0], acl=granted[1])
        self.log.emit("job_start", nodes=sorted(self.nodes.nodes), pid=os.getpid(),
                      layout=cfgmod.to_dict(self.cfg)["layout"], command=self.command,
                      store=list(self.store_addr), resume_from=self.resume_checkpoint,
                      start_step=self.start_step)
        self.t_start = time.monotonic()

    def _launch_msg(self, node: str) -> Launch:
        n = self.nodes.nodes[node]
        ranks = self.topo.slot_ranks(n.slot) if n.role == Role.ACTIVE else ()
        return Launch(job=self.job_id, gen=self.gen, role=n.role.value, slot=n.slot, ranks=ranks,
                      local_ranks=self.cfg.layout.ranks_per_node, command=tuple(self.command),
                      cwd=self.cwd, env=tuple(self.env.items()), config=cfgmod.to_dict(self.cfg),
                      store=self.store_addr, groups=tuple(self.groups.values()),
                      start_step=self.start_step, checkpoint=self.resume_checkpoint)

    def _admit(self) -> None:
        """Agents that proved they belong to the job (controller/admission.py) get their Launch."""
        for ch, hello in self.admission.poll():
            node = hello.node
            if node not in self.nodes.nodes and self.pool.joined(node):
                self.nodes.add(node, Role.STANDBY)   # a companion job's node: a new standby
                self.log.emit("standby_joined", node=node, host=hello.host)
            n = self.nodes.nodes.get(node)
            if n is None or n.role in (Role.FAILED, Role.RELEASED) or node in self.channels:
                self.log.emit("agent_refused", node=node, why="not an expected node of this job")
                ch.send(Shutdown("refused", graceful=False))
                continue
            self.channels[node] = ch
            self.last_hb[node] = time.monotonic()
            self.launcher.admitted(node, hello)
            self.nodes.set_host(node, hello.host)
            self.log.emit("agent_admitted", node=node, host=hello.host, pid=hello.pid,
                          since_start_s=round(time.monotonic() - self.t_start, 3))
            ch.send(self._launch_msg(node))
            if n.role == Role.STANDBY and not self.cfg.standby.prestart:
                self.nodes.set_ready(node, warm=False, cold=True)

    # ------------------------------------------------------------ messages
    def _dispatch(self, node: str, m) -> None:
        if isinstance(m, Heartbeat):
            self.last_hb[node] = time.monotonic()
            self.workers[node] = workers.merge(self.workers.get(node), m)
            if m.records:
                self.records.steps(self.progress.add_rows(m.records, self.topo.world))
        elif isinstance(m, WorkerReport):
            self.last_hb[node] = time.monotonic()
            self._report(node, m.local, m.report)
        elif isinstance(m, Output):
            self.console.show(m)
        elif isinstance(m, WorkerExited):
            self._worker_exited(m)
        elif isinstance(m, WorkerSuspect):
            self.fail(node, "worker_silent", rank=m.rank, silent_s=round(m.silent_s, 3))
        elif isinstance(m, AgentBye):
            self._agent_gone(node, m.reason)
        elif isinstance(m, Signalled):
            # Slurm signals the steps, not a controller on a login host: the job's time limit
            self.log.emit("node_signalled", node=node, signal=m.signal)
            self.signals.append(signal.Signals.__members__.get(m.signal, signal.SIGTERM))

    def _report(self, node: str, local: int, rep: Report) -> None:
        handler = ON_REPORT.get(type(rep))
        if handler is not None:
            handler(self, node, local, rep)
        for ep in list(self.live()):
            ep.on_report(node, rep)
        if (isinstance(rep, Aborted) and self.cfg.recovery.strategy != "restart"
                and not any(isinstance(e, (Recovery, FullRestart, Ending)) for e in self.live())):
            # a rank aborted a step on its own (it saw a collective fail); who failed is decided
            # by the detectors below, but the recovery starts collecting now (a restart needs
            # nothing collected: it stops every worker)
            rec = Recovery(self, rep.gen, rep.step, rep.t)
            self.start(rec)
            rec.on_report(node, rep)

    def _worker_exited(self, m: WorkerExited) -> None:
        self.exited.add((m.node, m.local))
        n = self.nodes.nodes[m.node]
        expected = (self.ending is not None or self.find(FullRestart) is not None
                    or n.role in (Role.LEAVING, Role.RELEASED, Role.FAILED)
                    or (m.rc == 0 and m.rank in self.finished))
        self.log.emit("worker_exit", node=m.node, rank=m.rank, rc=m.rc, pid=m.pid, expected=expected)
        if not expected:
            self.fail(m.node, "worker_exit", rank=m.rank, rc=m.rc)

    def _agent_gone(self, node: str, why: str) -> None:
        if node in self._agents_gone:
            return
        self._agents_gone.add(node)
        ch = self.channels.get(node)
        if ch is not None:
            ch.abandon()
        n = self.nodes.nodes[node]
        if n.role == Role.LEAVING and node not in self.holders:
            # a leaver whose ranks have moved on (its swap switched): its node goes back to Slurm
            self.nodes.set_role(node, Role.RELEASED, reason="evacuated")
            self.release(node, why)
        elif n.role in (Role.ACTIVE, Role.STANDBY, Role.JOINING, Role.LEAVING) and self.ending is None:
            self.fail(node, "agent_exit", why=why)

    def release(self, node: str, why: str) -> None:
        self.releases.submit(node, why)

    # ------------------------------------------------------------ decisions
    def _apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            if isinstance(d, Fail):
                self.fail(d.node, d.how, **d.detail)
            elif isinstance(d, Stop):
                self.abort_and_stop(d.why)
            elif isinstance(d, ReleaseStandby):
                self.send(d.node, Shutdown(f"drained: {d.reason}"))
                self.nodes.set_role(d.node, Role.RELEASED, reason=f"drained standby: {d.reason}")
                self.release(d.node, "standby drained")
            elif isinstance(d, Migrate):
                req = d.request
                if self.cfg.recovery.strategy == "restart":
                    self.start(FullRestart.planned(self, d.move, req.reason or "drain"))
                else:
                    plan = plan_planned(self.topo, self.next_plan_id(), self.gen, self.new_gen(), [d.move],
                                        reason=req.reason or req.verb)
                    self.start(PlannedSwap(self, plan, req))
            elif isinstance(d, TakeCheckpoint):
                votes.set_pending(self.store, self.gen, checkpoint=d.reason or "requested", exit=d.exit)
                self.log.emit("checkpoint_requested", reason=d.reason, exit=d.exit)
                if d.exit:
                    self.stop(d.reason or "checkpoint and exit", JobState.REQUEUED, code=self.requeue_code,
                              wait_workers=True)

    def _drive_intake(self) -> None:
        """Start what was asked for, one thing at a time, only while training runs."""
        if not self.busy() and self.job.state == JobState.RUNNING and self.committed_step() is not None:
            self._apply(self.intake.next(self.nodes.nodes))

    def handle_request(self, r: Request) -> None:
        self._apply(self.intake.handle(r, self.nodes.nodes))

    def _poll_watcher(self) -> None:
        held = [n for n, x in self.nodes.nodes.items() if x.role not in (Role.FAILED, Role.RELEASED)]
        self._apply(self.intake.watcher(*self.watcher.poll(held), self.nodes.nodes))

    # ------------------------------------------------------------ failures
    def injected_at(self, node: str) -> float | None:
        p = jobdir.control_dir(self.job_dir) / f"injected-{node}.json"
        try:
            return float(json.loads(p.read_text())["t"])
        except (OSError, ValueError, KeyError):
            return None

    def fail(self, node: str, how: str, **detail) -> None:
        """The one place a node is declared failed: fence it, abort the step if it held (or was
        about to hold) ranks, and hand it to the episodes in flight, or to a new recovery."""
        n = self.nodes.nodes.get(node)
        if n is None or n.role in (Role.FAILED, Role.RELEASED):
            return
        t_detect = time.time()
        t_fail = self.injected_at(node)
        self.launcher.kill(node)
        self.send(node, Fence(self.gen, how))
        ch = self.channels.get(node)
        if ch is not None:
            ch.abandon()
        involved = node in self.holders or any(e.involves(node) for e in self.live())
        self.nodes.set_role(node, Role.FAILED, reason=how, **detail)
        info = {"how": how, "detect_s": round(t_detect - t_fail, 4) if t_fail else None, **detail}
        self.log.emit("failure_detected", node=node, gen=self.gen, **info)
        self.release(node, f"failed: {how}")
        if self.job.state == JobState.STARTING and involved:
            self.stop(f"{node} failed before training started ({how})", JobState.FAILED, code=Exit.FAILED)
            return
        f = Failure(node, how, info, t_fail or t_detect)
        if self.ending is None and involved:
            f.aborted = self.abort_in_flight(f"{node} failed ({how})")
            # ... and release whoever waits on it inside a collective (NCCL: until aborted)
            # (a failed node keeps its slot in `holders` until a plan gives it away)
            slot = self.holders.slot_of(node)
            ranks = tuple(self.topo.slot_ranks(slot)) if slot is not None else ()
            if ranks:
                self.broadcast(ToWorkers(AbortComms(self.gen, ranks, f"{node} failed ({how})")))
        for ep in list(self.live()):
            if ep.on_node_failed(f):
                return
        if f.aborted is None:
            return
        ep = (FullRestart if self.cfg.recovery.strategy == "restart" else Recovery).after_failure(self, f)
        if ep is not None:
            self.start(ep)

    def abort_in_flight(self, why: str) -> tuple[int, int]:
        """Abort whatever step the ranks are in (see vote.abort_in_flight for the range)."""
        working = [w.step for ws in self.workers.values() for w in ws.values()
                   if w.rank is not None and w.step is not None]
        lo = (self.committed_step() or -1) + 1
        return votes.abort_in_flight(self.store, self.gen, lo, max(working, default=lo) + 1, why)

    def _check_liveness(self, now: float) -> None:
        if self.ending is not None:
            return                     # agents are going away on purpose
        for node, rc in self.launcher.poll():
            self._last_words(node)
            self._agent_gone(node, f"agent process ended rc={rc}")
        # a pass over every link: not every tick (1,025 of them at 1,024 nodes, 50 ticks a
        # second); silence is timed in seconds and a broken link was already seen by a send
        if now < self._loop["links"]:
            return
        self._loop["links"] = now + LINKS_EVERY_S
        silence = {n: now - self.last_hb.get(n, now) for n, ch in self.channels.items()
                   if not ch.dead and n not in self._agents_gone}
        if lost := controller_cut_off(silence, self.T.heartbeat_timeout_s):
            self.cut_off(lost, len(silence))
            return
        for node, ch in list(self.channels.items()):
            if ch.broken and node not in self._agents_gone:
                self.fail(node, "link_broken")
            if ch.dead or node in self._agents_gone:
                continue
            silent = silence[node]
            if silent > self.T.heartbeat_timeout_s:
                self.fail(node, "heartbeat_timeout", silent_s=round(silent, 3))

    def cut_off(self, lost: list[str], live: int) -> None:
        """This controller lost most of its agents at once: it is the one cut off (liveness.py).
        status.json goes still so that the agents see it gone; they checkpoint and the lowest
        survivor requeues the job, so this side neither fails nodes nor requeues."""
        self.records.status_frozen = True
        self.requeue_wanted = False
        self.log.emit("controller_cut_off", lost=lost, live=live)
        self.stop(f"controller cut off from {len(lost)} of {live} nodes: the nodes checkpoint "
                  "and requeue the job", JobState.REQUEUED, code=self.requeue_code)

    def _last_words(self, node: str) -> None:
        """Read what an agent sent before its process ended: the exit is often seen before its
        last messages (its workers' exits, its bye) have been polled. A leaver always says bye,
        so for it wait briefly; anyone else may have died without a word."""
        ch = self.channels.get(node)
        n = self.nodes.nodes.get(node)
        if ch is None or n is None:
            return
        end = time.monotonic() + (0.5 if n.role == Role.LEAVING else 0.0)
        while not ch.dead and node not in self._agents_gone:
            msgs = ch.poll()
            for m in msgs:
                self._dispatch(node, m)
            if not msgs:
                if time.monotonic() >= end:
                    return
                time.sleep(0.002)

    # ------------------------------------------------------------ stopping
    def abort_and_stop(self, why: str) -> None:
        self.abort_in_flight(why)
        self.stop(why, JobState.FAILED if why.startswith("unrecoverable") else JobState.FINISHED,
                  code=Exit.FAILED)

    def _on_signal(self, sig) -> None:
        """The first SIGUSR1, SIGTERM or SIGINT checkpoints at the next step boundary and ends
        resumable; a second SIGINT stops at once (the last valid checkpoint stays)."""
        why = {"SIGINT": "interrupted (SIGINT)"}.get(sig.name, f"time limit ({sig.name})")
        if not self.time_limit_signal:
            self.time_limit_signal = True
            # only sbatch --signal=B:USR1@T asks to run again: Slurm 22.05's SIGTERM at a time
            # limit looks the same as scancel's (JobState COMPLETING), and a cancelled job that
            # requeues itself is worse than a timed-out one resumed by hand (--resume)
            self.requeue_wanted = sig == signal.SIGUSR1
            self.log.emit("signal", signal=sig.name, action="checkpoint_exit", requeue=self.requeue_wanted)
            self.handle_request(Request("checkpoint", None, why, time.time(), os.getuid(), "", {"exit": True}))
        elif sig == signal.SIGINT:
            self.log.emit("signal", signal=sig.name, action="stop_now")
            self.intake.wanted_checkpoint = None
            if self.ending is None:
                self.stop("interrupted twice (SIGINT): stopped at once", JobState.REQUEUED, code=self.requeue_code)
            else:
                self.ending.wait_workers = False
        else:
            self.log.emit("signal", signal=sig.name, action="already_ending")

    def stop(self, why: str, final: JobState, code: int, wait_workers: bool = False) -> None:
        if self.ending is not None:
            return
        for ep in list(self.live()):
            ep.finish(why)
        self.start(Ending(self, why, final, int(code), wait_workers))

    # ------------------------------------------------------------ loop
    def tick(self) -> bool:
        """One pass of the main loop (bench/controlplane.py drives it too); true while busy, when
        the loop polls every millisecond instead of every 20."""
        L, now = self._loop, time.monotonic()
        if now - L["last"] > 0.5:
            self.log.emit("controller_stall", stall_s=round(now - L["last"], 3))
        L["last"] = now
        if self.job.state == JobState.STARTING or now >= L["req"]:
            if self.admission.announced():
                self._admit()
        for node in mpictl.arrived(self.channels):
            if (ch := self.channels.get(node)) is None:
                continue                    # gone by what an earlier link said this pass
            for m in ch.poll():
                if not isinstance(m, Heartbeat):
                    L["busy_until"] = now + mpictl.BUSY_FOR_S
                self._dispatch(node, m)
            if ch.refused:
                self.admission.refused(node, ch.refused_why)
        if self.job.state == JobState.STARTING and now - self.t_start > self.T.admit_timeout_s:
            missing = sorted(set(self.nodes.nodes) - set(self.channels))
            self.log.emit("start_timeout", missing_agents=missing)
            self.stop(f"not every node started within {self.T.admit_timeout_s}s: {missing}",
                      JobState.FAILED, code=Exit.FAILED)
        self._check_liveness(now)
        if now >= L["req"]:
            self._apply(self.intake.requests(*self.requests.poll(), self.nodes.nodes))
            L["req"] = now + 0.05
        if self.watcher is not None:
            self._poll_watcher()
        while self.signals:
            self._on_signal(signal.Signals(self.signals.pop(0)))
        for ep in list(self.live()):
            ep.tick(now)
        self.pool.check_stragglers(now)
        for node, group, waiting in self.hangs.due(now, self.gen, self.holders.ranks.get):
            self.fail(node, "hung", group=group, waiting_ranks=waiting)
        self.vote_keys.sweep(self.committed_step())
        self.records.poll_checkpoints()
        self.releases.poll()
        self._drive_intake()
        self.pool.replenish()
        if self.on_tick is not None:
            self.on_tick(self)
        if now >= L["ping"]:
            L["ping_seq"] += 1
            self.broadcast(Ping(L["ping_seq"], time.time()))
            L["ping"] = now + self.T.ping_interval_s
        if now >= L["status"]:
            self.records.write_status(now)
            L["status"] = now + jobdir.STATUS_EVERY_S
        return (now < L["busy_until"] or self.busy()
                or self.job.state in (JobState.STARTING, JobState.STOPPING))

    def run(self) -> int:
        raise_fd_limit()
        self._open()
        # sbatch --signal=B:USR1@T, SIGTERM (a time limit without --signal: KillWait before
        # SIGKILL) and the first SIGINT (Ctrl-C): checkpoint at the next step boundary and end
        # resumable. A second SIGINT stops at once; the last valid checkpoint stays.
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda s, _: self.signals.append(s))
        if self.watcher is not None:
            self.watcher.start()
        try:
            for n in sorted(self.nodes.nodes):
                self.launcher.start(n)
            self._loop["last"] = time.monotonic()
            while self.exit_code is None:
                busy = self.tick()
                time.sleep(mpictl.POLL_BUSY_S if busy else mpictl.POLL_IDLE_S)
        except Exception:
            import traceback
            self.log.emit("controller_error", error=traceback.format_exc()[-3000:])
            self.exit_code = int(Exit.FAILED)
            raise
        finally:
            self.releases.close(self.T.fence_grace_s)
            self.records.write_status()
            self.records.write_result()
            self.log.emit("job_end", state=self.job.state.value, exit_code=self.exit_code)
            if self.watcher is not None:
                self.watcher.stop()
            self.launcher.stop_all(grace=2.0)
            self.port.close()
            self.store.close()
            self.store_server.close()
            self.records.close()
            self.console.close()
            if self.job.state == JobState.REQUEUED and self.cfg.slurm.requeue_on_exit and self.requeue_wanted:
                self._requeue()
        return self.exit_code

    def _requeue(self) -> None:
        """Last act: Slurm kills what is left of the job (this process too) and queues it again;
        the next run resumes from the checkpoint (SLURM_RESTART_COUNT > 0)."""
        try:
            self.launcher.requeue()
        except Exception as e:
            self.log.emit("requeue_failed", error=str(e)[:500])
