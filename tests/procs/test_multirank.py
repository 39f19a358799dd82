"""Nodes of two ranks (issue 13, item 2), with real processes: a node's workers start together,
a swap moves all of a node's ranks at once (each rank's state over its own link, in parallel),
and the loss of a node is the loss of all its ranks, recovered from the other DP replica.

DP=2 x TP=2 with two ranks a node: node1 holds replica 0's two TP ranks, node2 replica 1's."""
import pytest

from ..jobs import run_job

pytestmark = pytest.mark.procs
STEPS = 120
LAYOUT = ("--dp", "2", "--pp", "1", "--tp", "2", "--ranks-per-node", "2")


def test_two_ranks_a_node_drain_then_kill(tmp_path, reference):
    ran = run_job(tmp_path, "2+2", STEPS, [(12, "drain", "node1"), ("swap_complete", "kill", "node2")],
                  layout=LAYOUT)
    assert ran.rc == 0 and ran.result["digests"] == reference(STEPS, LAYOUT, active=2)
    (swap,) = ran.interruption("planned")
    assert swap["node"] == "node1" and sorted(e["rank"] for e in ran.kinds("rank_left")) == [0, 1]
    joined = sorted(e["rank"] for e in ran.kinds("rank_joined"))
    (rec,) = ran.interruption("unplanned")
    assert rec["node"] == "node2" and rec["fallback"] is None, rec
    assert joined == [0, 1, 2, 3]
