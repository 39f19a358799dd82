"""Giving nodes back to Slurm off the main loop (controller/releases.py)."""
from __future__ import annotations

import threading

import pytest

from tm_slurm.controller.releases import Releases
from tm_slurm.slurm.backend import JobInfo, SlurmError


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


class OnceBackend:
    """Slurm 21.08-24.05 without slurmdbd: a job shrinks once, every later update is refused.
    `knows`: whether the backend can tell so up front (CliBackend, from `scontrol show config`)."""

    def __init__(self, knows):
        self.nodes, self.updates, self.knows = ["node1", "node2", "node3", "node4"], 0, knows

    def job(self, job_id):
        return JobInfo(job_id=job_id, state="RUNNING", nodes=tuple(self.nodes), user="u", workdir="/w",
                       batch_host="node1", time_limit_s=None, restarts=0, reason="")

    def resizes_once(self):
        if self.knows is None:
            raise SlurmError("`scontrol show config` timed out after 10 s")
        return self.knows

    def release_nodes(self, job_id, keep):
        self.updates += 1
        if self.updates > 1:
            raise SlurmError(f"`scontrol update JobId={job_id} NodeList=...` failed with exit code 1: slurm_update "
                             "error: Job update not available right now, the DB index is being set, try again in a bit")
        self.nodes = list(keep)


@pytest.mark.parametrize("knows", [True, False, None])
def test_a_slurm_that_shrinks_a_job_once_is_asked_once(tmp_path, knows):
    """Told up front, the launcher never sends the doomed update (slurmctld would hold a thread
    5 s on it); not told (or the question failed), it stops after the first refusal."""
    from tm_slurm.config import Config
    from tm_slurm.slurm.launcher import SlurmLauncher
    be = OnceBackend(knows)
    launcher = SlurmLauncher(tmp_path, Config(), "7", b"k" * 32, backend=be)
    launcher.batch_host = "node1"
    assert launcher.release("node3") == "released: job now on 3 nodes"
    if not knows:
        with pytest.raises(SlurmError, match="DB index"):
            launcher.release("node4")
    assert launcher.release("node2").startswith("not released: Slurm will not shrink job 7 again")
    assert launcher.release("node1").startswith("kept: the batch host")
    assert be.updates == (1 if knows else 2) and be.nodes == ["node1", "node2", "node4"]
