"""`tm-slurm run` as the parent of its controller: the controller runs under `mpiexec -n 1`
(control/mpi.py says why and which), and this process hands it the job's signals and ends with it.

What ends `tm-slurm run` is the controller's own exit, seen on the process itself, with its exit
code from a file it writes last: the launcher is given `timeouts.launcher_grace_s` to follow and is
killed after it. No launcher can then keep the job's allocation (hydra's mpiexec could be held by
anyone who connected to its port and sent a few bytes, docs/design.md §9)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from .. import jobdir
from ..control import mpi as mpictl
from ..events import fsync_write
from ..exits import Exit
from ..osutil import die_with_parent

POLL_S = 0.2          # how soon a controller's end is seen; a look is one /proc read


def supervise(job_dir: Path, grace: float) -> int:
    """Run this same command as the controller, in a session of its own, and hand it the signals
    meant for the job. Ctrl-C signals the terminal's whole foreground group, and mpiexec takes a
    second SIGINT as "abort": it would SIGKILL the controller before the controller ends its
    agents' steps. So the terminal never reaches mpiexec, and each SIGINT, SIGTERM (time limit)
    and SIGUSR1 (sbatch --signal) that this process gets goes to the controller itself."""
    exit_file = jobdir.controller_exit_file(job_dir)
    exit_file.unlink(missing_ok=True)          # an earlier run's (a requeue reuses the directory)
    argv = mpictl.mpiexec_argv([sys.executable, "-m", "tm_slurm", *sys.argv[1:]])
    p = subprocess.Popen(argv, env=mpictl.mpi_env(), start_new_session=True, stdin=subprocess.DEVNULL,
                         preexec_fn=die_with_parent)
    s = Supervised(p, exit_file)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, s.forward)
    return s.wait(grace)


def record_exit(job_dir: Path, rc: int) -> None:
    """The controller's last act: its exit code, for `supervise` (mpiexec may never pass it on)."""
    try:
        fsync_write(jobdir.controller_exit_file(job_dir), f"{os.getpid()} {rc}\n".encode())
    except OSError:
        pass                 # a full disk: supervise falls back to mpiexec's status


class Supervised:
    def __init__(self, p: subprocess.Popen, exit_file: Path):
        self.p, self.exit_file = p, exit_file
        self.ctl: Proc | None = None

    def forward(self, sig, _frame) -> None:
        if self.ctl is not None:
            pid = self.ctl.pid if self.ctl.alive() else None
        else:
            pid = controller_pid(self.p.pid) or self.p.pid
        if pid is not None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, grace: float) -> int:
        p = self.p
        while True:
            try:
                p.wait(POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if self.ctl is None:
                pid = controller_pid(p.pid)
                self.ctl = Proc.of(pid) if pid else None
            # the file also covers a controller that ended before it was found
            if (self.ctl is not None and not self.ctl.alive()) or self.exit_file.exists():
                break
        try:
            rc = _status(p.wait(grace))
        except subprocess.TimeoutExpired:
            for pid in [p.pid, *descendants(p.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
            print(f"tm-slurm: mpiexec outlived the controller by {grace:g} s and was killed",
                  file=sys.stderr, flush=True)
            rc = None
        own = self._recorded()
        # none recorded (killed, or a full disk at the very end): the launcher's word, if it
        # ended of itself
        return own if own is not None else rc if rc is not None else int(Exit.FAILED)

    def _recorded(self) -> int | None:
        try:
            pid, rc = self.exit_file.read_text().split()
        except (OSError, ValueError):
            return None
        return int(rc) if self.ctl is None or int(pid) == self.ctl.pid else None


def _status(rc: int) -> int:
    return rc if rc >= 0 else 128 - rc


class Proc:
    """One process, told apart from a later one with the same pid by its start time."""

    def __init__(self, pid: int, start: str):
        self.pid, self.start = pid, start

    @classmethod
    def of(cls, pid: int) -> "Proc | None":
        st = _stat(pid)
        return cls(pid, st[19]) if st else None

    def alive(self) -> bool:
        st = _stat(self.pid)
        return st is not None and st[19] == self.start and st[0] != "Z"


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat from the state on (the name before it may hold spaces)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            st = _stat(int(d.name))
            if st is not None:
                children.setdefault(int(st[1]), []).append(int(d.name))
    return children


def descendants(root: int) -> list[int]:
    """mpiexec's proxy runs in a session of its own: killing mpiexec's group misses it."""
    children, out = _children(), []
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, ())
    return out


def controller_pid(root: int) -> int | None:
    """The `python -m tm_slurm` process below `root` (mpiexec -> proxy -> controller)."""
    children = _children()
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(bytes(1))
        except OSError:
            continue
        if argv[1:3] == [b"-m", b"tm_slurm"]:
            return pid
        todo += children.get(pid, ())
    return None
