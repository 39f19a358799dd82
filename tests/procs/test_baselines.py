"""The baselines the benchmark measures against must be correct too: an elastic restart (every
worker restarted in place from a checkpoint) ends bit-identical, and the plain torchrun-style
run of the same script computes exactly what tm_slurm computes; the peer (torchft) runs as its
users would run it."""
import json
from pathlib import Path

import pytest

from tm_slurm.bench import runs
from tm_slurm.demo import EXAMPLES

from ..jobs import TINY, run_job

pytestmark = pytest.mark.procs
STEPS = 150
ELASTIC = ["recovery.strategy=restart", "standby.prestart=false", "standby.sandbox=false"]


@pytest.mark.parametrize("verb,node", [("kill", "node3"), ("drain", "node2")])
def test_elastic_restart_is_bit_identical(tmp_path, reference, verb, node):
    ran = run_job(tmp_path, "4+1", STEPS, [(20, verb, node)], sets=ELASTIC)
    assert ran.rc == 0 and ran.result["digests"] == reference(STEPS)
    (rec,) = ran.result["interruptions"]
    assert rec["strategy"] == "restart" and rec["joiners"] == ["node5"]
    if verb == "kill":
        assert rec["lost_steps"] >= 1          # redone from the last periodic checkpoint
    else:
        assert rec["lost_steps"] == 0          # a checkpoint taken at the boundary


def test_plain_run_computes_what_tm_slurm_computes(tmp_path, reference):
    _, info = runs.plain_steady(tmp_path, STEPS, TINY)
    assert info["digests"] == reference(STEPS)


def test_a_stock_script_under_torchrun_computes_what_it_computes_under_tm_slurm(tmp_path, reference):
    # tm_slurm.init() without the runtime (PlainJob): the HSDP llama example, two ranks a node
    ex = EXAMPLES["llama"]
    _, info = runs.plain_steady(tmp_path, 40, [], ex=ex)
    assert info["digests"] == reference(40, tuple(ex.args()), active=ex.active, script=ex.script)


def test_torchft_trains_on_with_fewer_replicas_and_its_result_differs(tmp_path):
    """The peer in the bench (bench/peers.py), for real: a Lighthouse, two replica groups, one
    SIGKILLed; the survivor trains on alone, the restarted replica heals from it and rejoins. No
    step is redone, and the final state is not that of the same torchft job undisturbed."""
    ex = EXAMPLES["ddp"]
    s = runs.run(tmp_path, "unplanned", "torchft", 300, 20, 10.0, ["--sleep", "0.05"], ex=ex)
    d = s.detail
    assert s.lost_steps == 0 and d["replica_rejoined"] and d["steps_fewer_replicas"] > 0
    assert not d["bit_identical"] and len(d["digests"]) == 1      # the replicas agree with each other
    steps = [json.loads(x)["step"] for x in (Path(s.job_dir) / "steps.jsonl").read_text().splitlines()]
    assert steps == list(range(300))
