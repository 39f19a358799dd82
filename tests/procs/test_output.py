"""The training script's output on `tm-slurm run`'s terminal, with real processes: rank 0's lines
(stdout and stderr) on its stdout led by `[rank0]: `, nobody else's; every rank's, the standby's
rehearsal too, in its log file; and each worker runs with OMP_NUM_THREADS=1, as under torchrun."""
import os
import subprocess
from pathlib import Path

import pytest

from tm_slurm.demo import JobRun

from ..jobs import kill_leftovers, no_leftovers

pytestmark = pytest.mark.procs


def test_rank_0s_output_is_on_the_terminal_with_its_prefix_and_every_ranks_in_its_log(tmp_path):
    job = JobRun(tmp_path / "job", "2+1", 4, [], extra_args=["--dp", "2", "--pp", "1"],
                 script=Path(__file__).with_name("printing_job.py"))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}    # torchrun's default
    try:
        ran = subprocess.run(job.argv, capture_output=True, text=True, env=env, timeout=180,
                             start_new_session=True)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{job.job_dir}; left behind (now killed): {kill_leftovers(job.job_dir)}") from None
    no_leftovers(job.job_dir)
    assert ran.returncode == 0, ran.stderr[-2000:]
    out = ran.stdout.splitlines()
    for step in range(4):          # stdout and stderr of the worker both, in its order
        i = out.index(f"[rank0]: marker-out rank=0 step={step} sandbox=False omp=1")
        assert out[i + 1] == f"[rank0]: marker-err rank=0 step={step} sandbox=False"
    assert all(line.startswith("[rank0]: ") for line in out), out
    # rank 1's, and the standby's rehearsal (it plays rank 0 with no rank of its own), only in
    # their log files
    assert not [line for line in out if "rank=1" in line or "sandbox=True" in line]
    assert "marker" not in ran.stderr
    logs = job.job_dir / "logs"
    assert "marker-out rank=0 step=3 sandbox=False omp=1" in (logs / "node1.w0.log").read_text()
    rank1 = (logs / "node2.w0.log").read_text()
    assert "marker-out rank=1 step=3 sandbox=False omp=1" in rank1 and "marker-err rank=1 step=3" in rank1
