"""The baselines the benchmark measures against must be correct too: an elastic restart (every
worker restarted in place from a checkpoint) ends bit-identical, and the plain torchrun-style
run of the same script computes exactly what tm_slurm computes."""
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
