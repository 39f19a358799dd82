"""A lost controller (agent.py, worker/lost.py): the survivors' notes are scoped to one run of the
job, and a node that is only cut off from a live controller does not end the job."""
from __future__ import annotations

import os
import threading
import time

from tm_slurm import jobdir
from tm_slurm.agent import controller_alive


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
