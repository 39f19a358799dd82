"""The standby pool on the real mini cluster: a consumed standby is replaced by a companion job's
node, and a straggling node is migrated (issue: HPC centre integration)."""
from __future__ import annotations

import time

from .test_slurm_job import ref_digests, submit, _finished  # noqa: F401  (fixtures)


def test_replenishment_submits_a_companion_standby_that_joins(submit, minicluster, ref_digests):
    job = submit(extra_sets=["standby.replenish=true", "standby.replenish_target=1"])
    job.wait_warm()
    minicluster.scontrol("update", "nodename=node3", "state=drain", "reason=tm-test replenish")
    job.wait_event("swap_complete", 120, node="node3")
    req = job.wait_event("replenish_requested", 30)
    assert req["via"] == "slurm"
    joined = job.wait_event("standby_joined", 60)
    ready = job.wait_event("node_ready", 90, node=joined["node"])
    assert joined["node"] == "node6" and ready["role"] == "STANDBY" and ready["warm"]
    comp = [ln for ln in minicluster.run(["squeue", "-h", "-o", "%i %j %N"], capture_output=True,
                                         text=True).stdout.splitlines() if "tm-standby" in ln]
    assert comp and comp[0].endswith("node6")
    _finished(job, ref_digests)
    time.sleep(1.0)
    left = minicluster.run(["squeue", "-h", "-n", f"tm-standby-{job.id}"], capture_output=True, text=True).stdout
    assert not left.strip(), "the companion job is cancelled when the main job ends"


def test_a_straggling_node_is_migrated(submit, minicluster, ref_digests):
    job = submit(gpt_extra=["--slow-node", "node2", "--slow-s", "0.12"],
                 extra_sets=["straggler.enabled=true", "straggler.window_steps=10"])
    job.wait_warm()
    s = job.wait_event("straggler", 90)
    assert s["node"] == "node2" and s["slower_by"] > 0.5
    done = job.wait_event("swap_complete", 60, node="node2")
    assert done["reason"].startswith("straggler")
    _finished(job, ref_digests)
