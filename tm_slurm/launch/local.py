"""Local embedded mode: every "node" is a process group on this machine (agent + its workers), so
a node failure is `killpg` and a hang is SIGSTOP of the group."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .. import jobdir
from ..control import auth
from ..control import mpi as mpictl
from ..events import fsync_write


def agent_argv(job_dir: Path, node: str, cfg) -> list[str]:
    t = cfg.timeouts
    return [sys.executable, "-m", "tm_slurm", "agent", "--job-dir", str(job_dir), "--node", node,
            "--hb", str(t.heartbeat_interval_s), "--admit-timeout", str(t.admit_timeout_s),
            "--controller-timeout", str(t.controller_timeout_s)]


def nodes_file(job_dir: Path) -> Path:
    return jobdir.control_dir(job_dir) / "local-nodes.json"


NOTHING_TO_GIVE_BACK = "local mode: nothing to give back"   # release()'s answer: no allocation here


class LocalLauncher:
    """Hydra runs each agent in a session of its own, and the agent's workers inherit its process
    group: that group is the node (what a power loss kills), mpiexec and its proxy are the
    launcher around it."""
    kind = "local"

    def __init__(self, job_dir: Path, cfg, secret: bytes):
        self.job_dir, self.cfg = Path(job_dir), cfg
        self.agent_env = auth.agent_env(secret)
        self.procs: dict[str, subprocess.Popen] = {}
        self.pgids: dict[str, int] = {}
        self.ended: set[str] = set()

    def start(self, node: str) -> None:
        log = open(jobdir.log_dir(self.job_dir) / f"{node}.agent.log", "ab")
        argv = mpictl.mpiexec_argv(agent_argv(self.job_dir, node, self.cfg))
        self.procs[node] = subprocess.Popen(argv, env=mpictl.mpi_env(extra=self.agent_env), start_new_session=True,
                                            stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT)
        log.close()

    def admitted(self, node: str, hello) -> None:
        self.pgids[node] = hello.pgid
        fsync_write(nodes_file(self.job_dir), json.dumps(
            {n: {"pgid": g, "launcher_pid": self.procs[n].pid} for n, g in self.pgids.items()}).encode())

    def poll(self) -> list[tuple[str, int]]:
        out = []
        for n, p in self.procs.items():
            if n not in self.ended and p.poll() is not None:
                self.ended.add(n)
                out.append((n, p.returncode))
        return out

    def kill(self, node: str) -> None:
        """Fence: every process of the node at once, and its launcher."""
        for pg in (self.pgids.get(node), self.procs[node].pid if node in self.procs else None):
            if pg is not None:
                try:
                    os.killpg(pg, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def release(self, node: str) -> str:
        return NOTHING_TO_GIVE_BACK

    def replenish(self, ctl) -> str:
        """One more local "node" for the standby pool: the next free name."""
        i = len(ctl.nodes.nodes) + 1
        while f"node{i}" in ctl.nodes.nodes:
            i += 1
        return f"node{i}"

    def requeue(self) -> None:
        pass

    def stop_all(self, grace: float = 5.0) -> None:
        # one grace for all, then every node is fenced: a grace a node would make the end of a
        # large job wait minutes for agents that do not go
        end = time.monotonic() + grace
        for p in self.procs.values():
            wait_until(p, end)
        for n in self.procs:
            self.kill(n)
        end = time.monotonic() + 5
        for p in self.procs.values():
            wait_until(p, end)


def wait_until(p: subprocess.Popen, end: float) -> None:
    try:
        p.wait(max(0.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass


def fail(job_dir: Path, node: str, mode: str) -> float:
    """`tm-slurm fail NODE --mode kill|hang|exit|hang-worker`: record when, then do it. The record lets the
    controller report how long detection took. Returns the failure's wall time."""
    t = time.time()
    fsync_write(jobdir.control_dir(job_dir) / f"injected-{node}.json",
                json.dumps({"t": t, "mode": mode}).encode())
    inject(job_dir, node, mode)
    return t


def inject(job_dir: Path, node: str, mode: str) -> float:
    """Make a local-mode node fail for real; returns the failure's wall time."""
    try:
        info = json.loads(nodes_file(job_dir).read_text())
    except OSError:
        raise SystemExit(f"{job_dir} is not a running local-mode job") from None
    if node not in info:
        raise SystemExit(f"unknown node {node!r}; nodes: {', '.join(sorted(info))}")
    pgid = info[node]["pgid"]
    t = time.time()
    try:
        if mode == "kill":
            os.killpg(pgid, signal.SIGKILL)
        elif mode == "hang":
            os.killpg(pgid, signal.SIGSTOP)
        elif mode in ("exit", "hang-worker"):
            # the workers die (the "worker process exited" path) or freeze (their heartbeats to
            # the agent stop: the worker heartbeat timeout); the agent lives
            for pid in _workers_of(job_dir, node):
                os.kill(pid, signal.SIGKILL if mode == "exit" else signal.SIGSTOP)
        else:
            raise SystemExit(f"unknown mode {mode!r}: kill | hang | exit | hang-worker")
    except ProcessLookupError:
        raise SystemExit(f"{node} has no running processes (already failed, or the job ended)") from None
    return t


def _workers_of(job_dir: Path, node: str) -> list[int]:
    st = json.loads(jobdir.status_file(job_dir).read_text())
    return [w["pid"] for w in st["nodes"].get(node, {}).get("workers", [])]
