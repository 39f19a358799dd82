"""tests/gpu/check.sh: the GPU path on one GPU (see the script's header).

What one GPU covers, in this order:
- nccl_groups (tests/gpu/nccl_groups.py, its own process, first): real ProcessGroupNCCL objects
  built the runtime's way (build_group: nonblocking, eager init on cuda:0), used through a
  GroupTable, aborted from another thread (abort_members) with the step's work issued, failing
  through afterwards, and replaced through the reconfiguration path (a new instance built after
  the abort and swapped in). World size 1: NCCL refuses two ranks of one communicator on the same
  device, so no data crosses a link.
- the job runs: CUDA state through a node kill and its recovery. The job is DP=1, whose groups all
  have one member, and the interruption is a node kill: no replica holds its state, so the
  standby, parked on the same GPU (its CUDA memory is reported), resumes from the sharded
  checkpoint (written from CUDA tensors, read back into them); reference, sandboxed standby and
  cold standby, bit-identical; the joiner's first compiled step, sandboxed vs cold.

What a node with two or more GPUs would add: a real two-rank NCCL data link, hence a planned
swap's state transfer over NCCL; a survivor released by abort while its peer is dead inside a
collective (the abort here ends a communicator with no peer to wait for); and phase 1's
communicator creation on its own thread concurrent with the training thread's collectives on the
same GPU (what nonblocking communicators are for)."""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tests.jobs import run_job

STEPS, KILL_AT = 120, 40
ROOT = Path(__file__).resolve().parents[2]


def _nccl_groups(cpu: bool, timeout_s: float = 150) -> dict:
    """tests/gpu/nccl_groups.py in a process of its own: its CUDA context and communicators are
    gone before the job runs start, and a hang or crash inside NCCL costs this part only."""
    cmd = [sys.executable, "-m", "tests.gpu.nccl_groups", *(["--cpu"] if cpu else [])]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {"ok": False, "error": f"still running after {timeout_s:g} s (killed)",
                "stderr_tail": err[-2000:]}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    try:
        out = json.loads(lines[-1])
    except (IndexError, ValueError):
        out = {"ok": False, "error": f"no result (exit {p.returncode})", "stderr_tail": p.stderr[-2000:]}
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def _run(tmp: Path, name: str, local: str, actions, sets, args) -> dict:
    t0 = time.monotonic()
    ran = run_job(tmp / name, local, STEPS, actions, sets=sets, script_args=args,
                  layout=("--dp", "1", "--pp", "1"), timeout=240)
    out = {"rc": ran.rc, "wall_s": round(time.monotonic() - t0, 1), "digests": ran.result.get("digests")}
    recs = ran.result.get("interruptions", [])
    if recs:
        r = recs[0]
        out.update(fallback=r.get("fallback"), stall_s=r.get("stall_s"), lost_steps=r.get("lost_steps"),
                   joiner_first_step_s=r.get("joiner_first_step_s"))
    warm = [e for e in ran.events if e["kind"] == "node_ready" and e.get("sandbox")]
    if warm:
        out["standby_cuda_reserved_mb"] = warm[0]["sandbox"].get("cuda_reserved_mb")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cpu", action="store_true",
                    help="run the harness on CPU (no GPU needed): nccl-like groups, gloo job runs")
    ap.add_argument("--no-compile", action="store_true", help="eager model (faster; no compile figures)")
    a = ap.parse_args()
    if not a.cpu and not torch.cuda.is_available():
        print("tests/gpu/check.sh: no CUDA device here (use --cpu to check the harness)", file=sys.stderr)
        return 2
    sets = ["comm.backend=gloo"] if a.cpu else ["comm.backend=nccl"]
    args = [] if a.no_compile else ["--compile"]
    kill = [(KILL_AT, "kill", "node1")]
    groups = _nccl_groups(a.cpu)
    # stdout carries the one JSON object: the runs' stories (tests/jobs.py prints them) go to stderr
    with tempfile.TemporaryDirectory(prefix="tm-gpu-check-") as d, contextlib.redirect_stdout(sys.stderr):
        tmp = Path(d)
        ref = _run(tmp, "reference", "1+0", [], [*sets, "standby.count=0"], args)
        warm = _run(tmp, "sandboxed", "1+1", kill, sets, args)
        cold = _run(tmp, "cold", "1+1", kill, [*sets, "standby.sandbox=false", "standby.prestart=false"], args)
    same = ref["rc"] == 0 and all(r["rc"] == 0 and r["digests"] == ref["digests"] for r in (warm, cold))
    ok = same and bool(groups.get("ok"))
    print(json.dumps({"device": torch.cuda.get_device_name(0) if not a.cpu else "cpu",
                      "torch": torch.__version__, "compile": not a.no_compile, "ok": ok,
                      "bit_identical": same, "nccl_groups": groups,
                      "reference": ref, "sandboxed": warm, "cold": cold}, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
