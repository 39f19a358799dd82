"""A lost controller (agent.py, worker/lost.py): the survivors' notes are scoped to one run of the
job, a node that is only cut off from a live controller does not end the job, and a controller
that is itself cut off knows it (controller/liveness.py)."""
from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tm_slurm import jobdir
from tm_slurm.agent import controller_alive, requeued_anyway
from tm_slurm.controller.liveness import controller_cut_off
from tm_slurm.controller.records import Records
from tm_slurm.events import EventLog


def test_the_lost_notes_of_a_requeued_run_are_not_the_first_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    first = jobdir.lost_dir(tmp_path)
    (first / "agent-node1.alive").write_text("1")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    again = jobdir.lost_dir(tmp_path)
    assert again != first and list(again.iterdir()) == []
    assert oct(again.stat().st_mode & 0o777) == "0o700"


def test_a_status_file_still_rewritten_means_the_controller_is_alive(tmp_path):
    status = tmp_path / "status.json"
    status.write_text("{}")
    assert not controller_alive(status, 0.5)                  # nobody writes it: gone
    assert not controller_alive(tmp_path / "none.json", 0.3)  # never written: gone
    stop = threading.Event()

    def controller():
        n = 0
        while not stop.is_set():
            n += 1
            tmp = tmp_path / ".status.tmp"
            tmp.write_text("{" + " " * n + "}")
            os.replace(tmp, status)
            time.sleep(jobdir.STATUS_EVERY_S)
    t = threading.Thread(target=controller, daemon=True)
    t.start()
    try:
        assert controller_alive(status, 4 * jobdir.STATUS_EVERY_S)
    finally:
        stop.set()
        t.join()


def test_a_large_jobs_status_is_touched_between_snapshots_and_still_shows_the_controller_alive(tmp_path):
    """At 1,024 nodes the snapshot is rewritten every 5 s, or at the next touch after something
    was logged; the touches in between (every STATUS_EVERY_S) are what the agents watch."""
    log = EventLog(jobdir.events_file(tmp_path), "j")
    ctl = SimpleNamespace(job_dir=tmp_path, log=log, nodes=SimpleNamespace(nodes=dict.fromkeys(range(1024))))
    rec = Records(ctl)
    made = []
    rec.snapshot = lambda: made.append(len(made)) or {"n": len(made)}
    status = jobdir.status_file(tmp_path)
    assert jobdir.snapshot_every_s(1024) == 5.0 and jobdir.snapshot_every_s(8) == jobdir.STATUS_EVERY_S

    def content():
        return json.loads(status.read_text())["n"]
    rec.write_status(0.0)
    stamp = status.stat().st_mtime_ns
    time.sleep(0.05)                             # past the coarse clock of file times (a jiffy)
    rec.write_status(0.5)                        # nothing happened: touched only
    assert content() == 1 and status.stat().st_mtime_ns != stamp
    log.emit("node_ready", node="n1")
    rec.write_status(1.0)                        # something was logged: rewritten
    rec.write_status(1.5)
    assert content() == 2
    rec.write_status(6.5)                        # 5 s since the last rewrite
    assert content() == 3
    rec.write_status()                           # the last one, at the end: always written
    assert content() == 4
    stop = threading.Event()

    def loop():
        now = 7.0
        while not stop.is_set():
            rec.write_status(now)
            now += jobdir.STATUS_EVERY_S
            time.sleep(jobdir.STATUS_EVERY_S)
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        assert controller_alive(status, 4 * jobdir.STATUS_EVERY_S)
        assert content() == 4, "touches only"
    finally:
        stop.set()
        t.join()
        log.close()


def test_the_controller_is_cut_off_only_when_most_of_its_agents_go_silent_together():
    T = 4.0
    quiet = {"node1": 0.1, "node2": 0.2, "node3": 0.1, "node4": 0.1, "node5": 0.3}
    assert controller_cut_off(quiet, T) == []
    # one node silent: a node failure, recovered as usual
    assert controller_cut_off({**quiet, "node3": 4.5}, T) == []
    # the batch host cut: node1 (its own agent) still talks, the rest went silent together
    # (the first past the timeout, the others a heartbeat behind)
    cut = {"node1": 0.1, "node2": 4.1, "node3": 4.0, "node4": 3.9, "node5": 3.95}
    assert controller_cut_off(cut, T) == ["node2", "node3", "node4", "node5"]
    # exactly half is no majority; two agents, one silent, is a node failure
    assert controller_cut_off({"a": 4.1, "b": 3.0, "c": 0.1, "d": 0.1}, T) == []
    assert controller_cut_off({"a": 4.1, "b": 0.1}, T) == []
    # nothing past the timeout yet: no verdict, however many are slow
    assert controller_cut_off({n: 3.9 for n in quiet}, T) == []
    assert controller_cut_off({}, T) == []


def test_a_requeue_that_said_it_failed_but_happened_is_not_cancelled(monkeypatch):
    """`scontrol requeue` can fail on the client (an answer lost or late) after slurmctld requeued
    the job; cancelling it then would end the requeued run. Slurm's restart count says which."""
    from tm_slurm.slurm.backend import SlurmError

    class Be:
        def __init__(self, answer):
            self.answer = answer

        def job(self, job_id):
            if isinstance(self.answer, Exception):
                raise self.answer
            return None if self.answer is None else SimpleNamespace(restarts=self.answer)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert requeued_anyway("7", Be(1)) and not requeued_anyway("7", Be(0))
    assert not requeued_anyway("7", Be(None)) and not requeued_anyway("7", Be(SlurmError("slurmctld down")))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")      # the second run: one restart was before it
    assert not requeued_anyway("7", Be(1)) and requeued_anyway("7", Be(2))


def test_one_thread_writes_the_survivors_part_whoever_hears_of_the_lost_controller_first(monkeypatch):
    """lost.Watch: the vote runs on the training thread; when the agent says the controller is
    lost while that thread is blocked in a vote (a store whose host is gone), the inbox's thread
    writes this rank's part in its place, once, with the step being voted as the pending one."""
    from tm_slurm.worker import lost
    calls, parked = [], []
    monkeypatch.setattr(lost, "controller_lost", lambda w, pending, error: calls.append((pending, error)))
    monkeypatch.setattr(lost, "_park", lambda: parked.append(threading.current_thread().name))
    w = SimpleNamespace(inbox=SimpleNamespace(lost_controller=None), device=torch.device("cpu"))

    watch = lost.Watch()                       # a healthy vote: nobody acts
    watch.enter(w, 5)
    watch.leave(w, 5)
    watch.take_over(w)                         # between votes: the next vote's enter acts
    assert calls == [] and parked == []

    watch.enter(w, 6)                          # blocked in the vote when the agent speaks
    w.inbox.lost_controller = "batch host lost"
    watch.take_over(w)
    for t in threading.enumerate():
        if t.name == "tm-lost":
            t.join()
    assert calls == [(6, None)]
    watch.leave(w, 6)                          # the vote returns after all: this thread parks
    assert parked == [threading.current_thread().name] and calls == [(6, None)]

    watch = lost.Watch()                       # the word came between votes
    watch.enter(w, 7)
    assert calls[-1] == (7, None) and len(calls) == 2

    w.inbox.lost_controller = None             # the store failed first, in the vote
    watch, err = lost.Watch(), ConnectionError("reset")
    watch.enter(w, 8)
    watch.leave(w, 8, err)
    watch.take_over(w)                         # the agent's word after it: nothing more
    assert calls[-1] == (8, err) and len(calls) == 3


def test_a_survivor_whose_checkpoint_cannot_be_written_says_so_and_ends_requeueable(tmp_path, monkeypatch):
    """The last committed state cannot be written (a full disk): the rank reports it and ends
    requeue-able, where the error would have ended only the writing thread (the inbox's, when
    the agent spoke first) and left the training thread parked for good."""
    from tm_slurm.exits import Exit
    from tm_slurm.worker import lost

    class Ended(Exception):
        pass

    def save(*args, **kwargs):
        raise OSError(28, "No space left on device")

    def exit_clean(code):
        raise Ended(code)

    class Sealer:
        def seal(self, m):
            self.m = m
            return b"sealed"

        def open(self, data):
            return self.m

    sealer, reports = Sealer(), []
    monkeypatch.setattr(lost.ckpt, "save", save)
    monkeypatch.setattr(lost, "exit_clean", exit_clean)
    w = SimpleNamespace(inbox=SimpleNamespace(lost_controller="batch host lost"), job_dir=tmp_path,
                        rank=0, node="node1", committed=9, rollback=None, topo=SimpleNamespace(world=1),
                        cfg=SimpleNamespace(checkpoint=SimpleNamespace(dir=str(tmp_path / "ck"))),
                        state=None, transfer_sealer=lambda: sealer,
                        report=lambda kind, step, **data: reports.append((kind, step, data)))
    monkeypatch.setattr(lost.checkpoints, "shard_name", lambda topo, rank: "pp0.tp0")
    with pytest.raises(Ended) as ended:
        lost.controller_lost(w, pending=10, error=None)
    assert ended.value.args == (Exit.REQUEUE,)
    (kind, step, data), = reports
    assert (kind, step, data["path"]) == ("checkpoint", 10, None) and "No space left" in data["error"]
    assert not list(jobdir.lost_dir(tmp_path).glob("rank*.done"))
