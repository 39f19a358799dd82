"""`Comm` handles: what user code calls for collectives. They name a group by id and look it up in
the runtime's `GroupTable` on every call, so a swap is a pointer change in the table and the
user's objects (and any compiled code around them) never change.

Failures *fail through*: an op on a broken group returns at once (a recv leaves zeros) and the
group is marked broken, so the step's program runs to its end with the same sequence of ops on
every healthy group, keeping those groups consistent and reusable; the commit vote then discards
the step on every rank. A rank votes for its step only once every collective the step issued is
known to have completed without error (`settle`): on NCCL a work's future completes when it is
enqueued, and its failure shows only in the work's status (docs/design.md §11).
"""
from __future__ import annotations

import threading
import time
import weakref
from datetime import timedelta
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from .. import faults
from .groups import Group, abort_together

MAX_WORKS = 1024
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class FailThroughWork(dist.Work):
    """What every collective returns (to the low-level API and to torch code such as DDP's
    reducer, which waits on its future): it completes, successfully, even when the collective
    failed, so the step runs on to the vote."""

    def __init__(self, fut: torch.futures.Future):
        super().__init__()
        self._fut = fut

    def wait(self, timeout=None) -> bool:
        self._fut.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return True


def done(outs: list) -> FailThroughWork:
    f = torch.futures.Future()
    f.set_result(outs)
    return FailThroughWork(f)


def _outcome(g: Group, work) -> tuple[bool, BaseException | None]:
    """(ended, its error). On gloo a work's future completes with its data or its error, and
    nothing else is asked: its is_completed() waits for the work's lock, which a thread blocked
    in the work's wait() holds (the watchdog would block behind a send or recv), and some gloo
    works never set it; a send or recv (no future) is pending until its wait returns. On NCCL
    (and nccl-like) the future completes at enqueue: only the work's status says."""
    if g.kind == "gloo":
        try:
            fut = work.get_future()
        except RuntimeError:
            return False, None
        if not fut.done():
            return False, None
        try:
            fut.value()
        except Exception as e:
            return True, e
        return True, None
    if not work.is_completed():
        return False, None
    return True, work.exception()


def finish(works: list, timeout_s: float) -> None:
    """Every work of `works` has completed without error, or raise: what a transfer needs before
    its sender moves on or exits. `wait()` first (gloo: the host waits for the data, once; NCCL:
    only the stream does, and the host goes on), then each work's own status, to a deadline."""
    for w in works:
        w.wait()
    end = time.monotonic() + timeout_s
    for w in works:
        while not w.is_completed():
            if time.monotonic() > end:
                raise TimeoutError(f"a transfer still pending after {timeout_s:g} s")
            time.sleep(0.0005)
        if (e := w.exception()) is not None:
            raise e


class GroupTable:
    """Current group instances by id, plus which of them broke during the current step."""

    def __init__(self, on_error: Callable[[str, BaseException], None], op_timeout: float):
        self.groups: dict[str, Group] = {}
        self.broken: set[str] = set()
        self.on_error = on_error
        self.op_timeout = timedelta(seconds=op_timeout)
        self.recorder = None       # set on ranks that record stand-ins for standbys' sandboxes
        self.comm_s = 0.0          # time spent inside collectives (waiting, mostly) this step
        self.step: int | None = None
        self.watched = False
        self.works: list[tuple[str, dist.Work, float]] = []   # this step's, with their start
        self._overdue: set[int] = set()    # id() of works reported overdue (`overdue`)
        self._lock = threading.Lock()

    def swap(self, new: dict[str, Group]) -> list[Group]:
        """Install new instances; returns the replaced ones (for the reaper)."""
        with self._lock:
            old = [self.groups[k] for k in new if k in self.groups]
            self.groups.update(new)
            self.broken -= set(new)
        return old

    def identities(self) -> dict[str, int]:
        """Object identity of each installed group (tests check kept groups keep theirs)."""
        return {gid: id(g.pg) for gid, g in self.groups.items()}

    def begin_step(self, step: int | None, watched: bool = True) -> None:
        """A step starts (None: the training is over). `watched`: its collectives are reported
        when overdue (worker/loop.py leaves out the steps ranks may enter far apart: the first
        after a start, a recovery or a switch; the collective timeout bounds those)."""
        self.step, self.watched = step, watched
        self.broken.clear()
        self.comm_s = 0.0
        with self._lock:
            self.works, self._overdue = [], set()

    def settle(self, timeout: float) -> None:
        """Before the vote: wait until every collective this step issued has completed, and break
        the group of each one that failed, or is still pending after `timeout` (that group is
        aborted too: a communicator with an op in flight is not reusable). On gloo they all have
        by now (a future completes with its data); on NCCL this is where a failure is seen. A
        work on an aborted group counts as failed whatever its status says (after an abort NCCL
        may report it completed)."""
        t0 = time.perf_counter()
        end = time.monotonic() + timeout
        with self._lock:
            works = list(self.works)     # still the watchdog's to see while this waits
        pause = 2e-5
        for gid, work, _ in works:
            g = self.groups.get(gid)
            while gid not in self.broken:
                if g is None or g.aborted:
                    self._broke(gid, RuntimeError(f"group {gid} was aborted"))
                elif (o := _outcome(g, work))[0]:
                    if o[1] is not None:
                        self._broke(gid, o[1])
                    break
                elif time.monotonic() > end:
                    self._broke(gid, TimeoutError(f"a collective on {gid} still pending after {timeout:g} s"))
                    abort_together([g], "a collective pending past the step's deadline")
                else:
                    time.sleep(pause)
                    pause = min(pause * 2, 1e-3)
        with self._lock:
            self.works = []
        self.comm_s += time.perf_counter() - t0

    def overdue(self, after_s: float) -> list[tuple[str, tuple[int, ...], float]]:
        """(group, members, seconds waited) of each work of this step pending for more than
        `after_s`, once each: what the worker's watchdog reports (a peer that never joined)."""
        now = time.monotonic()
        if self.step is None or not self.watched:
            return []
        with self._lock:
            works = [(gid, w, t) for gid, w, t in self.works if id(w) not in self._overdue]
        out = []
        for gid, w, t in works:
            if now - t > after_s and (g := self.groups.get(gid)) is not None and not _outcome(g, w)[0]:
                with self._lock:
                    self._overdue.add(id(w))
                out.append((gid, g.members, now - t))
        return out

    def abort_members(self, ranks: Iterable[int], why: str) -> list[str]:
        """A node holding `ranks` failed: abort every installed group with one of them, so that
        no collective of this rank waits on it (the host may be blocked in one right now)."""
        dead = set(ranks)
        hit = [g for g in list(self.groups.values()) if dead & set(g.members)]
        for g in hit:
            self._broke(g.id, RuntimeError(f"group {g.id} aborted: {why}"))
        abort_together(hit, why)
        return [g.id for g in hit]

    def drop(self, ids: Iterable[str]) -> list[Group]:
        with self._lock:
            return [self.groups.pop(i) for i in list(ids) if i in self.groups]

    def _broke(self, gid: str, e: BaseException) -> None:
        # on a backend's thread too (a future's callback): a set add and a report, both safe there
        self.broken.add(gid)
        self.on_error(gid, e)

    def call(self, gid: str, op: str, args: tuple, outs: list) -> FailThroughWork:
        """`op` (a ProcessGroup method: "allreduce", "_allgather_base", "send", ...) with `args` on
        the current instance of group `gid`. The work returned never fails: a failure completes it
        with `outs` (the tensors it writes) as they are and marks the group broken for this step."""
        faults.at("collective", step=self.step)
        if gid in self.broken:
            return done(outs)
        g = self.groups.get(gid)
        if g is None or g.aborted:
            self._broke(gid, RuntimeError(f"group {gid} is {'aborted' if g else 'not built'}"))
            return done(outs)
        try:
            work = getattr(g.pg, op)(*args)
        except Exception as e:          # gloo: RuntimeError / DistBackendError on a dead or hung peer
            self._broke(gid, e)
            return done(outs)
        entry = (gid, work, time.monotonic())
        with self._lock:
            if len(self.works) >= MAX_WORKS:     # collectives outside a step: no settle clears them
                self.works = [x for x in self.works if (h := self.groups.get(x[0])) is not None
                              and not _outcome(h, x[1])[0]]
            self.works.append(entry)
        try:
            fut = work.get_future()
        except RuntimeError:
            # gloo's send, recv and reduce-scatter have none: wait here, once (a gloo work waited
            # twice waits for a second completion), watched while it waits; once waited it is
            # settled (some of those works never say is_completed())
            try:
                work.wait()
            except Exception as e:
                self._broke(gid, e)
            with self._lock:
                if entry in self.works:
                    self.works.remove(entry)
            return done(outs)

        # the callback runs on a backend thread and must not hold the table: were it the last
        # holder, the table's groups would be destroyed on their own worker thread, which then
        # joins itself ("Resource deadlock avoided", the process aborts)
        table = weakref.ref(self)

        def settle(f):
            try:
                f.value()
            except Exception as e:
                t = table()
                if t is not None:
                    t._broke(gid, e)
            return outs
        return FailThroughWork(fut.then(settle))

    def _wait(self, gid: str, op: str, args: tuple, outs: list) -> bool:
        t0 = time.perf_counter()
        try:
            self.call(gid, op, args, outs).wait()
        finally:
            self.comm_s += time.perf_counter() - t0
        return gid not in self.broken

    # ---- the low-level API's ops (Comm, PipeComm), each waited for
    def allreduce(self, gid: str, t: torch.Tensor, op: str) -> bool:
        o = dist.AllreduceOptions()
        o.reduceOp = _OPS[op]
        o.timeout = self.op_timeout
        return self._wait(gid, "allreduce", ([t], o), [t])

    def broadcast(self, gid: str, t: torch.Tensor, root: int) -> bool:
        o = dist.BroadcastOptions()
        o.rootRank = root
        o.timeout = self.op_timeout
        return self._wait(gid, "broadcast", ([t], o), [t])

    def send(self, gid: str, t: torch.Tensor, peer: int) -> bool:
        return self._wait(gid, "send", ([t], peer, 0), [t])

    def recv(self, gid: str, t: torch.Tensor, peer: int) -> bool:
        ok = self._wait(gid, "recv", ([t], peer, 0), [t])
        if not ok:
            t.zero_()
        elif self.recorder is not None:
            self.recorder.note(peer, t)
        return ok


class Comm:
    """Collectives over one group (DP or TP). Size 1: every op is a local no-op."""

    def __init__(self, table: GroupTable, gid: str | None, size: int, rank: int):
        self._table, self.gid, self.size, self.rank = table, gid, size, rank

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.size > 1:
            self._table.allreduce(self.gid, t, op)
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1:
            self._table.broadcast(self.gid, t, src)
        return t

    def all_reduce_grads(self, params, average: bool = True) -> None:
        """Average (or sum) the gradients of `params` (a module or an iterable of parameters)
        in one flat buffer: one collective a step, like DDP's bucketing with one bucket."""
        if isinstance(params, torch.nn.Module):
            params = params.parameters()
        ps = [p for p in params if p.requires_grad]
        if self.size == 1 or not ps:
            return
        for p in ps:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in ps])
        self._table.allreduce(self.gid, flat, "sum")
        if average:
            flat /= self.size
        off = 0
        for p in ps:
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p.grad))
            off += n


class PipeComm:
    """Point-to-point between adjacent pipeline stages (one two-member group per stage pair)."""

    def __init__(self, table: GroupTable, prev_gid: str | None, next_gid: str | None):
        self._table, self.prev_gid, self.next_gid = table, prev_gid, next_gid

    def _need(self, gid, what):
        if gid is None:
            raise RuntimeError(f"{what}: this is the {'first' if what.endswith('prev') else 'last'} "
                               "pipeline stage, there is no such neighbour")

    def send_next(self, t: torch.Tensor) -> None:
        self._need(self.next_gid, "send_next")
        self._table.send(self.next_gid, t.contiguous(), 1)

    def recv_prev(self, t: torch.Tensor) -> torch.Tensor:
        self._need(self.prev_gid, "recv_prev")
        self._table.recv(self.prev_gid, t, 0)
        return t

    def send_prev(self, t: torch.Tensor) -> None:
        self._need(self.prev_gid, "send_prev")
        self._table.send(self.prev_gid, t.contiguous(), 0)

    def recv_next(self, t: torch.Tensor) -> torch.Tensor:
        self._need(self.next_gid, "recv_next")
        self._table.recv(self.next_gid, t, 1)
        return t
