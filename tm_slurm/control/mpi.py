"""The MPI control plane (docs/design.md §2): the controller opens a port, each agent connects and keeps
its own intercommunicator, so a dead agent breaks only its own link.

Everything is non-blocking (isend + improbe polling): blocking receives burn a core, and MPI never
reports a dead peer, so liveness is decided by heartbeats above this layer. After a failure a
process never calls MPI_Finalize (it can hang on the dead peer): `mpi4py.rc.finalize = False`.

A process that uses Connect/Accept must be started by `mpiexec -n 1` (two singletons share the
same process ids and Connect fails with "groups not disjoint"); `mpiexec_argv` builds that wrapper,
which also works inside an srun step (`-launcher fork -rmk user`: no nested Slurm launch).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..events import fsync_write
from .auth import MAX_FRAME, Sealer

MPI_ENV = "TM_SLURM_MPIEXEC"      # set inside the wrapper so we do not wrap twice
# MPI has no file descriptor to wait on, so the controller and agents poll: every millisecond
# while something is going on (a swap, a recovery, a start; a message in the last second), every
# 20 ms when the job just trains (1 ms polling costs a Python process ~5% of a core, which a
# small node takes from training)
POLL_BUSY_S, POLL_IDLE_S, BUSY_FOR_S = 0.001, 0.02, 1.0
INJECT_BYTES = 16 << 10

_MPI = None


def mpi():
    """Import mpi4py lazily (it initialises MPI on import) with finalize disabled."""
    global _MPI
    if _MPI is None:
        import mpi4py
        mpi4py.rc.finalize = False
        mpi4py.rc.threads = True
        mpi4py.rc.thread_level = "funneled"   # MPI is called from one thread per process
        from mpi4py import MPI
        _MPI = MPI
    return _MPI


def find_mpiexec() -> str:
    explicit = os.environ.get("TM_SLURM_MPIEXEC_BIN")
    if explicit:
        return explicit
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if not found:
        raise RuntimeError("mpiexec not found: install the MPI runtime (pip install 'tm-slurm[mpi]' "
                           "gives the PyPI mpich wheel) or set TM_SLURM_MPIEXEC_BIN")
    return found


def under_mpiexec() -> bool:
    return os.environ.get(MPI_ENV) == "1"


def mpiexec_argv(argv: list[str]) -> list[str]:
    return [find_mpiexec(), "-launcher", "fork", "-rmk", "user", "-n", "1", *argv]


def mpi_env(env: dict[str, str] | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    e = dict(os.environ if env is None else env, **(extra or {}))
    e[MPI_ENV] = "1"
    # the ch4:ucx netmod of the PyPI wheel crashed (SIGSEGV/SIGBUS inside Accept) when several
    # agents connected at once; ch4:ofi with the tcp provider did not, in every run here
    e.setdefault("MPIR_CVAR_CH4_NETMOD", "ofi")
    e.setdefault("FI_PROVIDER", "tcp")
    # ~1 s of retries (~45 us each here) before a send to a dead peer fails instead of hanging
    e.setdefault("MPIR_CVAR_CH4_OFI_MAX_EAGAIN_RETRY", "20000")
    e.setdefault("MPIR_CVAR_CH4_COMM_CONNECT_TIMEOUT", "10")  # an agent dying mid-join: bounded Accept
    # A send still in flight when its peer dies with unread data (a SIGSTOPped node that is then
    # fenced, an agent killed right after a message to it) ends in a "connection reset" error on
    # the completion queue, which MPICH treats as fatal whatever the error handler: the survivor
    # aborts, the controller with it. A frame up to the inject size is buffered by the provider and
    # complete at once, so no request is left to fail; 16 KiB holds every frame but the largest
    # Launch (`tm-slurm bench --frames`; tests/procs/test_links.py shows the abort without this).
    e.setdefault("FI_TCP_MAX_INJECT", str(INJECT_BYTES))
    return e


def reexec_under_mpiexec() -> None:
    """Replace this process by `mpiexec -n 1 <same command>` unless already wrapped."""
    if under_mpiexec():
        return
    argv = mpiexec_argv([sys.executable, "-m", "tm_slurm", *sys.argv[1:]])
    os.execve(argv[0], argv, mpi_env())


class Channel:
    """One intercommunicator to one peer (rank 0 of the remote group), carrying sealed frames
    (control/auth.py). A frame that fails the check is dropped unread and counted in `refused`
    (with the last reason), for the owner to log once per peer."""

    TAG = 7

    def __init__(self, comm, tags: tuple[int, int] = (TAG, TAG)):
        # (send, receive): one tag both ways on an intercommunicator; a harness that plays both
        # ends of a link on one communicator of its own (bench/controlplane.py) tells them apart
        self.comm, (self._tx, self._rx) = comm, tags
        self.sealer: Sealer | None = None     # set by whoever authenticates the link
        self.refused = 0
        self.refused_why = ""
        self._pending: list = []
        self.dead = False
        self.broken = False          # a send failed: the peer is gone (or unreachable)
        # a send to a dead peer retries forever inside MPI (ofi: -FI_EAGAIN); with this hint and
        # MPIR_CVAR_CH4_OFI_MAX_EAGAIN_RETRY it fails instead, and the link is marked dead
        info = mpi().Info.Create()
        info.Set("MPI_OFI_set_eagain", "true")
        comm.Set_info(info)
        info.Free()

    def send(self, msg: Any, sync: bool = False) -> None:
        """`sync`: complete only once the peer has received it (and, in order, everything sent
        before). For a process's last words: an injected frame is complete as soon as the
        provider buffered it (mpi_env), and a process that exits then may take it along."""
        if self.dead:
            return
        MPI = mpi()
        buf = bytearray(self.sealer.seal(msg))
        try:
            isend = self.comm.Issend if sync else self.comm.Isend
            req = isend([buf, MPI.BYTE], dest=0, tag=self._tx)
        except MPI.Exception:
            self.broken = True
            self.abandon()
            return
        self._pending.append((req, buf))
        self._reap()

    def _reap(self) -> None:
        if self._pending:
            try:
                self._pending = [(r, b) for r, b in self._pending if not r.Test()]
            except mpi().Exception:
                self.broken = True
                self.abandon()

    def poll(self, limit: int = 64) -> list[Any]:
        """Messages that have arrived, without blocking."""
        if self.dead:
            return []
        MPI = mpi()
        out = []
        status = MPI.Status()
        for _ in range(limit):
            try:
                m = self.comm.improbe(source=0, tag=self._rx, status=status)
            except MPI.Exception:
                self.broken = True
                self.abandon()
                return out
            if m is None:
                break
            n = status.Get_count(MPI.BYTE)
            buf = bytearray(min(n, MAX_FRAME + 1))
            try:
                m.Recv([buf, MPI.BYTE])     # an oversized frame is consumed truncated, then refused
            except MPI.Exception:
                pass
            try:
                out.append(self.sealer.open(bytes(buf)))
            except ValueError as e:
                self.refused += 1
                self.refused_why = str(e)[:200]
        self._reap()
        return out

    def pending_sends(self) -> int:
        self._reap()
        return len(self._pending)

    def abandon(self) -> None:
        """Peer is dead: stop using the link. Pending sends to a dead peer are dropped, not waited
        for (Disconnect would wait for them), and we never Disconnect a dead peer's link."""
        self.dead = True
        self._pending = []

    def close(self) -> None:
        """Orderly disconnect from a live peer."""
        if self.dead:
            return
        for r, _ in self._pending:
            try:
                r.Wait()
            except Exception:
                pass
        self._pending = []
        try:
            self.comm.Disconnect()
        except Exception:
            pass
        self.dead = True


class Port:
    """Controller side: an open port, published as a file in the job directory."""

    def __init__(self, path: Path):
        MPI = mpi()
        self.name = MPI.Open_port()
        self.path = path
        fsync_write(path, self.name.encode())

    def accept(self, knock_after: float = 5.0) -> tuple[Channel, bool]:
        """Accept one announced Connect; returns (link, whether the watchdog knocked).
        MPI_Comm_accept has no timeout: if the announced agent died before connecting, a watchdog
        connects a throw-away process to our own port after `knock_after` seconds so the
        controller is never stuck here (its link sends nothing and is dropped by the caller)."""
        MPI = mpi()
        done = threading.Event()
        knocked = []

        def knock():
            if not done.is_set():
                knocked.append(True)
                _knock(self.name)
        watchdog = threading.Timer(knock_after, knock)
        watchdog.daemon = True
        watchdog.start()
        try:
            comm = MPI.COMM_SELF.Accept(self.name)
        finally:
            done.set()
            watchdog.cancel()
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        return Channel(comm), bool(knocked)

    def close(self) -> None:
        try:
            mpi().Close_port(self.name)
        except Exception:
            pass


def _knock(port_name: str) -> None:
    subprocess.Popen(mpiexec_argv([sys.executable, "-m", "tm_slurm.control.mpi", "knock", port_name]),
                     env=mpi_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)


def connect(port_name: str, timeout: float = 60.0) -> Channel:
    """Connect to the controller's port; a Connect that gave up (EAGAIN while the controller
    was busy) is simply tried again."""
    MPI = mpi()
    deadline = time.monotonic() + timeout
    while True:
        try:
            comm = MPI.COMM_SELF.Connect(port_name)
            break
        except MPI.Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    return Channel(comm)


if __name__ == "__main__" and sys.argv[1:2] == ["knock"]:
    connect(sys.argv[2], timeout=10)
    os._exit(0)             # no Disconnect: the controller drops this link without a word
