"""tests/gpu/check.sh: the GPU path on one GPU (see the script's header).

One GPU allows no data link between two processes over NCCL (it refuses two ranks of one
communicator on the same device), so the job is DP=1, whose groups all have one member, and the
interruption is a node kill: no replica holds its state, so the standby, parked on the same GPU,
resumes from the sharded checkpoint (written from CUDA tensors, read back into them). A planned
swap moves state over a two-rank link and needs two GPUs."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from tests.jobs import run_job

STEPS, KILL_AT = 120, 40


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
    ap.add_argument("--cpu", action="store_true", help="run the harness on CPU (no GPU needed)")
    ap.add_argument("--no-compile", action="store_true", help="eager model (faster; no compile figures)")
    a = ap.parse_args()
    if not a.cpu and not torch.cuda.is_available():
        print("tests/gpu/check.sh: no CUDA device here (use --cpu to check the harness)", file=sys.stderr)
        return 2
    sets = ["comm.backend=gloo"] if a.cpu else ["comm.backend=nccl"]
    args = [] if a.no_compile else ["--compile"]
    kill = [(KILL_AT, "kill", "node1")]
    with tempfile.TemporaryDirectory(prefix="tm-gpu-check-") as d:
        tmp = Path(d)
        ref = _run(tmp, "reference", "1+0", [], [*sets, "standby.count=0"], args)
        warm = _run(tmp, "sandboxed", "1+1", kill, sets, args)
        cold = _run(tmp, "cold", "1+1", kill, [*sets, "standby.sandbox=false", "standby.prestart=false"], args)
    ok = ref["rc"] == 0 and all(r["rc"] == 0 and r["digests"] == ref["digests"] for r in (warm, cold))
    print(json.dumps({"device": torch.cuda.get_device_name(0) if not a.cpu else "cpu",
                      "torch": torch.__version__, "compile": not a.no_compile, "bit_identical": ok,
                      "reference": ref, "sandboxed": warm, "cold": cold}, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
