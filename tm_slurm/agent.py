"""The per-node agent (`tm-slurm agent`): one per node, each its own srun step (or, locally, its own
process group). It connects to the controller over MPI, starts this node's workers as its
children, relays messages both ways, watches its workers (exit, silence) and the controller
(silence), and kills its workers when told to. It decides nothing about the job; it never
imports torch, so it starts in a fraction of a second.
"""
from __future__ import annotations

import os
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import jobdir as paths
from . import logs
from . import output
from .control import auth
from .control import mpi as mpictl
from .control.wire import Wire
from .events import fsync_write
from .exits import Exit
from .osutil import raise_fd_limit
from .messages import (Aborted, AgentBye, Announce, Assign, Beat, Challenge, Checkpoint, Crashed, Fence, Heartbeat,
                       Hello, Launch, Ping, Report, Shutdown, Signalled, Stop, ToWorkers, WorkerExited,
                       WorkerInfo, WorkerReport, WorkerSuspect)


@dataclass
class WorkerProc:
    local: int
    proc: subprocess.Popen
    wire: Wire
    rank: int | None = None
    out: output.Pipe | None = None      # its stdout and stderr
    step: int | None = None
    committed: int | None = None
    started: float = field(default_factory=time.monotonic)
    last_heard: float | None = None     # None until its first message (imports can take seconds)
    suspect: bool = False
    progress: list = field(default_factory=list)
    done: bool = False          # exited and reported
    refused_told: bool = False


class Agent:
    def __init__(self, job_dir: Path, node: str, hb_interval: float, admit_timeout: float,
                 controller_timeout: float, secret: bytes):
        self.job_dir, self.node = Path(job_dir), node
        self.secret = secret
        self.keys = auth.Keys.derive(secret)
        self.job = os.environ.get("TM_SLURM_JOB_ID") or self.job_dir.name
        self.logger = logs.get("agent", job=self.job, node=node)
        self.hb_interval = hb_interval
        self.admit_timeout = admit_timeout
        self.controller_timeout = controller_timeout
        self.worker_timeout = controller_timeout
        self.shutdown_s = 10.0
        self.workers: dict[int, WorkerProc] = {}
        self.sent: dict[int, tuple] = {}     # what the last beats told the controller of each worker
        self.sel = selectors.DefaultSelector()
        self.launch: Launch | None = None
        self.seq = 0
        self.last_ctl = time.monotonic()
        self.sigterm = 0          # SIGTERMs received; the first is passed on to the controller
        self.streamed = output.streamed("none")     # whose lines go to the controller (Launch)
        self.forward = output.Forwarder(node)

    # ------------------------------------------------------------ connect
    def connect(self) -> mpictl.Channel:
        port_file = paths.port_file(self.job_dir)
        deadline = time.monotonic() + self.admit_timeout
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"agent {self.node}: no controller port at {port_file} after "
                                 f"{self.admit_timeout}s")
            time.sleep(0.02)
        port = port_file.read_text()
        # announce out of band, so the controller calls Accept only when a Connect is coming
        fsync_write(paths.join_dir(self.job_dir) / self.node,
                    auth.Sealer(self.keys, self.job, self.node).seal(Announce(self.node, os.getpid())))
        ch = mpictl.connect(port)
        ch.sealer = auth.Sealer(self.keys, self.job, self.node, peer="controller")
        challenge = None
        while challenge is None:
            if time.monotonic() > deadline or ch.refused:
                raise SystemExit(f"agent {self.node}: the controller at {port_file} did not prove "
                                 f"it is this job's ({ch.refused_why or 'no challenge'})")
            challenge = next((m for m in ch.poll() if isinstance(m, Challenge)), None)
            time.sleep(0.001)
        ch.send(Hello(self.node, socket.gethostname(), os.getpid(), os.getpgid(0),
                      os.environ.get("SLURM_STEP_ID"), os.environ.get("SLURM_JOB_ID"), challenge.nonce))
        return ch

    # ------------------------------------------------------------ workers
    def configure(self, launch: Launch) -> None:
        self.launch = launch
        t = launch.config["timeouts"]
        self.worker_timeout = t["worker_heartbeat_timeout_s"]
        self.controller_timeout = t["controller_timeout_s"]
        self.shutdown_s = t["shutdown_s"]
        self.streamed = output.streamed(launch.config["output"]["ranks"])

    def spawn(self, launch: Launch) -> None:
        """Start this node's workers (again, after a restart: the old ones are gone by then)."""
        for w in self.workers.values():
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
            if w.wire.sock.fileno() >= 0:
                try:
                    self.sel.unregister(w.wire.sock)
                except (KeyError, ValueError):
                    pass
                w.wire.close()
        logs = paths.log_dir(self.job_dir)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PMI_", "MPIR_", "HYDRA_", "MPI_", mpictl.MPI_ENV))}
        env.update(dict(launch.env))
        spawn = secrets.token_hex(8)
        for i in range(launch.local_ranks):
            a, b = socket.socketpair()
            wenv = dict(env, TM_SLURM_AGENT_FD=str(b.fileno()), TM_SLURM_NODE=self.node,
                        TM_SLURM_LOCAL=str(i), TM_SLURM_JOB_DIR=str(self.job_dir))
            r, out = os.pipe()     # not inheritable: the worker gets the write end as stdout only
            proc = subprocess.Popen(list(launch.command), cwd=launch.cwd, env=wenv, pass_fds=[b.fileno()],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    umask=paths.user_umask())
            b.close()
            os.close(out)
            a.setblocking(True)
            wire = Wire(a, auth.Sealer(self.keys, self.job, self.node, peer=f"{self.node}/w{i}"))
            pipe = output.Pipe(r, logs / f"{self.node}.w{i}.log", warn=self._log_failed(i))
            w = WorkerProc(i, proc, wire, rank=launch.ranks[i] if launch.ranks else None, out=pipe)
            self.workers[i] = w
            self.sel.register(a, selectors.EVENT_READ, w)
            self.sel.register(r, selectors.EVENT_READ, w)
            wire.send_bootstrap(self.secret + self.job.encode())
            wire.send(Assign(launch, self.node, i, spawn))

    def _log_failed(self, local: int):
        return lambda e: self.logger.warning("worker %d's log file: %s; its output is lost until "
                                             "it can be written", local, e)

    def to_workers(self, payload) -> None:
        if not self.workers and self.launch is not None and self._names_us(payload):
            self.spawn(self.launch)      # a cold standby: its workers start now, when needed
        for w in self.workers.values():
            if not w.done:
                w.wire.send(payload)

    def _names_us(self, payload) -> bool:
        plan = getattr(payload, "plan", None)
        return plan is not None and self.node in plan.joiners

    def kill_workers(self, sig=signal.SIGKILL) -> None:
        for w in self.workers.values():
            if w.proc.poll() is None:
                try:
                    w.proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def _from_worker(self, ch, w: WorkerProc, msg: Report) -> None:
        w.last_heard = time.monotonic()
        w.suspect = False
        if msg.rank is not None:
            w.rank = msg.rank
        if isinstance(msg, Beat):
            w.step = msg.step
            w.committed = msg.committed
            w.progress.extend(msg.progress)
            return
        if msg.step is not None and not isinstance(msg, Aborted):
            w.step = msg.step
        self.busy_until = time.monotonic() + mpictl.BUSY_FOR_S
        if isinstance(msg, Crashed) and msg.script_error and w.out is not None and not w.out.closed:
            # the script's own error is printed once, by tm-slurm (the worker leaves it to this
            # report): into the worker's log it goes after what the worker printed before it
            self._pump(w, output.DRAIN)
            w.out.note(msg.error)
        if any(x.progress for x in self.workers.values()):
            self.heartbeat(ch)      # progress before the report, which can be a leaving worker's last
        ch.send(WorkerReport(self.node, w.local, msg))

    def _ready(self, ch, key: selectors.SelectorKey) -> None:
        w = key.data
        if key.fileobj is w.wire.sock:
            self._read(ch, w)
        else:
            self._pump(w)

    def _pump(self, w: WorkerProc, limit: int = output.CHUNK) -> None:
        """What worker `w` printed: into its log file, and its lines on their way to the
        controller if its rank is streamed (sent by `run`, every output.FLUSH_S)."""
        streamed = self.streamed(w.rank)
        lines = w.out.read(streamed, limit)
        if lines:
            self.forward.add(w.local, w.rank, lines)
        if w.out.ended:        # the worker, and whatever inherited its stdout, are gone
            self.sel.unregister(w.out.fd)
            w.out.close()

    def _read(self, ch, w: WorkerProc) -> None:
        try:
            for m in w.wire.recv_ready():
                self._from_worker(ch, w, m)
        except EOFError:
            self.sel.unregister(w.wire.sock)
            w.wire.close()
        if w.wire.refused and not w.refused_told:
            w.refused_told = True      # once per peer: a flood is one line
            self.logger.warning("auth_refused: %d frame(s) from worker %d failed their check and were "
                                "dropped", w.wire.refused, w.local)

    def _reap(self, ch) -> None:
        for w in self.workers.values():
            if w.done:
                continue
            rc = w.proc.poll()
            if rc is None:
                now = time.monotonic()
                silent = now - (w.last_heard or w.started)
                limit = self.worker_timeout if w.last_heard is not None else self.admit_timeout
                if silent > limit and not w.suspect:
                    w.suspect = True
                    ch.send(WorkerSuspect(self.node, w.local, w.proc.pid, w.rank, silent))
                continue
            try:
                self._read(ch, w)   # what it said before it went
            except Exception:
                pass
            if w.out is not None and not w.out.closed:
                self._pump(w, output.DRAIN)     # and printed: its last lines, a traceback
            for m in self.forward.ended(w.local):
                ch.send(m)
            w.done = True
            ch.send(WorkerExited(self.node, w.local, w.proc.pid, rc, w.rank))

    def heartbeat(self, ch) -> None:
        """A beat says only what changed since the last one (messages.Heartbeat): with steps
        longer than a beat most beats would repeat what the controller knows, and at 1,024 nodes
        it opens 2,048 beats a second (README "Control plane at scale")."""
        self.seq += 1
        full = self.sent.keys() != self.workers.keys()
        if full:
            self.sent.clear()
        infos, moves, records = [], [], []
        for w in self.workers.values():
            who, at = (w.proc.pid, w.rank, not w.done), (w.step, w.committed)
            was = self.sent.get(w.local)
            if was is None or was[0] != who:
                infos.append(WorkerInfo(w.local, w.proc.pid, w.rank, w.step, w.committed, not w.done))
            elif was[1] != at:
                moves += (w.local, *at)
            self.sent[w.local] = (who, at)
            if w.rank is not None:
                for e in w.progress:
                    if len(e) in (6, 7):      # busy_s, the seventh, may be left out
                        records += (w.rank, *e, *(0.0,) * (7 - len(e)))
            w.progress = []
        ch.send(Heartbeat(self.node, self.seq, time.time(), tuple(infos), full, tuple(moves), tuple(records)))

    # ------------------------------------------------------------ main loop
    def run(self) -> int:
        ch = self.connect()
        self.last_ctl = time.monotonic()
        next_hb = 0.0
        last = self.busy_until = time.monotonic()
        while True:
            t = time.monotonic()
            if t - last > 0.5:
                self.logger.warning("main loop stalled %.2fs", t - last)
            last = t
            for m in ch.poll():
                self.last_ctl = time.monotonic()
                if not isinstance(m, Ping):
                    self.busy_until = self.last_ctl + mpictl.BUSY_FOR_S
                rc = self.handle(ch, m)
                if rc is not None:
                    return rc
            busy = time.monotonic() < self.busy_until
            for key, _ in self.sel.select(timeout=mpictl.POLL_BUSY_S if busy else mpictl.POLL_IDLE_S):
                self._ready(ch, key)
            self._reap(ch)
            for m in self.forward.due():
                ch.send(m)
            now = time.monotonic()
            if self.sigterm == 1:
                self.sigterm = 2
                ch.send(Signalled(self.node, "SIGTERM"))
            if now >= next_hb:
                self.heartbeat(ch)
                next_hb = now + self.hb_interval
            if now - self.last_ctl > self.controller_timeout or ch.broken:
                return self.controller_lost(ch)

    def handle(self, ch, m) -> int | None:
        if isinstance(m, Launch):
            self.configure(m)
            if m.role == "ACTIVE" or m.config["standby"]["prestart"]:
                self.spawn(m)            # else a cold standby: no process until a plan names it
            else:
                self.kill_workers()      # (a restart made this node a standby again)
        elif isinstance(m, ToWorkers):
            self.to_workers(m.payload)
        elif isinstance(m, Fence):
            self.kill_workers()
        elif isinstance(m, Shutdown):
            return self.shutdown(ch, m)
        elif isinstance(m, Ping):
            pass
        return None

    def shutdown(self, ch, m: Shutdown) -> int:
        if m.graceful:
            self.to_workers(Stop(m.reason))
            end = time.monotonic() + self.shutdown_s
            while time.monotonic() < end and any(w.proc.poll() is None for w in self.workers.values()):
                for key, _ in self.sel.select(timeout=0.01):
                    self._ready(ch, key)
        self.kill_workers()
        for w in self.workers.values():
            w.proc.wait()
        self._reap(ch)
        ch.send(AgentBye(self.node, m.reason), sync=True)     # delivered, with all before it
        self._flush(ch)
        return 0

    def controller_lost(self, ch) -> int:
        """The controller (and its batch host) is gone: the surviving workers write a checkpoint of
        the last committed step (worker/lost.py), then the job ends so that it requeues, never
        a headless job holding the allocation. The survivor agent with the lowest node name
        requeues it once every survivor is done."""
        ch.abandon()
        if controller_alive(paths.status_file(self.job_dir), 4 * paths.STATUS_EVERY_S):
            # only this node lost the controller (a partition): the job is not ours to end; the
            # controller fences and replaces this node as it would a dead one
            self.logger.warning("controller silent for %ss but its status.json is still touched: "
                                "this node is cut off; ending its workers, not the job",
                                self.controller_timeout)
            self.kill_workers()
            # the one trace a cut-off node can leave: its output went through the network
            note = paths.lost_dir(self.job_dir) / f"agent-{self.node}.fenced"
            note.write_text(f"cut off from a live controller after {self.controller_timeout}s of silence\n")
            return Exit.FENCED
        self.logger.warning("controller silent for %ss; checkpointing and ending the job",
                            self.controller_timeout)
        d = paths.lost_dir(self.job_dir)
        (d / f"agent-{self.node}.alive").write_text(str(os.getpid()))
        self.to_workers(Checkpoint("controller lost"))
        end = time.monotonic() + self.shutdown_s * 3
        while time.monotonic() < end and any(w.proc.poll() is None for w in self.workers.values()):
            # their output is still read: a worker blocked on a full pipe writes no checkpoint
            for key, _ in self.sel.select(timeout=0.05):
                self._ready(ch, key)
        self.kill_workers()
        (d / f"agent-{self.node}.done").write_text("")
        time.sleep(1.0)                  # let the other survivors announce themselves
        alive = sorted(p.name[6:-6] for p in d.glob("agent-*.alive"))
        if alive and alive[0] == self.node:
            end = time.monotonic() + self.shutdown_s * 3
            while time.monotonic() < end and not all((d / f"agent-{n}.done").exists() for n in alive):
                time.sleep(0.1)
            self._end_job()
        return Exit.REQUEUE

    def _end_job(self) -> None:
        """Requeue the job (or cancel it). A requeue that reports failure may have happened all
        the same (its answer lost or late), and a cancel would then end the requeued run: the job
        is looked at first. What was done goes to the lost directory too, as the sruns that
        carried this agent's log died with the batch host."""
        job = os.environ.get("SLURM_JOB_ID")
        if not job:
            return                      # local mode: nothing holds an allocation
        requeue = self.launch is None or self.launch.config["slurm"]["requeue_on_exit"]
        cmd = ["scontrol", "requeue", job] if requeue else ["scancel", job]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        done = [f"{' '.join(cmd)} -> {r.returncode} {r.stderr.strip()}"]
        if r.returncode != 0 and requeue:
            if requeued_anyway(job):
                done.append(f"job {job} was requeued all the same: not cancelled")
            else:
                c = subprocess.run(["scancel", job], capture_output=True, text=True, timeout=30)
                done.append(f"scancel {job} -> {c.returncode} {c.stderr.strip()}")
        self.logger.warning("; ".join(done))
        try:
            fsync_write(paths.lost_dir(self.job_dir) / f"end-{self.node}.txt", ("\n".join(done) + "\n").encode())
        except OSError:
            pass                         # a full disk: the job was requeued all the same

    def _flush(self, ch, timeout: float = 2.0) -> None:
        end = time.monotonic() + timeout
        while ch.pending_sends() and time.monotonic() < end:
            time.sleep(0.001)


def requeued_anyway(job: str, backend=None) -> bool:
    """Whether Slurm counts a restart beyond this run's (SLURM_RESTART_COUNT): the job was
    requeued, whatever the requeue command said."""
    from .slurm.backend import SlurmError
    from .slurm.cli_backend import CliBackend
    try:
        info = (backend or CliBackend()).job(job)
    except SlurmError:
        return False
    return info is not None and (info.restarts or 0) > int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def controller_alive(status: Path, watch_s: float, sleep=time.sleep) -> bool:
    """Whether the controller still touches its status.json (every 0.5 s, through the shared
    filesystem): a change seen within `watch_s` says it is alive. Compares the file with itself,
    never with this node's clock, so clock skew between nodes does not matter."""
    def stamp():
        try:
            st = status.stat()
            return st.st_mtime_ns, st.st_size, st.st_ino
        except OSError:
            return None
    first = stamp()
    end = time.monotonic() + watch_s
    while time.monotonic() < end:
        sleep(0.1)
        now = stamp()
        if first is not None and now is not None and now != first:
            return True
    return False


def on_sigterm(agent: Agent) -> None:
    """The first SIGTERM (Slurm's time limit or scancel, KillWait before SIGKILL) goes to the
    controller, which writes a checkpoint in that window; the workers ignore it. Later ones are
    the same event again (its launcher forwards the step's SIGTERM too): the agent stays until
    the controller ends it or SIGKILL comes. One before the agent was launched ends the node now."""
    if agent.launch is None:
        agent.kill_workers()
        os._exit(143)
    if not agent.sigterm:
        agent.sigterm = 1


def main(job_dir: str, node: str, hb_interval: float, admit_timeout: float,
         controller_timeout: float) -> int:
    if not mpictl.under_mpiexec():
        mpictl.reexec_under_mpiexec()
    logs.setup()
    os.umask(0o077)            # what the agent writes is the job's alone; workers get the user's
    raise_fd_limit()           # its workers inherit it
    agent = Agent(Path(job_dir), node, hb_interval, admit_timeout, controller_timeout,
                  auth.take_secret_from_env())
    signal.signal(signal.SIGTERM, lambda *_: on_sigterm(agent))
    try:
        rc = agent.run()
    except SystemExit as e:
        agent.logger.error("%s", e)
        agent.kill_workers()
        rc = Exit.USAGE
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
