"""The controller's main loop: admit agents, relay plans, watch liveness, and act on events.

It is the only process that decides: which node failed, which standby replaces it, when a swap
switches, when the job ends. Decisions come from `planner` (pure); this module executes them and
records every state change in the event log.
"""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from .. import config as cfgmod
from .. import jobdir
from ..comm import vote as votes
from ..comm.sealed import SealedStore
from ..control import auth
from ..control import mpi as mpictl
from ..events import EventLog
from ..messages import (AgentBye, Fence, Heartbeat, Hello, Launch, Move, Ping, Shutdown, SwapPlan,
                        WorkerExited, WorkerReport, WorkerSuspect)
from ..planner import choose_joiner, initial_builds
from ..roles import JobState, JobStatus, NodeTable, Role
from ..topology import Topology
from .admission import Admission
from .progress import Progress
from .intake import Intake
from .ending import Ending
from .pool import Pool
from .records import Records
from .recovery import Recovery
from .restart import FullRestart
from .requests import Inbox as RequestInbox, Request, slurm_user_uid
from .swap import PlannedSwap

REQUEUE_EXIT = 75   # EX_TEMPFAIL: checkpointed, run me again


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
        self.nodes = NodeTable(self.log)
        self.job = JobStatus(self.log)
        n_active = len(nodes) - standbys
        self.holder: dict[int, str] = {}
        for i, n in enumerate(nodes[:n_active]):
            self.nodes.add(n, Role.ACTIVE, slot=i)
            for r in self.topo.slot_ranks(i):
                self.holder[r] = n
        for n in nodes[n_active:]:
            self.nodes.add(n, Role.STANDBY)
        self.gen = 0
        self._gen_seq = 0
        self.plan_seq = 0
        self.groups = {b.id: b for b in initial_builds(self.topo)}
        self.channels: dict[str, mpictl.Channel] = {}
        self.last_hb: dict[str, float] = {}
        self.workers: dict[str, dict[int, object]] = {}
        self.started: set[int] = set()
        self.standby_up: dict[str, set[int]] = {}
        self.progress = Progress()
        self.finished: dict[int, str] = {}
        self.exited: set[tuple[str, int]] = set()
        self.swap: PlannedSwap | None = None
        self.recovery: Recovery | None = None
        self.restart: FullRestart | None = None
        self.interruptions: list[dict] = []
        self.checkpoints_done: set[int] = set()
        self.resume_checkpoint = resume_checkpoint
        self.start_step = 0
        self.total_steps: int | None = None
        self.requeue_code = REQUEUE_EXIT
        self.ending: Ending | None = None
        self.exit_code: int | None = None
        self._agents_gone: set[str] = set()
        allowed = {os.getuid(), 0} | ({u} if (u := slurm_user_uid()) is not None else set())
        self.requests = RequestInbox(self.job_dir, allowed)
        self.records = Records(self)
        self.time_limit_signal = False
        self.intake = Intake(self)
        self.pool = Pool(self)

    # ------------------------------------------------------------ helpers used by swap/recovery
    def new_gen(self) -> int:
        self._gen_seq += 1
        return self._gen_seq

    def committed_step(self) -> int | None:
        return self.progress.min_committed(self.holder)

    def send(self, node: str, msg) -> None:
        ch = self.channels.get(node)
        if ch is not None and not ch.dead:
            ch.send(msg)

    def broadcast(self, msg) -> None:
        for n in list(self.channels):
            self.send(n, msg)

    def adopt(self, plan: SwapPlan) -> None:
        """A plan took effect: new generation, new slot holders, new group instances."""
        self.gen = plan.gen_to
        self.log.gen = plan.gen_to
        for ch in self.channels.values():
            ch.sealer.gen = plan.gen_to
        since = (self.committed_step() or 0) + 1
        for m in plan.moves:
            self.pool.holder_since[m.joiner] = since
            for r in self.topo.slot_ranks(m.slot):
                self.holder[r] = m.joiner
        for b in plan.builds:
            self.groups[b.id] = b

    # ------------------------------------------------------------ setup
    def _open(self) -> None:
        server = dist.TCPStore(self.store_host, 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=self.T.vote_timeout_s))
        self.store = SealedStore(server, self.keys)
        self.store_addr = (self.store_host, server.port)
        jobdir.control_dir(self.job_dir)
        self.port = mpictl.Port(jobdir.port_file(self.job_dir))
        self.admission = Admission(self.port, self.keys, self.job_id, jobdir.join_dir(self.job_dir),
                                   self.T.auth_timeout_s, self.log.emit)
        if (granted := jobdir.grant_slurm_user(self.job_dir, slurm_user_uid())) is not None:
            self.log.emit("job_dir_access", slurm_user_uid=granted[0], acl=granted[1])
        if self.resume_checkpoint:
            self.start_step = int(Path(self.resume_checkpoint).name.removeprefix("step"))
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
            self.workers[node] = {w.local: w for w in m.workers}
            for w in m.workers:
                if w.rank is not None and w.progress:
                    self.progress.add(w.rank, w.progress)
                    self.records.steps(e[0] for e in w.progress)
        elif isinstance(m, WorkerReport):
            self.last_hb[node] = time.monotonic()
            self._report(node, m.local, m.report)
        elif isinstance(m, WorkerExited):
            self._worker_exited(m)
        elif isinstance(m, WorkerSuspect):
            self.fail(node, "worker_silent", rank=m.rank, silent_s=round(m.silent_s, 3))
        elif isinstance(m, AgentBye):
            self._agent_gone(node, m.reason)

    def _report(self, node: str, local: int, rep) -> None:
        kind, rank, step, data = rep.kind, rep.rank, rep.step, rep.data
        if kind == "started":
            self.started.add(rank)
            self.total_steps = data.get("steps") or self.total_steps
            if self.job.state == JobState.STARTING and len(self.started) == self.topo.world:
                self.job.set(JobState.RUNNING, since_start_s=round(time.monotonic() - self.t_start, 3))
            if all(r in self.started for r in self.topo.slot_ranks(self.nodes.nodes[node].slot)):
                self.nodes.set_ready(node)
        elif kind == "standby_ready":
            up = self.standby_up.setdefault(node, set())
            up.add(local)
            if len(up) == self.cfg.layout.ranks_per_node and self.nodes.nodes[node].role == Role.STANDBY:
                self.nodes.set_ready(node, warm=bool(data.get("warm", False)), sandbox=data.get("sandbox"))
        elif kind == "comm_error":
            self.log.emit("comm_error", node=node, rank=rank, step=step, group=data.get("group"),
                          error=data.get("error"))
        elif kind == "checkpoint":
            if data.get("path"):
                self.log.emit("checkpoint_saved", node=node, rank=rank, step=step,
                              reason=data.get("reason"), save_s=round(data.get("save_s", 0), 4))
            self.records.checkpoint_written(step)
        elif kind == "finished":
            self.finished[rank] = data["digest"]
            if len(self.finished) == self.topo.world:
                self.stop("finished", JobState.FINISHED, code=0)
        elif kind == "crashed":
            self.log.emit("worker_crashed", node=node, rank=rank, error=data.get("error", "")[-1500:])
        elif kind in ("switched", "recovered", "joined", "left"):
            self.log.emit(f"rank_{kind}", node=node, rank=rank, step=step, **data)
        elif kind == "exiting" and self.restart is not None:
            self.restart.exit_step = step
        elif kind in ("recovery_timeout", "exiting", "stopped"):
            self.log.emit(f"worker_{kind}", node=node, rank=rank, step=step, **data)
        if self.swap is not None:
            self.swap.on_report(node, kind, rank, step, data)
        if self.recovery is not None:
            self.recovery.on_report(node, kind, rank, step, data, rep.gen)
        if kind == "aborted" and self.recovery is None and self.restart is None and self.ending is None:
            # a rank aborted a step on its own (it saw a collective fail); who failed is decided
            # by the detectors below, but the recovery starts collecting now
            self._begin_recovery(rep.gen, step, data.get("t", time.time()))
            self.recovery.on_report(node, kind, rank, step, data, rep.gen)

    def _worker_exited(self, m: WorkerExited) -> None:
        self.exited.add((m.node, m.local))
        n = self.nodes.nodes[m.node]
        expected = (self.ending is not None or self.restart is not None
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
        if n.role == Role.LEAVING and (self.swap is None or self.swap.state in ("switched",)):
            self.nodes.set_role(node, Role.RELEASED, reason="evacuated")
            self.release(node, why)
        elif n.role in (Role.ACTIVE, Role.STANDBY, Role.JOINING, Role.LEAVING) and self.ending is None:
            self.fail(node, "agent_exit", why=why)

    def release(self, node: str, why: str) -> None:
        t0 = time.monotonic()
        try:
            result = self.launcher.release(node)
        except Exception as e:            # SlurmError: the node stays in the job, training goes on
            result = f"not released: {e}"
        self.log.emit("node_released", node=node, why=why, result=result,
                      release_s=round(time.monotonic() - t0, 4))

    # ------------------------------------------------------------ failures
    def injected_at(self, node: str) -> float | None:
        p = jobdir.control_dir(self.job_dir) / f"injected-{node}.json"
        try:
            return float(json.loads(p.read_text())["t"])
        except (OSError, ValueError, KeyError):
            return None

    def fail(self, node: str, how: str, **detail) -> None:
        """The one place a node is declared failed: fence it, abort the step if it held (or was
        about to hold) ranks, and hand over to recovery."""
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
        involved = node in self.holder.values() or (
            self.swap is not None and node in self.swap.plan.joiners + self.swap.plan.leavers)
        slot = n.slot if n.role in (Role.ACTIVE, Role.LEAVING) and node in self.holder.values() else None
        self.nodes.set_role(node, Role.FAILED, reason=how, **detail)
        info = {"how": how, "detect_s": round(t_detect - t_fail, 4) if t_fail else None, **detail}
        self.log.emit("failure_detected", node=node, gen=self.gen, **info)
        if self.job.state == JobState.STARTING and involved:
            self.stop(f"{node} failed before training started ({how})", JobState.FAILED, code=1)
            return
        if self.ending is not None or not involved:
            if self.swap is not None and node in self.swap.plan.joiners:
                self.swap.cancel(f"joiner {node} failed ({how})")
            return
        if self.recovery is not None and self.recovery.state == "resumed":
            self.recovery.finish(interrupted=True)
        gen, step = self.abort_in_flight(f"{node} failed ({how})")
        if self.restart is not None and self.restart.shrink is not None:
            self.log.emit("shrink_failed", node=node, step=step, why=f"{node} failed during the shrink")
            self.stop(f"{node} failed during a shrink ({how})", JobState.REQUEUED, code=self.requeue_code)
            return
        if self.cfg.recovery.strategy == "restart":
            self._restart_after_failure(node, slot, step, t_fail or t_detect, how)
            return
        if self.swap is not None and gen == self.gen and self.swap.state != "switched":
            self.swap.cancel(f"{node} failed ({how})")   # unless a commit carried the switch already
        if self.swap is not None:
            # the switch stands: the failed node's slot is the one it holds after it
            self.swap.on_switched(int(self.store.get(votes.switch_key(self.swap.plan.id))))
            slot = next((m.slot for m in self.swap.plan.moves if m.joiner == node), slot)
            if node in self.swap.plan.leavers:
                slot = None          # its ranks had moved already
            self.swap.finish(interrupted=True)
        if slot is None and node in self.holder.values():
            slot = self.topo.slot_of(next(r for r, h in self.holder.items() if h == node))
        if self.recovery is None:
            self._begin_recovery(gen, step, t_fail or t_detect)
        elif gen != self.recovery.gen:
            self.recovery.gen, self.recovery.step, self.recovery.aborted = gen, step, {}
        if slot is not None:
            self.recovery.add_failure(node, info, slot)
        else:
            self.recovery.failed.setdefault(node, info)

    def _restart_after_failure(self, node: str, slot, step: int, t_fail: float, how: str) -> None:
        if slot is None and node in self.holder.values():
            slot = self.topo.slot_of(next(r for r, h in self.holder.items() if h == node))
        taken = [m.joiner for m in self.restart.moves] if self.restart else []
        joiner = choose_joiner(self.nodes.nodes.values(), exclude=taken)
        if slot is not None and joiner is None:
            self.log.emit("standbys_exhausted", step=step, policy="restart", action="exit")
            self.stop("no standby to restart on", JobState.REQUEUED, code=self.requeue_code)
            return
        move = [Move(slot, node, joiner)] if slot is not None else []
        if self.restart is None:
            self.restart = FullRestart(self, "unplanned", move, how, t_fail)
            self.restart.start_unplanned(step)
        else:
            self.restart.moves += move
            for m in move:
                self.nodes.set_role(m.joiner, Role.JOINING, reason=how, slot=m.slot)

    def abort_in_flight(self, why: str) -> tuple[int, int]:
        """Abort whatever step the ranks are in (see vote.abort_in_flight for the range)."""
        working = [w.step for ws in self.workers.values() for w in ws.values()
                   if w.rank is not None and w.step is not None]
        lo = (self.committed_step() or -1) + 1
        return votes.abort_in_flight(self.store, self.gen, lo, max(working, default=lo) + 1, why)

    def _begin_recovery(self, gen: int, step: int, t_fail: float) -> None:
        self.recovery = Recovery(self, gen, step, t_fail)
        if self.job.state != JobState.RECOVERING:
            self.job.set(JobState.RECOVERING, step=step)

    def _check_liveness(self, now: float) -> None:
        if self.ending is not None:
            return                     # agents are going away on purpose
        for node, ch in list(self.channels.items()):
            if ch.broken and node not in self._agents_gone:
                self.fail(node, "link_broken")
            if ch.dead or node in self._agents_gone:
                continue
            silent = now - self.last_hb.get(node, now)
            if silent > self.T.heartbeat_timeout_s:
                self.fail(node, "heartbeat_timeout", silent_s=round(silent, 3))
        for node, rc in self.launcher.poll():
            self._last_words(node)
            self._agent_gone(node, f"agent process ended rc={rc}")

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
        self.stop(why, JobState.FAILED if why.startswith("unrecoverable") else JobState.FINISHED, code=1)

    def stop(self, why: str, final: JobState, code: int, wait_workers: bool = False) -> None:
        if self.ending is not None:
            return
        if self.swap is not None and self.swap.state == "switched" and self.swap.joined:
            self.swap.finish(interrupted=True)   # the job ended inside the measuring window
        self.job.set(JobState.STOPPING, why=why)
        self.ending = Ending(why, final, code, wait_workers, time.monotonic())

    # ------------------------------------------------------------ loop
    def run(self) -> int:
        import signal
        self._open()
        # sbatch --signal=B:USR1@T, SIGTERM (a time limit without --signal: KillWait before
        # SIGKILL) and the first SIGINT (Ctrl-C): checkpoint at the next step boundary and end
        # resumable. A second SIGINT stops at once; the last valid checkpoint stays.
        signals: list[int] = []
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda s, _: signals.append(s))
        if self.watcher is not None:
            self.watcher.start()
        try:
            for n in sorted(self.nodes.nodes):
                self.launcher.start(n)
            next_ping = next_status = next_req = busy_until = 0.0
            ping_seq = 0
            last = time.monotonic()
            while self.exit_code is None:
                now = time.monotonic()
                if now - last > 0.5:
                    self.log.emit("controller_stall", stall_s=round(now - last, 3))
                last = now
                if self.job.state == JobState.STARTING or now >= next_req:
                    if self.admission.announced():
                        self._admit()
                for node, ch in list(self.channels.items()):
                    for m in ch.poll():
                        if not isinstance(m, Heartbeat):
                            busy_until = now + mpictl.BUSY_FOR_S
                        self._dispatch(node, m)
                    if ch.refused:
                        self.admission.refused(node, ch.refused_why)
                if self.job.state == JobState.STARTING and now - self.t_start > self.T.admit_timeout_s:
                    missing = sorted(set(self.nodes.nodes) - set(self.channels))
                    self.log.emit("start_timeout", missing_agents=missing)
                    self.stop(f"not every node started within {self.T.admit_timeout_s}s: {missing}",
                              JobState.FAILED, code=1)
                self._check_liveness(now)
                if now >= next_req:
                    self.intake.poll_requests()
                    next_req = now + 0.05
                if self.watcher is not None:
                    self.intake.poll_watcher()
                while signals:
                    sig = signal.Signals(signals.pop(0))
                    why = {"SIGINT": "interrupted (SIGINT)"}.get(sig.name, f"time limit ({sig.name})")
                    if not self.time_limit_signal:
                        self.time_limit_signal = True
                        self.log.emit("signal", signal=sig.name, action="checkpoint_exit")
                        self.intake.handle(Request("checkpoint", None, why, time.time(), os.getuid(),
                                                   "", {"exit": True}))
                    elif sig == signal.SIGINT:
                        self.log.emit("signal", signal=sig.name, action="stop_now")
                        self.intake.wanted_checkpoint = None
                        if self.ending is None:
                            self.stop("interrupted twice (SIGINT): stopped at once", JobState.REQUEUED,
                                      code=self.requeue_code)
                        else:
                            self.ending.wait_workers = False
                    else:
                        self.log.emit("signal", signal=sig.name, action="already_ending")
                if self.swap is not None:
                    self.swap.tick(now)
                if self.recovery is not None:
                    self.recovery.tick(now)
                if self.restart is not None:
                    self.restart.tick(now)
                self.pool.check_stragglers(now)
                self.intake.drive()
                self.pool.replenish()
                if self.ending is not None:
                    self.ending.drive(self, now)
                if self.on_tick is not None:
                    self.on_tick(self)
                if now >= next_ping:
                    ping_seq += 1
                    self.broadcast(Ping(ping_seq, time.time()))
                    next_ping = now + self.T.heartbeat_interval_s
                if now >= next_status:
                    self.records.write_status()
                    next_status = now + 0.5
                busy = (now < busy_until or self.swap or self.recovery or self.restart
                        or self.job.state in (JobState.STARTING, JobState.STOPPING))
                time.sleep(mpictl.POLL_BUSY_S if busy else mpictl.POLL_IDLE_S)
        except Exception:
            import traceback
            self.log.emit("controller_error", error=traceback.format_exc()[-3000:])
            self.exit_code = 1
            raise
        finally:
            self.records.write_status()
            self.records.write_result()
            self.log.emit("job_end", state=self.job.state.value, exit_code=self.exit_code)
            if self.watcher is not None:
                self.watcher.stop()
            self.launcher.stop_all(grace=2.0)
            self.port.close()
            if self.job.state == JobState.REQUEUED and self.cfg.slurm.requeue_on_exit:
                self._requeue()
        return self.exit_code

    def _requeue(self) -> None:
        """Last act: Slurm kills what is left of the job (this process too) and queues it again;
        the next run resumes from the checkpoint (SLURM_RESTART_COUNT > 0)."""
        try:
            self.launcher.requeue()
        except Exception as e:
            self.log.emit("requeue_failed", error=str(e)[:500])

