"""NCCL's delivery of results and errors (comm/nccllike.py), what the step's vote makes of it
(GroupTable.settle, abort_members, overdue), and who is hung (controller/hangs.py).

The backend under the nccl-like group here is a stand-in whose works end when the test says,
successfully or not: what gloo does to a survivor when its peer dies, on demand."""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from tm_slurm.comm.groups import Group
from tm_slurm.comm.handles import GroupTable, finish
from tm_slurm.comm.nccllike import Aborted, NcclLikeGroup
from tm_slurm.controller.hangs import Hangs, culprit


class _Inner:
    """A gloo work: wait() blocks until the test ends it."""

    def __init__(self):
        self.ended = threading.Event()
        self.ok = True

    def wait(self):
        self.ended.wait()
        if not self.ok:
            raise RuntimeError("Connection closed by peer")
        return True


class _Backend:
    def __init__(self):
        self.issued: list[_Inner] = []

    def rank(self):
        return 0

    def size(self):
        return 2

    def allreduce(self, tensors, opts=None):
        w = _Inner()
        self.issued.append(w)
        return w


def _group(timeout_s: float = 30.0) -> tuple[Group, _Backend]:
    be = _Backend()
    g = NcclLikeGroup(be, timeout_s)
    return Group("dp/x", "p", (0, 1), 0, g, g, "nccl-like"), be


def _table(g: Group) -> tuple[GroupTable, list]:
    errors = []
    t = GroupTable(lambda gid, e: errors.append((gid, str(e))), 30.0)
    t.swap({g.id: g})
    t.begin_step(5)
    return t, errors


def _until(pred, s: float = 2.0):
    end = time.monotonic() + s
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def test_a_failed_collective_completes_its_future_and_stays_pending_until_aborted():
    g, be = _group()
    t = torch.ones(3)
    work = g.pg.allreduce([t])
    assert not work.get_future().done()
    be.issued[0].ok = False
    be.issued[0].ended.set()                     # the peer died: gloo's work failed
    _until(work.get_future().done)
    assert work.get_future().value() == [t]      # the future never carries the failure
    assert work.wait() is True
    assert not work.is_completed() and work.exception() is None     # NCCL: the kernel spins on
    g.backend.abort("node2 failed")
    assert work.is_completed() and isinstance(work.exception(), Aborted)
    with pytest.raises(dist.DistBackendError, match="aborted"):
        g.pg.allreduce([t])                      # nothing new starts on an aborted communicator


def test_the_watchdog_times_a_pending_work_out():
    g, be = _group(timeout_s=0.05)
    work = g.pg.allreduce([torch.ones(1)])
    assert not work.is_completed()
    time.sleep(0.1)
    assert work.is_completed() and "timeout" in str(work.exception())


def test_a_step_whose_collective_fails_after_its_future_completed_is_not_voted_ok():
    """What the vote used to see (the future) and what it now sees (the work's status)."""
    g, be = _group()
    table, errors = _table(g)
    table.call(g.id, "allreduce", ([torch.ones(2)],), [])
    be.issued[0].ok = False
    be.issued[0].ended.set()
    fut = table.works[0][1].get_future()
    _until(fut.done)
    assert table.broken == set()                 # the fail-through path saw a success
    threading.Timer(0.05, table.abort_members, args=([1], "node2 failed")).start()
    t0 = time.monotonic()
    table.settle(10.0)                           # released by the abort, not by the deadline
    assert time.monotonic() - t0 < 1.0
    assert table.broken == {g.id} and g.aborted
    assert any("aborted" in e for _, e in errors)


def test_settle_breaks_and_aborts_a_group_whose_work_is_still_pending_at_the_deadline():
    g, be = _group()
    table, _ = _table(g)
    table.call(g.id, "allreduce", ([torch.ones(1)],), [])
    table.settle(0.05)
    assert table.broken == {g.id} and g.aborted
    assert table.works == []
    # the next op on it fails through at once (a broken or aborted group is not called)
    table.begin_step(6)
    assert table.allreduce(g.id, torch.ones(1), "sum") is False


def test_settle_passes_a_step_whose_collectives_completed():
    g, be = _group()
    table, _ = _table(g)
    table.call(g.id, "allreduce", ([torch.ones(1)],), [])
    be.issued[0].ended.set()
    table.settle(5.0)
    assert table.broken == set() and not g.aborted


def test_abort_members_touches_only_the_groups_of_the_failed_ranks():
    g, _ = _group()
    other = Group("tp/y", "q", (0, 2), 0, *(2 * [NcclLikeGroup(_Backend(), 30.0)]), "nccl-like")
    table, _ = _table(g)
    table.swap({other.id: other})
    assert table.abort_members([1], "node2 failed") == [g.id]
    assert g.aborted and not other.aborted


def test_overdue_reports_each_pending_work_once_and_nothing_after_the_loop():
    g, be = _group()
    table, _ = _table(g)
    table.call(g.id, "allreduce", ([torch.ones(1)],), [])
    assert table.overdue(60.0) == []
    (gid, members, waited), = table.overdue(0.0)
    assert (gid, members) == (g.id, (0, 1)) and waited >= 0
    assert table.overdue(0.0) == []
    table.begin_step(None)
    table.call(g.id, "allreduce", ([torch.ones(1)],), [])
    assert table.overdue(0.0) == []


def test_finish_raises_on_a_transfer_that_failed_or_never_ended():
    g, be = _group(timeout_s=30.0)
    ok = g.pg.allreduce([torch.ones(1)])
    be.issued[0].ended.set()
    finish([ok], 1.0)
    bad = g.pg.allreduce([torch.ones(1)])
    be.issued[1].ok = False
    be.issued[1].ended.set()
    with pytest.raises(TimeoutError):
        finish([bad], 0.05)
    g.backend.abort("x")
    with pytest.raises(Aborted):
        finish([bad], 1.0)


def test_the_hung_node_is_the_one_every_waiter_waits_for():
    node_of = {0: "n1", 1: "n2", 2: "n3", 3: "n4"}.get
    assert culprit(frozenset({0, 1}), {0}, {0}, node_of) == "n2"
    assert culprit(frozenset({0, 1}), {0, 1}, {0, 1}, node_of) is None       # both wait: nobody named
    assert culprit(frozenset({0, 1, 2}), {0}, {0}, node_of) is None          # two nodes absent
    assert culprit(frozenset({0, 1}), {0}, {0, 1}, node_of) is None          # n2 waits elsewhere
    assert culprit(frozenset({0, 9}), {0}, {0}, node_of) is None             # not a held rank


def test_hangs_decide_one_grace_after_the_first_report_and_forget_old_generations():
    node_of = {0: "n1", 1: "n2", 2: "n3", 3: "n4"}.get
    h = Hangs(grace_s=2.0)
    h.note(3, "dp/a", [1, 3], 1, now=10.0)      # rank 1 waits on rank 3
    h.note(3, "pp/b", [0, 1], 0, now=10.5)      # rank 0 waits on rank 1, which waits itself
    assert h.due(11.0, 3, node_of) == []
    assert h.due(12.0, 3, node_of) == [("n4", "dp/a", 1)]
    assert h.due(13.0, 3, node_of) == []        # pp/b names nobody: rank 1 is a waiter
    assert h.stalls == {}
    h.note(3, "dp/a", [1, 3], 1, now=20.0)
    assert h.due(30.0, 4, node_of) == [] and h.stalls == {}     # a new generation: moot
