"""The stock-loop API (issue 13, items 1 and 4), with real processes: an unchanged DDP model and
loop, `tm_slurm.init()`, `job.group("dp")`, `job.optimizer(...)` and `job.steps(n)`; a drain
and a node kill each end bit-identical to the undisturbed run. And each porting mistake the
README lists fails the job at once with a message that says what to do instead."""
import sys
from pathlib import Path

import pytest

from tm_slurm import jobdir
from tm_slurm.demo import SBATCH

from ..jobs import run_job

pytestmark = pytest.mark.procs
STEPS = 120
DDP = SBATCH / "ddp_example.py"
LAYOUT = ("--dp", "2", "--pp", "1")


def test_stock_ddp_drain_then_kill_is_bit_identical(tmp_path, reference):
    ran = run_job(tmp_path, "2+2", STEPS, [(12, "drain", "node1"), ("swap_complete", "kill", "node2")],
                  layout=LAYOUT, script=DDP)
    assert ran.rc == 0, ran.job_dir
    assert ran.result["digests"] == reference(STEPS, LAYOUT, active=2, script=DDP)
    (swap,) = ran.interruption("planned")
    (rec,) = ran.interruption("unplanned")
    assert swap["node"] == "node1" and rec["node"] == "node2" and rec["fallback"] is None, (swap, rec)
    joined = ran.kinds("rank_joined")
    # both joiners were the rehearsed processes, their DDP built once, in the sandbox
    assert len(joined) == 2 and all(e["reused_sandbox"] for e in joined), joined
    warm = [e for e in ran.kinds("node_ready") if e.get("role") == "STANDBY"]
    assert warm and all(e["warm"] and e["sandbox"]["ops_served_locally"] > 0 for e in warm), warm


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
                  "is 1", SBATCH / "fsdp_example.py", []))
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


FSDP = SBATCH / "fsdp_example.py"
FSDP_LAYOUT = (*LAYOUT, "--dp-shard", "2")


def test_stock_fsdp2_drain_moves_the_shard_and_a_kill_resumes_from_the_checkpoint(tmp_path, reference):
    # FSDP2 over the DP group: each rank holds the only copy of its shard. A drain hands it to the
    # joiner; a killed node's shard is nowhere else, so all ranks resume from the checkpoint
    ran = run_job(tmp_path, "2+2", STEPS, [(12, "drain", "node1"), ("swap_complete", "kill", "node2")],
                  layout=FSDP_LAYOUT, script=FSDP)
    assert ran.rc == 0, ran.job_dir
    assert ran.result["digests"] == reference(STEPS, FSDP_LAYOUT, active=2, script=FSDP)
    (swap,) = ran.interruption("planned")
    (rec,) = ran.interruption("unplanned")
    assert swap["node"] == "node1" and rec["node"] == "node2" and rec["fallback"] == "checkpoint", (swap, rec)


HSDP_LAYOUT = ("--dp", "4", "--pp", "1", "--dp-shard", "2", "--ranks-per-node", "2")


def test_stock_hsdp_two_ranks_a_node_drain_and_kill_recover_shards_from_their_replica(tmp_path, reference):
    # 2 replicas x 2 shards, a node holds one replica's two shards: the drained node hands both
    # over; the killed node's shards come from the other replica's ranks, not the checkpoint
    ran = run_job(tmp_path, "2+2", STEPS, [(12, "drain", "node1"), ("swap_complete", "kill", "node2")],
                  layout=HSDP_LAYOUT, script=FSDP)
    assert ran.rc == 0, ran.job_dir
    assert ran.result["digests"] == reference(STEPS, HSDP_LAYOUT, active=2, script=FSDP)
    (swap,) = ran.interruption("planned")
    (rec,) = ran.interruption("unplanned")
    assert swap["node"] == "node1" and rec["node"] == "node2" and rec["fallback"] is None, (swap, rec)
    (plan,) = ran.kinds("recovery_planned")
    assert plan["donors"] == {"2": 0, "3": 1}, plan        # the same shard position, other replica
    assert sorted(e["rank"] for e in ran.kinds("rank_joined")) == [0, 1, 2, 3]
