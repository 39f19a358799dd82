"""Giving nodes back to Slurm off the main loop (controller/releases.py)."""
from __future__ import annotations

import threading

from tm_slurm.controller.releases import Releases


class SlowLauncher:
    """release() waits until the test lets it go; "bad" nodes fail as a SlurmError would."""

    def __init__(self):
        self.go = threading.Event()
        self.asked: list[str] = []

    def release(self, node):
        self.go.wait(10)
        self.asked.append(node)
        if node == "bad":
            raise RuntimeError("scontrol: Invalid node name specified")
        return "released: job now on 3 nodes"


def test_releases_run_in_order_off_the_loop_and_are_logged_when_done():
    events, launcher = [], SlowLauncher()
    r = Releases(launcher, lambda kind, **f: events.append((kind, f)), enabled=True)
    try:
        r.submit("node2", "failed: crash")
        r.submit("bad", "evacuated")
        r.poll()
        assert events == [] and r.pending == 2          # slurmctld has not answered: nothing waits
        launcher.go.set()
        r.close(10)
        assert launcher.asked == ["node2", "bad"]
        assert [(f["node"], f["why"], f["result"]) for _, f in events] == [
            ("node2", "failed: crash", "released: job now on 3 nodes"),
            ("bad", "evacuated", "not released: scontrol: Invalid node name specified")]
        assert {k for k, _ in events} == {"node_released"} and r.pending == 0
    finally:
        launcher.go.set()


def test_a_release_slurm_does_not_answer_is_logged_as_not_released_at_the_end():
    events, launcher = [], SlowLauncher()
    r = Releases(launcher, lambda kind, **f: events.append(f), enabled=True)
    r.submit("node4", "failed: hang")
    r.close(0.2)
    launcher.go.set()
    assert [(f["node"], f["result"]) for f in events] == [
        ("node4", "not released: slurmctld did not answer within 0 s")]


def test_release_nodes_false_keeps_every_node():
    events, launcher = [], SlowLauncher()
    r = Releases(launcher, lambda kind, **f: events.append(f), enabled=False)
    r.submit("node3", "evacuated")
    r.close(1)
    assert launcher.asked == [] and events[0]["result"] == "kept: slurm.release_nodes is false"
