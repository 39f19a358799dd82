"""Nodes of two ranks (issue 13, item 2), with real processes: a node's workers start together,
a swap moves all of a node's ranks at once (each rank's state over its own link, in parallel),
and a node with one dead worker is fenced whole: all its ranks are recovered from the other
DP replica.

DP=2 x TP=2 with two ranks a node: node1 holds replica 0's two TP ranks, node2 replica 1's."""
import os
import signal
from pathlib import Path

import pytest

from ..jobs import run_job

pytestmark = pytest.mark.procs
STEPS = 150
LAYOUT = ("--dp", "2", "--pp", "1", "--tp", "2", "--ranks-per-node", "2")


def _kill_one_worker(node: str, local: int):
    def kill(job_dir: Path) -> None:
        want = [f"TM_SLURM_NODE={node}".encode(), f"TM_SLURM_LOCAL={local}".encode(),
                f"TM_SLURM_JOB_DIR={job_dir}".encode()]
        for p in Path("/proc").iterdir():
            try:
                env = (p / "environ").read_bytes().split(b"\0") if p.name.isdigit() else []
            except OSError:
                continue
            if all(w in env for w in want):
                os.kill(int(p.name), signal.SIGKILL)
                return
        raise AssertionError(f"no worker {local} of {node} in {job_dir}")
    kill.__name__ = f"kill_worker{local}"
    return kill


def test_two_ranks_a_node_drain_then_one_worker_killed(tmp_path, reference):
    # one of node2's two workers dies: the whole node is fenced and both its ranks recovered
    ran = run_job(tmp_path, "2+2", STEPS, [(12, "drain", "node1"), ("swap_complete", _kill_one_worker("node2", 1), "-")],
                  layout=LAYOUT)
    assert ran.rc == 0 and ran.result["digests"] == reference(STEPS, LAYOUT, active=2)
    (swap,) = ran.interruption("planned")
    assert swap["node"] == "node1" and sorted(e["rank"] for e in ran.kinds("rank_left")) == [0, 1]
    joined = sorted(e["rank"] for e in ran.kinds("rank_joined"))
    (rec,) = ran.interruption("unplanned")
    assert rec["node"] == "node2" and rec["how"] == "worker_exit" and rec["fallback"] is None, rec
    assert joined == [0, 1, 2, 3]
