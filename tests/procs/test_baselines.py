"""The baselines the benchmark measures against must be correct too: an elastic restart (every
worker restarted in place from a checkpoint) ends bit-identical, and the plain torchrun-style
run of the same script computes exactly what tm_slurm computes; the peers (torchft, NVIDIA's
ft_launcher) run as their users would run them."""
import json
from pathlib import Path

import pytest

from tm_slurm.bench import runs
from tm_slurm.demo import EXAMPLES

from ..jobs import UNPACED, run_job

pytestmark = pytest.mark.procs
STEPS = 100
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
    _, info = runs.plain_steady(tmp_path, STEPS, UNPACED)
    assert info["digests"] == reference(STEPS)


def test_a_stock_script_under_torchrun_computes_what_it_computes_under_tm_slurm(tmp_path, reference):
    # tm_slurm.init() without the runtime (PlainJob): the HSDP llama example, two ranks a node
    ex = EXAMPLES["llama"]
    _, info = runs.plain_steady(tmp_path, 40, [], ex=ex)
    assert info["digests"] == reference(40, tuple(ex.args()), active=ex.active, script=ex.script)


def test_the_peers_as_their_users_run_them(tmp_path):
    """The peers in the bench (bench/peers.py), for real, one node SIGKILLed. torchft: a
    Lighthouse, two replica groups; the survivor trains on alone, the restarted replica heals from
    it and rejoins; no step is redone, and the final state is not that of the same torchft job
    undisturbed. nvrx: ft_launcher restarts both workers, which resume from the last checkpoint
    and end bit-identical."""
    ex = EXAMPLES["ddp"]
    s = runs.run(tmp_path, "unplanned", "torchft", 300, 20, 10.0, ["--sleep", "0.05"], ex=ex)
    d = s.detail
    assert s.lost_steps == 0 and d["replica_rejoined"] and d["steps_fewer_replicas"] > 0
    assert not d["bit_identical"] and len(d["digests"]) == 1      # the replicas agree with each other
    steps = [json.loads(x)["step"] for x in (Path(s.job_dir) / "steps.jsonl").read_text().splitlines()]
    assert steps == list(range(300))
    s = runs.run(tmp_path, "unplanned", "nvrx", 100, 20, 10.0, ["--sleep", "0.05"], ex=ex)
    assert s.lost_steps >= 1 and s.detail["restarts"] == 1 and s.detail["bit_identical"]
