"""A script as people write it (tests/procs/ordinary_cnn.py, not one of the bundled examples),
with real processes: BatchNorm, dropout, a DataLoader with the runtime's sampler, numpy and
Python random augmentation, gradient accumulation with no_sync, a OneCycleLR, clipping, a logging
all-reduce and its own save after the loop. A drain and then a kill end bit-identical to the
undisturbed run (parameters, buffers, optimizer, scheduler), and the file it saves after its
loop exists and is equal. The script's own bug fails the job once, as the script's, and every
porting mistake of issue 34 fails at step 0 with what to do."""
from pathlib import Path

import pytest
import torch

from tm_slurm.export import read_checkpoint

from ..jobs import run_job

pytestmark = pytest.mark.procs
SCRIPT = Path(__file__).with_name("ordinary_cnn.py")
STEPS = 80
LAYOUT = ("--dp", "2", "--pp", "1")


def _final(job_dir: Path, steps: int):
    return read_checkpoint(job_dir / "checkpoints" / f"step{steps:08d}")


def test_an_ordinary_script_ends_bit_identical_after_a_drain_and_a_kill(tmp_path):
    # data read by DataLoader worker processes (persistent): a joiner's are fresh ones
    ref = run_job(tmp_path / "ref", "2+0", STEPS, sets=["standby.count=0"], layout=LAYOUT, script=SCRIPT,
                  script_args=["--out", str(tmp_path / "ref-out"), "--workers", "2"], paced=False)
    assert ref.rc == 0, ref.job_dir
    ran = run_job(tmp_path / "run", "2+2", STEPS, [(12, "drain", "node1"), ("swap_complete", "kill", "node2")],
                  layout=LAYOUT, script=SCRIPT, script_args=["--out", str(tmp_path / "run-out"), "--workers", "2"])
    assert ran.rc == 0, ran.job_dir
    assert ran.interruption("planned") and ran.interruption("unplanned"), ran.result["interruptions"]
    assert ran.result["digests"] == ref.result["digests"]
    a, b = _final(ref.job_dir, STEPS), _final(ran.job_dir, STEPS)
    assert a.tensors.keys() == b.tensors.keys()
    names = [n for n in a.tensors if "running_" in n or "num_batches_tracked" in n]
    assert len(names) == 6, names                        # two BatchNorms' buffers are in the state
    assert [n for n in a.tensors if not torch.equal(a.tensors[n], b.tensors[n])] == []
    assert a.plain.scheduler == b.plain.scheduler and a.plain.scheduler["last_epoch"] == STEPS
    assert b.tensors["model.module.bn1.num_batches_tracked"].item() == STEPS * 2     # 2 micro-batches a step
    # the script's own save after its loop ran, on rank 0, with the same model
    saved = [torch.load(d / "final.pt", weights_only=True) for d in (tmp_path / "ref-out", tmp_path / "run-out")]
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
    assert torch.equal(saved[1]["bn2.running_var"], b.tensors["model.module.bn2.running_var"])
    out = (ran.job_dir.parent / "job.out").read_text()
    assert "[rank0]: saved" in out, out[-3000:]


def test_the_scripts_own_bug_fails_the_job_once_and_every_porting_mistake_fails_at_step_0(tmp_path):
    ran = run_job(tmp_path / "bug", "2+1", 30, layout=LAYOUT, script=SCRIPT,
                  script_args=["--out", str(tmp_path / "o"), "--raise-at", "5"], paced=False)
    out = (ran.job_dir.parent / "job.out").read_text()
    assert ran.rc == 1, out[-3000:]
    assert [e["state"] for e in ran.kinds("job_state")][-1] == "FAILED"
    assert not ran.kinds("recovery_planned") and not ran.kinds("node_failed")
    assert "the training script failed on rank" in out and "at step 5" in out, out[-3000:]
    assert out.count("Traceback (most recent call last)") == 1, out[-3000:]       # once, whoever crashed
    logs = [(ran.job_dir / "logs" / f"node{i}.w0.log").read_text() for i in (1, 2)]
    assert all("ValueError: the script's own bug at step 5" in log for log in logs)    # and in each log
    for mistake, says in (("sched-step", "OneCycleLR.step() was called by the script"),
                          ("distributed-sampler", "a DataLoader with a DistributedSampler"),
                          ("shuffle", "DataLoader(shuffle=True)")):
        ran = run_job(tmp_path / mistake, "2+0", 30, layout=LAYOUT, script=SCRIPT, sets=["standby.count=0"],
                      script_args=["--out", str(tmp_path / "o"), "--mistake", mistake], paced=False)
        out = (ran.job_dir.parent / "job.out").read_text()
        assert ran.rc == 1 and says in out, (mistake, out[-3000:])
        assert not ran.kinds("checkpoint_complete"), mistake            # it failed at step 0
