"""A node's heartbeat says only what changed (agent.heartbeat), the controller keeps what it knew
of the rest (controller/workers.merge), and a beat's step records land in Progress."""
from __future__ import annotations

from types import SimpleNamespace

from tm_slurm.agent import Agent, WorkerProc
from tm_slurm.control import auth, codec
from tm_slurm.controller.progress import Progress
from tm_slurm.controller.workers import merge


class Sent:
    def __init__(self):
        self.msgs = []

    def send(self, m):
        self.msgs.append(codec.loads(codec.prepare(m).encode()))   # as it crosses the wire


def worker(local, pid, rank):
    return WorkerProc(local, SimpleNamespace(pid=pid), wire=None, rank=rank)


def rec(step):
    return (step, 0.05, 0.1, 1.0, 1e9, False, 0.2)


def seen(view):
    return {k: (w.pid, w.rank, w.step, w.committed, w.alive) for k, w in view.items()}


def test_a_beat_says_only_what_changed_and_the_controller_keeps_the_rest(tmp_path):
    a = Agent(tmp_path, "node1", 0.5, 30.0, 10.0, auth.new_secret())
    ch, progress = Sent(), Progress()
    a.workers = {0: worker(0, 11, 0), 1: worker(1, 12, 1)}
    for w in a.workers.values():
        w.step, w.committed, w.progress = 5, 4, [rec(4)]
    a.heartbeat(ch)                                     # the first: every worker, as it is
    hb = ch.msgs[-1]
    assert hb.full and [w.local for w in hb.workers] == [0, 1] and hb.moves == ()
    assert progress.add_rows(hb.records, 2) == {4} and progress.reported(4) == 2
    view = merge(None, hb)
    assert seen(view) == {0: (11, 0, 5, 4, True), 1: (12, 1, 5, 4, True)}
    a.heartbeat(ch)                                     # nothing new: an empty beat
    hb = ch.msgs[-1]
    assert not hb.full and (hb.workers, hb.moves, hb.records) == ((), (), ())
    assert seen(merge(view, hb)) == seen(view)
    a.workers[1].step, a.workers[1].committed = 6, 5     # worker 1 moved on
    a.workers[1].progress = [rec(5), rec(6)[:6]]        # (busy_s may be left out)
    a.heartbeat(ch)
    hb = ch.msgs[-1]
    assert not hb.full and hb.workers == () and hb.moves == (1, 6, 5)
    assert hb.records == (1, *rec(5), 1, *rec(6)[:6], 0.0) and not a.workers[1].progress
    view = merge(view, hb)
    assert seen(view) == {0: (11, 0, 5, 4, True), 1: (12, 1, 6, 5, True)}
    assert progress.add_rows(hb.records, 2) == {5, 6} and progress.committed(1) == 6
    a.workers[0].done = True                            # worker 0 exited: it is named whole
    a.heartbeat(ch)
    hb = ch.msgs[-1]
    assert [(w.local, w.alive) for w in hb.workers] == [(0, False)] and hb.moves == ()
    assert seen(merge(view, hb))[0] == (11, 0, 5, 4, False)
    a.workers = {0: worker(0, 21, 0)}                   # a restart with fewer workers: all anew
    a.heartbeat(ch)
    hb = ch.msgs[-1]
    assert hb.full and [(w.local, w.pid) for w in hb.workers] == [(0, 21)]
    assert list(merge(view, hb)) == [0]


def test_rows_of_a_rank_outside_the_job_or_cut_short_are_left_out():
    p = Progress()
    rows = (0, *rec(3), 7, *rec(3), "x", *rec(3), 1, *rec(3)[:4])
    assert p.add_rows(rows, 2) == {3}
    assert p.reported(3) == 1 and p.committed(0) == 3 and p.committed(1) is None
