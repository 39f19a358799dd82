"""The stock-loop API (issue 13), with real processes: unchanged DDP, FSDP2 and HSDP models and
loops on `tm_slurm.init()`, `job.group(...)`/`job.mesh()`, `job.optimizer(...)` and
`job.steps(n)`; a drain and then a node kill end bit-identical to the undisturbed run. And each
porting mistake the README lists fails the job at once with a message that says what to do."""
from pathlib import Path

import pytest

from tm_slurm.demo import EXAMPLES

from ..jobs import run_job, same_state

pytestmark = pytest.mark.procs
STEPS = 120
LAYOUT = ("--dp", "2", "--pp", "1")


# (example, the kill's fallback, its donors): DDP and HSDP recover the killed node from a replica;
# FSDP over the whole DP group has none (each rank holds the only copy of its shard), so every
# rank resumes from the checkpoint
CASES = [("ddp", None, {"1": 0}), ("fsdp", "checkpoint", None), ("llama", None, {"2": 0, "3": 1})]


@pytest.mark.parametrize("name,fallback,donors", CASES)
def test_stock_loop_drain_then_kill_is_bit_identical(tmp_path, reference, name, fallback, donors):
    ex = EXAMPLES[name]
    layout = tuple(ex.args())
    ran = run_job(tmp_path, f"{ex.active}+2", STEPS, [(12, "drain", ex.drain), ("swap_complete", "kill", ex.kill)],
                  layout=layout, script=ex.script)
    assert ran.rc == 0, ran.job_dir
    assert ran.result["digests"] == reference(STEPS, layout, active=ex.active, script=ex.script)
    (swap,) = ran.interruption("planned")
    (rec,) = ran.interruption("unplanned")
    assert swap["node"] == ex.drain and rec["node"] == ex.kill and rec["fallback"] == fallback, (swap, rec)
    if donors:                     # HSDP: the same shard position of the other replica
        (plan,) = ran.kinds("recovery_planned")
        assert plan["donors"] == donors, plan
    # the planned joiner was the rehearsed process: its model built once, in the sandbox
    assert ran.kinds("rank_joined")[0]["reused_sandbox"], ran.kinds("rank_joined")
    warm = [e for e in ran.kinds("node_ready") if e.get("role") == "STANDBY"]
    assert warm and all(e["warm"] and e["sandbox"]["ops_served_locally"] > 0 for e in warm), warm


def test_hsdp_with_tensor_parallel_two_ranks_a_node_drains_and_recovers_a_killed_node(tmp_path, reference):
    # 2 replicas x 2 shards x TP 2 = 8 ranks, a node holds one TP pair. node1 (ranks 0, 1) is
    # drained: both TP ranks move at once. Then node2 (ranks 2, 3: replica 0, shard 1) is killed:
    # both come back from ranks 6, 7 (replica 1, shard 1)
    ex = EXAMPLES["llama"]
    layout = ("--dp", "4", "--dp-shard", "2", "--tp", "2", "--ranks-per-node", "2", "--pp", "1")
    ran = run_job(tmp_path, "4+2", 60, [(8, "drain", "node1"), ("swap_complete", "kill", "node2")],
                  layout=layout, script=ex.script)
    assert ran.rc == 0, ran.job_dir
    assert ran.result["digests"] == reference(60, layout, active=4, script=ex.script)
    (swap,) = ran.interruption("planned")
    assert swap["node"] == "node1", swap
    (rec,) = ran.interruption("unplanned")
    assert rec["node"] == "node2" and rec["fallback"] is None, rec
    (plan,) = ran.kinds("recovery_planned")
    assert plan["donors"] == {"2": 6, "3": 7}, plan


@pytest.mark.parametrize("name, dp_to, dp_shard_to, from_checkpoint", [
    ("llama", 2, 2, False),      # HSDP 2 x 2: node2 held replica 1 whole; replica 0 goes on as FSDP over 2
    ("fsdp", 1, 1, True),        # FSDP over 2, no replica: node1 resumes alone from the checkpoint
], ids=["hsdp", "fsdp"])
def test_no_standby_shrink_of_a_sharded_job_is_a_fresh_smaller_job(tmp_path, name, dp_to, dp_shard_to,
                                                                    from_checkpoint):
    """`when_exhausted: shrink` with sharded state. HSDP drops the shard group that lost a node and
    the survivors write the last committed state (same shards); FSDP without replicas lost a shard
    with its node, so the rest resume from the newest checkpoint, resharded by DCP. Either way the
    result equals a job of the smaller layout started from that checkpoint."""
    ex = EXAMPLES[name]
    ran = run_job(tmp_path, f"{ex.active}+0", STEPS, [(25, "kill", "node2")], layout=tuple(ex.args()),
                  script=ex.script, sets=["standby.count=0", "standby.when_exhausted=shrink", "checkpoint.keep=100"])
    assert ran.rc == 0, ran.job_dir
    (planned,) = ran.kinds("shrink_planned")
    assert (planned["dp_to"], planned["dp_shard"], planned["from_checkpoint"]) == (dp_to, dp_shard_to, from_checkpoint)
    (rec,) = ran.interruption("unplanned")
    assert rec["strategy"] == "shrink" and rec["dp_to"] == dp_to, rec
    # FSDP redoes the steps since the newest periodic checkpoint (every 10 steps; which one depends
    # on where the kill landed: one that lands while a checkpoint is written leaves it without the
    # dead node's shard, rejected, and the one before is used); HSDP's survivors write the aborted
    # step itself and redo at most it
    if from_checkpoint:
        rejected = {e["step"] for e in ran.kinds("checkpoint_rejected")}
        most = 20 if rec["resume_step"] + 10 in rejected else 10
        assert rec["resume_step"] % 10 == 0 and 1 <= rec["lost_steps"] <= most, (rec, rejected)
    else:
        assert rec["resume_step"] == planned["step"] and rec["lost_steps"] <= 1, (rec, planned)
    # the checkpoint the smaller job starts from is the state an undisturbed job has at that step
    undisturbed = run_job(tmp_path / "undisturbed", f"{ex.active}+0", rec["resume_step"], layout=tuple(ex.args()),
                          script=ex.script, sets=["standby.count=0"], paced=False)
    assert undisturbed.rc == 0, undisturbed.job_dir
    same_state(ran.job_dir / "checkpoints" / f"step{rec['resume_step']:08d}",
               undisturbed.job_dir / "checkpoints" / f"step{rec['resume_step']:08d}")
    small = ["--dp", str(dp_to), "--dp-shard", str(dp_shard_to), "--pp", "1",
             "--ranks-per-node", str(ex.layout.get("ranks_per_node", 1)),
             "--resume", str(ran.job_dir / "checkpoints" / f"step{rec['resume_step']:08d}")]
    ref = run_job(tmp_path / "ref", "1+0", STEPS, layout=small, script=ex.script, sets=["standby.count=0"],
                  paced=False)
    assert ref.rc == 0, ref.job_dir
    assert ran.result["digests"] == ref.result["digests"]


MISTAKES = {
    "raw-step": "optimizer.step() was called on the optimizer itself",
    "no-step": "step 0 ended without opt.step()",
    "new-group": "dist.new_group is not available under tm_slurm: use job.group('dp')",
    "default-group": "on the default (world) group: under tm_slurm pass group=job.group('dp')",
    "init-twice": "init_process_group is not available under tm_slurm: tm_slurm.init() takes its place",
}


def test_porting_mistakes_fail_the_job_at_once_saying_what_to_do(tmp_path):
    script = Path(__file__).with_name("misuse_job.py")
    cases = [(m, says, script, ["--misuse", m]) for m, says in MISTAKES.items()]
    # an FSDP2 model without layout.dp_shard: a recovery would take another rank's shard
    cases.append(("fsdp-unsharded-layout", "sharded over job.group('dp') (FSDP2) but layout.dp_shard "
                  "is 1", EXAMPLES["fsdp"].script, []))
    for mistake, says, script, args in cases:
        ran = run_job(tmp_path / mistake, "2+1", 20, layout=LAYOUT, script=script, script_args=args,
                      timeout=120)
        assert ran.rc == 1, (mistake, ran.job_dir)
        (end,) = [e for e in ran.kinds("job_state") if e["state"] == "FAILED"]
        assert "the training script is at fault" in end["why"] and says in end["why"], (mistake, end)
        out = (ran.job_dir.parent / "job.out").read_text()
        assert says in out, (mistake, out[-500:])
        # not a node failure: nothing was recovered, nothing requeued
        assert not ran.result["interruptions"], ran.result["interruptions"]
