"""The MPI control plane (docs/design.md §2): the controller opens a port, each agent connects and keeps
its own intercommunicator, so a dead agent breaks only its own link.

Everything is non-blocking (isend + a posted irecv, tested): blocking receives burn a core, and MPI never
reports a dead peer, so liveness is decided by heartbeats above this layer. After a failure a
process never calls MPI_Finalize (it can hang on the dead peer): `mpi4py.rc.finalize = False`.

A process that uses Connect/Accept must be started by an `mpiexec -n 1` (two singletons share the
same process ids and Connect fails with "groups not disjoint"); `mpiexec_argv` builds that wrapper,
which also works inside an srun step: the job's own (control/pmi.py), which serves its one process
PMI over a socketpair and listens on no port.
"""
from __future__ import annotations

import os
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


def under_mpiexec() -> bool:
    return os.environ.get(MPI_ENV) == "1"


def mpiexec_argv(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "tm_slurm.control.pmi", *argv]


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
    (with the last reason), for the owner to log once per peer.

    A frame travels as pieces of at most INJECT_BYTES, each led by one byte (1: more follow), so
    that every piece is injected (complete once sent: nothing is in flight when a peer dies) and
    a receive of that size is always posted: whether anything arrived on any number of links is
    then one `Testsome` over their receives (`arrived`), not a probe per link."""

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
        self._rbuf = bytearray(INJECT_BYTES)
        self._part = bytearray()         # the pieces of the frame being received
        self._oversized = False
        self._frames: list[Any] = []     # opened, not yet returned by poll
        self.rreq = None
        self._post()

    def _post(self) -> None:
        MPI = mpi()
        try:
            self.rreq = self.comm.Irecv([self._rbuf, MPI.BYTE], source=0, tag=self._rx)
        except MPI.Exception:
            self.broken = True
            self.abandon()

    def send(self, msg: Any, sync: bool = False) -> None:
        """`sync`: complete only once the peer has received it (and, in order, everything sent
        before). For a process's last words: an injected frame is complete as soon as the
        provider buffered it (mpi_env), and a process that exits then may take it along."""
        if self.dead:
            return
        MPI = mpi()
        frame = self.sealer.seal(msg)
        step = INJECT_BYTES - 1
        for i in range(0, max(len(frame), 1), step):
            last = i + step >= len(frame)
            buf = bytearray(b"\0" if last else b"\1") + frame[i:i + step]
            try:
                isend = self.comm.Issend if sync and last else self.comm.Isend
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

    def received(self, n: int) -> None:
        """The posted receive completed with a piece of N bytes: take it, post the next."""
        piece = self._rbuf[:n]
        self._post()
        if self._oversized or len(self._part) + n > MAX_FRAME + 1:
            self._oversized, self._part = True, bytearray()     # read on, to the frame's end
        else:
            self._part += piece[1:]
        if n and piece[0]:
            return
        frame, self._part = bytes(self._part), bytearray()
        if self._oversized:
            self._oversized = False
            self._refuse(f"a frame over {MAX_FRAME} bytes")
            return
        try:
            self._frames.append(self.sealer.open(frame))
        except ValueError as e:
            self._refuse(str(e))

    def _refuse(self, why: str) -> None:
        self.refused += 1
        self.refused_why = why[:200]

    def poll(self, limit: int = 64) -> list[Any]:
        """Messages that have arrived, without blocking."""
        if self.dead:
            return []
        MPI = mpi()
        status = MPI.Status()
        for _ in range(limit):
            if self.dead:
                break
            if self.rreq == MPI.REQUEST_NULL:     # completed in a Testsome that failed elsewhere
                self._post()
                continue
            try:
                if not self.rreq.Test(status):
                    break
            except MPI.Exception as e:
                if e.Get_error_class() != MPI.ERR_TRUNCATE:
                    self.broken = True
                    self.abandon()
                    break
                self._post()            # a piece longer than any we send: not ours
                self._refuse("a piece over the inject size")
                continue
            self.received(status.Get_count(MPI.BYTE))
        out, self._frames = self._frames, []
        self._reap()
        return out

    def pending_sends(self) -> int:
        self._reap()
        return len(self._pending)

    def _cancel_receive(self) -> None:
        req, self.rreq = self.rreq, None
        if req is None:
            return
        try:
            req.Cancel()
            if not req.Test():
                _CANCELLED.append((req, self._rbuf))
        except Exception:
            _CANCELLED.append((req, self._rbuf))

    def abandon(self) -> None:
        """Peer is dead: stop using the link. Pending sends to a dead peer are dropped, not waited
        for (Disconnect would wait for them), and we never Disconnect a dead peer's link."""
        self.dead = True
        self._pending = []
        self._cancel_receive()

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
        self._cancel_receive()
        try:
            self.comm.Disconnect()
        except Exception:
            pass
        self.dead = True


# receives cancelled but not yet seen complete, with their buffers: MPI may still write into a
# buffer until then, so neither may be freed (one entry per link given up on, at most)
_CANCELLED: list = []
_STATUSES: list = []        # reused by `arrived`: one per link


def arrived(links: dict) -> list:
    """The keys of LINKS (key -> Channel) whose channel received a piece, found in one MPI call
    however many there are: a link with nothing is not touched (a probe per link cost 2.8 ms a
    pass at 1,025 links). Their `poll` returns what arrived."""
    keys = [k for k, c in links.items() if not c.dead and c.rreq is not None]
    live = [links[k] for k in keys]
    if not live:
        return []
    MPI = mpi()
    while len(_STATUSES) < len(live):
        _STATUSES.append(MPI.Status())
    try:
        done = MPI.Request.Testsome([c.rreq for c in live], _STATUSES[:len(live)])
    except MPI.Exception:
        return keys             # an error in some receive: each link's own poll finds which
    out = []
    for j, i in enumerate(done or ()):       # statuses in the order of `done`
        live[i].received(_STATUSES[j].Get_count(MPI.BYTE))
        out.append(keys[i])
    if _CANCELLED:
        _CANCELLED[:] = [(r, b) for r, b in _CANCELLED if not _done(r)]
    return out


def _done(req) -> bool:
    try:
        return req.Test()
    except Exception:
        return True


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
