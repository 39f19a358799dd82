"""A node's heartbeat names only the workers whose state changed (agent.heartbeat), and the
controller keeps what it knew of the others."""
from __future__ import annotations

from types import SimpleNamespace

from tm_slurm.agent import Agent, WorkerProc
from tm_slurm.control import auth, codec
from tm_slurm.messages import Heartbeat


class Sent:
    def __init__(self):
        self.msgs = []

    def send(self, m):
        self.msgs.append(codec.loads(codec.prepare(m).encode()))   # as it crosses the wire


def worker(local, pid, rank):
    return WorkerProc(local, SimpleNamespace(pid=pid), wire=None, rank=rank)


def merged(known: dict, hb: Heartbeat) -> dict:
    """The controller's rule (Controller._dispatch)."""
    return {w.local: w for w in hb.workers} if hb.full else {**known, **{w.local: w for w in hb.workers}}


def test_a_beat_names_only_what_changed(tmp_path):
    a = Agent(tmp_path, "node1", 0.5, 30.0, 10.0, auth.new_secret())
    ch = Sent()
    a.workers = {0: worker(0, 11, 0), 1: worker(1, 12, 1)}
    known: dict = {}
    for w in a.workers.values():
        w.step, w.committed, w.progress = 5, 4, [(4, 0.05, 0.1, 1.0, 1e9, False, 0.2)]
    a.heartbeat(ch)                                     # the first: every worker
    hb = ch.msgs[-1]
    assert hb.full and [w.local for w in hb.workers] == [0, 1] and hb.workers[0].progress
    known = merged(known, hb)
    a.heartbeat(ch)                                     # nothing new: an empty beat
    hb = ch.msgs[-1]
    assert not hb.full and hb.workers == () and merged(known, hb) == known
    a.workers[1].step, a.workers[1].committed = 6, 5     # worker 1 moved on
    a.workers[1].progress = [(5, 0.05, 0.1, 1.0, 1e9, False, 0.2)]
    a.heartbeat(ch)
    hb = ch.msgs[-1]
    assert not hb.full and [(w.local, w.step, w.progress[0][0]) for w in hb.workers] == [(1, 6, 5)]
    known = merged(known, hb)
    assert (known[0].step, known[1].step) == (5, 6) and not a.workers[1].progress
    a.workers[0].done = True                            # worker 0 exited: its state changed
    a.heartbeat(ch)
    assert [(w.local, w.alive) for w in ch.msgs[-1].workers] == [(0, False)]
    a.workers = {0: worker(0, 21, 0)}                   # a restart with fewer workers: all anew
    a.heartbeat(ch)
    hb = ch.msgs[-1]
    assert hb.full and [(w.local, w.pid) for w in hb.workers] == [(0, 21)]
    assert list(merged(known, hb)) == [0]
