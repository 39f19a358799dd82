"""Planned migration end to end, with real processes (issue: core runtime)."""
import pytest

from ..jobs import run_job

pytestmark = pytest.mark.procs
STEPS = 100


def _rss_kb(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return None


@pytest.mark.parametrize("leaver,rank,role", [("node2", 1, "first stage"), ("node4", 3, "last stage")])
def test_planned_swap_is_bit_identical_and_keeps_unaffected_groups(tmp_path, reference, leaver, rank, role):
    ran = run_job(tmp_path, "4+1", STEPS, [(12, "drain", leaver)])
    assert ran.rc == 0, ran.job_dir
    assert ran.result["digests"] == reference(STEPS)
    (swap,) = ran.interruption("planned")
    assert swap["node"] == leaver and swap["joiner"] == "node5"
    assert swap["groups_rebuilt"] == 2 and swap["groups_kept"] == 2
    assert swap["state_bytes"] > 0 and swap["stall_s"] is not None
    # groups that do not contain the leaver are the very same objects afterwards
    kept = set(swap["groups_kept_ids"])
    for ev in ran.kinds("rank_switched"):
        for gid, (before, after) in ev["identity"].items():
            if gid in kept:
                assert before == after, f"rank {ev['rank']}: kept group {gid} was replaced"
            else:
                assert before != after, f"rank {ev['rank']}: rebuilt group {gid} is the old object"
    assert len(ran.kinds("rank_switched")) == 3
    # the leaver's process left cleanly and its node was released; the joiner holds the rank
    exits = [e for e in ran.kinds("worker_exit") if e["node"] == leaver]
    assert len(exits) == 1 and exits[0]["rc"] == 0 and exits[0]["expected"]
    assert [e["node"] for e in ran.kinds("node_released")] == [leaver]
    (left,) = ran.kinds("rank_left")
    assert left["rank"] == rank and left["node"] == leaver


def test_drain_without_a_ready_standby_is_deferred_not_lost(tmp_path, reference):
    ran = run_job(tmp_path, "4+0", STEPS, [(8, "drain", "node1")], sets=["standby.count=0"])
    assert ran.rc == 0 and ran.result["digests"] == reference(STEPS)
    assert [e["node"] for e in ran.kinds("drain_deferred")] == ["node1"]
    assert not ran.interruption("planned")
