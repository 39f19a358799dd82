"""The Slurm watcher thread and what intake makes of it (slurm/watcher.py, controller/intake.py):
it never dies silently, a resumed node's next drain is news again, and a deferred drain that
Slurm no longer asks for is dropped."""
from __future__ import annotations

import time

from tm_slurm import config as C
from tm_slurm.controller.intake import Intake
from tm_slurm.controller.requests import Request
from tm_slurm.roles import Node, Role
from tm_slurm.slurm.backend import NodeState
from tm_slurm.slurm.classify import CLEARED
from tm_slurm.slurm.watcher import Watcher


class Backend:
    def __init__(self):
        self.states = {"n1": NodeState("n1", "ALLOCATED"), "n2": NodeState("n2", "ALLOCATED")}
        self.boom = None

    def nodes(self, names):
        if self.boom:
            raise self.boom
        return {n: self.states[n] for n in names}

    def reservations(self):
        return []


def _drain(b, node):
    b.states[node] = NodeState(node, "MIXED", frozenset({"DRAIN"}), "maintenance", time.time())


def _resume(b, node):
    b.states[node] = NodeState(node, "ALLOCATED")


def test_drain_resume_drain_is_reported_twice():
    b = Backend()
    w = Watcher(C.load(None), "1", backend=b)
    _drain(b, "n1")
    assert [(e.node, e.cause) for e in w.check(["n1", "n2"])] == [("n1", "drain")]
    assert w.check(["n1", "n2"]) == []                      # still drained: nothing new
    _resume(b, "n1")
    assert [(e.node, e.kind) for e in w.check(["n1", "n2"])] == [("n1", CLEARED)]
    _drain(b, "n1")
    assert [(e.node, e.cause) for e in w.check(["n1", "n2"])] == [("n1", "drain")]


def test_an_unexpected_error_is_reported_and_polling_goes_on():
    b = Backend()
    w = Watcher(C.load(None, {"slurm.poll_interval_s": 0.01}), "1", backend=b)
    b.boom = KeyError("state")                              # output the parser did not expect
    w.start()
    try:
        w.nodes = ("n1", "n2")
        deadline = time.monotonic() + 10
        errs = []
        while not errs and time.monotonic() < deadline:
            errs += w.poll(("n1", "n2"))[1]
            time.sleep(0.01)
        assert errs[0] == ("watcher_error", "KeyError: 'state'")
        b.boom = None
        _drain(b, "n2")
        evs = []
        while not evs and time.monotonic() < deadline:
            evs += w.poll(("n1", "n2"))[0]
            time.sleep(0.01)
        assert [e.node for e, _, _ in evs] == ["n2"]
    finally:
        w.stop()
    assert not w._thread.is_alive()


def test_a_deferred_slurm_drain_is_cancelled_when_the_node_is_resumed_a_users_is_not():
    log = []
    intake = Intake(lambda kind, **kw: log.append((kind, kw)))
    nodes = {"n1": Node("n1", Role.ACTIVE, slot=0), "n2": Node("n2", Role.ACTIVE, slot=1)}
    b = Backend()
    w = Watcher(C.load(None), "1", backend=b)
    _drain(b, "n1")
    user = Request("drain", "n2", "mine", time.time(), 0, "x.json", {})
    intake.requests([user], [], nodes)
    intake.watcher([(e, time.time(), 0.0) for e in w.check(["n1", "n2"])], [], nodes)
    assert intake.next(nodes) == [] and intake.deferred_drains == {"n1", "n2"}   # no standby
    _resume(b, "n1")
    intake.watcher([(e, time.time(), 0.0) for e in w.check(["n1", "n2"])], [], nodes)
    assert set(intake.wanted_drains) == {"n2"} and intake.deferred_drains == {"n2"}
    assert ("drain_cancelled", {"node": "n1", "why": "resumed in Slurm before it was done"}) in log


def test_polls_back_off_while_nothing_changes_and_reservations_are_asked_for_rarely():
    from tm_slurm.slurm.watcher import next_interval
    ticks = [1.0 * 2 ** i for i in range(6)]
    assert [next_interval(t, False, 1.0, 8.0) for t in ticks] == [2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    assert next_interval(8.0, True, 1.0, 8.0) == 1.0

    class Counting(Backend):
        asked = 0

        def reservations(self):
            self.asked += 1
            return []

    b, t = Counting(), [0.0]
    w = Watcher(C.load(None), "1", backend=b, mono=lambda: t[0])
    w.check(["n1", "n2"])
    assert w.changed and b.asked == 1                   # the first poll: everything is news
    for t[0] in (8.0, 16.0, 59.0):
        w.check(["n1", "n2"])
        assert not w.changed and b.asked == 1
    _drain(b, "n2")
    t[0] = 60.0
    assert [e.node for e in w.check(["n1", "n2"])] == ["n2"] and w.changed and b.asked == 2


def test_poll_settings_must_let_a_maintenance_reservation_be_seen_in_time():
    import pytest
    C.load(None, {"slurm.poll_interval_s": 60})          # no backoff above the ceiling: fine
    with pytest.raises(C.ConfigError, match="maint_horizon_s .600.0. must be larger"):
        C.load(None, {"slurm.reservation_poll_s": 595})
    assert C.load(None, {"slurm.maint_horizon_s": 0, "slurm.reservation_poll_s": 595})
