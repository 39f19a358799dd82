"""A lost controller (agent.py, worker/lost.py): the survivors' notes are scoped to one run of the
job, a node that is only cut off from a live controller does not end the job, and a controller
that is itself cut off knows it (controller/liveness.py)."""
from __future__ import annotations

import os
import threading
import time

from tm_slurm import jobdir
from tm_slurm.agent import controller_alive
from tm_slurm.controller.liveness import controller_cut_off


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
