"""Keeping the job healthy over time (issue: HPC centre integration), locally with real
processes: the standby pool is replenished after use, and a straggler is migrated."""
import pytest

from ..jobs import run_job

pytestmark = pytest.mark.procs
STEPS = 150


def test_replenishment_brings_the_pool_back_and_the_new_standby_is_used(tmp_path, reference):
    ran = run_job(tmp_path, "4+1", STEPS, [(12, "drain", "node2"), ("node_ready@node6", "drain", "node3")],
                  sets=["standby.replenish=true", "standby.replenish_target=1"])
    assert ran.rc == 0 and ran.result["digests"] == reference(STEPS)
    assert [e["node"] for e in ran.kinds("replenish_requested")][:1] == ["node6"]
    swaps = ran.interruption("planned")
    assert [(s["node"], s["joiner"]) for s in swaps] == [("node2", "node5"), ("node3", "node6")]


def test_a_straggler_is_migrated_to_a_standby(tmp_path, reference):
    ran = run_job(tmp_path, "4+1", STEPS, [], script_args=["--slow-node", "node3", "--slow-s", "0.12"],
                  sets=["straggler.enabled=true", "straggler.window_steps=10", "straggler.margin=0.5"])
    assert ran.rc == 0 and ran.result["digests"] == reference(STEPS)
    (s,) = ran.kinds("straggler")
    assert s["node"] == "node3" and s["slower_by"] > 0.5
    (swap,) = ran.interruption("planned")
    assert swap["node"] == "node3" and swap["reason"].startswith("straggler")
