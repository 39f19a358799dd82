"""`tm-slurm demo --json`, the one-command tour, as a user runs it (issues: core runtime,
unplanned failures): a drain, then a killed node, and the run ends bit-identical."""
import json
import subprocess
import sys

import pytest

from ..jobs import leftovers

pytestmark = pytest.mark.procs


def test_demo_reports_a_planned_and_an_unplanned_event_and_bitwise_continuity(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tm_slurm", "demo", "--json"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["bitwise_identical"] is True
    assert out["example"] == "gpt" and out["layout"] == {"dp": 2, "pp": 2, "nodes": "4+2"}
    assert out["steady_step_s"] > 0
    (planned,) = [e for e in out["events"] if e["kind"] == "planned"]
    assert planned["node"] == "node2" and not planned["interrupted"]
    assert planned["stall_s"] is not None and planned["joiner_first_step_s"] is not None
    assert planned["groups_kept"] > 0 and planned["groups_rebuilt"] > 0 and planned["state_bytes"] > 0
    assert set(planned["phases"]) >= {"phase1_s", "switch_s", "transfer_s"}
    unplanned = [e for e in out["events"] if e["kind"] == "unplanned"]
    assert unplanned and unplanned[0]["node"] == "node4"
    for e in unplanned:
        assert e["detect_s"] is not None and e["stall_s"] is not None and e["lost_steps"] <= 1
    assert [a["verb"] for a in out["injected"]] == ["drain", "kill"]
    assert not leftovers(tmp_path)


def test_a_demo_that_cannot_inject_what_it_announced_says_so_and_fails(tmp_path):
    # 4 steps end long before the standbys have rehearsed their roles in the sandbox
    r = subprocess.run([sys.executable, "-m", "tm_slurm", "demo", "--scenario", "planned", "--steps", "4"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "the run ended before it could drain node2" in r.stdout + r.stderr
    assert not leftovers(tmp_path)
