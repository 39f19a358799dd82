"""Local embedded mode: every "node" is a process group on this machine (agent + its workers), so
a node failure is `killpg` and a hang is SIGSTOP of the group."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from .. import jobdir
from ..control import mpi as mpictl
from ..events import fsync_write


def agent_argv(job_dir: Path, node: str, cfg) -> list[str]:
    t = cfg.timeouts
    return [sys.executable, "-m", "tm_slurm", "agent", "--job-dir", str(job_dir), "--node", node,
            "--hb", str(t.heartbeat_interval_s), "--admit-timeout", str(t.admit_timeout_s),
            "--controller-timeout", str(t.controller_timeout_s)]


def nodes_file(job_dir: Path) -> Path:
    return jobdir.control_dir(job_dir) / "local-nodes.json"


class LocalLauncher:
    kind = "local"

    def __init__(self, job_dir: Path, cfg):
        self.job_dir, self.cfg = Path(job_dir), cfg
        self.procs: dict[str, subprocess.Popen] = {}
        self.ended: set[str] = set()

    def start(self, node: str) -> None:
        log = open(jobdir.log_dir(self.job_dir) / f"{node}.agent.log", "ab")
        argv = mpictl.mpiexec_argv(agent_argv(self.job_dir, node, self.cfg))
        self.procs[node] = subprocess.Popen(argv, env=mpictl.mpi_env(), start_new_session=True,
                                            stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT)
        log.close()
        fsync_write(nodes_file(self.job_dir), json.dumps(
            {n: {"pgid": p.pid} for n, p in self.procs.items()}).encode())

    def poll(self) -> list[tuple[str, int]]:
        out = []
        for n, p in self.procs.items():
            if n not in self.ended and p.poll() is not None:
                self.ended.add(n)
                out.append((n, p.returncode))
        return out

    def signal(self, node: str, sig: int) -> None:
        p = self.procs.get(node)
        if p is not None:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def kill(self, node: str) -> None:
        """Fence: every process of the node, at once (SIGCONT too, in case it was stopped)."""
        self.signal(node, signal.SIGKILL)
        self.signal(node, signal.SIGCONT)

    def release(self, node: str) -> None:
        pass

    def stop_all(self, grace: float = 5.0) -> None:
        for n, p in self.procs.items():
            if p.poll() is None:
                try:
                    p.wait(grace)
                except subprocess.TimeoutExpired:
                    pass
            self.kill(n)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass


def inject(job_dir: Path, node: str, mode: str) -> float:
    """`tm-slurm fail NODE --mode kill|hang|exit` in local mode; returns the failure's wall time."""
    import time
    info = json.loads(nodes_file(job_dir).read_text())
    if node not in info:
        raise SystemExit(f"unknown node {node!r}; nodes: {', '.join(sorted(info))}")
    pgid = info[node]["pgid"]
    t = time.time()
    if mode == "kill":
        os.killpg(pgid, signal.SIGKILL)
    elif mode == "hang":
        os.killpg(pgid, signal.SIGSTOP)
    elif mode == "exit":
        # the workers die, the agent lives (the "worker process exited" path)
        for pid in _workers_of(job_dir, node):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    else:
        raise SystemExit(f"unknown mode {mode!r}: kill | hang | exit")
    return t


def _workers_of(job_dir: Path, node: str) -> list[int]:
    st = json.loads(jobdir.status_file(job_dir).read_text())
    return [w["pid"] for w in st["nodes"].get(node, {}).get("workers", [])]
