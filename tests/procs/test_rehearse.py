"""`tm-slurm rehearse` as a user runs it, on real processes: the stock DDP example ends
bit-identical after a drain and after a kill; a script with its own clock-seeded generator
differs, and the differing tensors are named (exit 1)."""
import subprocess
import sys
from pathlib import Path

import pytest

from tm_slurm.demo import SBATCH

from ..jobs import PACING, leftovers

pytestmark = pytest.mark.procs
NOISY = Path(__file__).with_name("noisy_job.py")
# one standby: each interruption has a run of its own; 60 paced steps leave the drain and the kill
# time to take effect once the standby is warm
ARGS = ["--local", "2+1", "--config", str(SBATCH / "example.yaml"), "--dp", "2", "--pp", "1"]


def rehearse(tmp: Path, script: Path, *script_args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "tm_slurm", "rehearse", *ARGS, "--", sys.executable, str(script),
                        "--steps", "60", *PACING, *script_args], cwd=tmp, capture_output=True, text=True, timeout=400)
    print(r.stdout, r.stderr[-3000:])
    assert not leftovers(tmp)
    return r


def test_the_ddp_example_rehearses_bit_identical(tmp_path):
    r = rehearse(tmp_path, SBATCH / "ddp_example.py")          # its defaults: a tiny model
    assert r.returncode == 0
    out = r.stdout.splitlines()
    assert any(line.startswith("  drain run: node1 drained, its standby took over at step ") for line in out)
    assert any(line.startswith("  kill run: node2 killed, the run went on from step ") for line in out)
    for run in ("drain", "kill"):
        assert f"{run}: bit-identical: parameters, optimizer, scheduler (60 tensors)" in out


def test_a_script_with_its_own_unkeyed_generator_differs_and_says_which_tensors(tmp_path):
    r = rehearse(tmp_path, NOISY)
    assert r.returncode == 1
    for run in ("drain", "kill"):
        assert f"{run}: DIFFERS from the undisturbed run" in r.stdout
    assert "  parameters: model.module.weight (max |diff| " in r.stdout
    assert "  optimizer: opt.0.exp_avg (max |diff| " in r.stdout
    assert "likely cause: randomness or data not keyed by step: the script's own torch.Generator" in r.stdout
