"""`tm-slurm bench --soak STEPS`: one long run of a tiny model with a planned swap every
`--soak-every` steps (the standby pool replenished after each), sampling the controller's
footprint from status.json: its resident memory and its store's key count must not grow with
the steps. The suite's tests/procs/test_soak.py is the same at 2,000 steps and two swaps."""
from __future__ import annotations

import json
import time
from pathlib import Path

from .. import jobdir
from ..controller.requests import submit
from ..demo import TINY_MODEL, JobRun


def soak(root: Path, steps: int, every: int, timeout: float = 7200) -> dict:
    samples: list[dict] = []

    def sample(job: Path) -> None:
        st = json.loads(jobdir.status_file(job).read_text())
        samples.append({"step": st["committed_step"], "store_keys": st["store_keys"], "rss_mb": st["rss_mb"]})

    def drain_one(job: Path) -> None:
        st = json.loads(jobdir.status_file(job).read_text())
        node = min(n for n, x in st["nodes"].items() if x["role"] == "ACTIVE")
        submit(job, "drain", node, "soak: a planned swap")

    actions = []
    for at in range(every, steps, every):
        actions += [(at - every // 2, sample, "-"), (at, drain_one, "-")]
    actions.append((steps - every // 2, sample, "-"))
    run = JobRun(root / "soak", "4+1", steps, actions, script_args=TINY_MODEL,
                 sets=["standby.replenish=true", "standby.replenish_target=1", "checkpoint.every_steps=1000"])
    t0 = time.monotonic()
    rc = run.run(timeout)
    res = run.result() if jobdir.result_file(run.job_dir).exists() else {}
    swaps = [i for i in res.get("interruptions", []) if i["kind"] == "planned"]
    first, last = (samples[0], samples[-1]) if samples else ({}, {})
    return {"rc": rc, "steps": steps, "every": every, "swaps": len(swaps), "samples": samples,
            "store_keys": {"first": first.get("store_keys"), "last": last.get("store_keys"),
                           "max": max((s["store_keys"] or 0 for s in samples), default=None)},
            "rss_mb": {"first": first.get("rss_mb"), "last": last.get("rss_mb"),
                       "max": max((s["rss_mb"] for s in samples), default=None)},
            "steady_step_s": res.get("steady_step_s"), "wall_s": round(time.monotonic() - t0, 1),
            "job_dir": str(run.job_dir)}


def table(out: dict) -> str:
    rows = [f"soak: {out['steps']} steps, a swap every {out['every']} ({out['swaps']} done), "
            f"exit {out['rc']}, {out['wall_s']} s",
            "| committed step | store keys | controller RSS (MB) |", "|---|---|---|"]
    rows += [f"| {s['step']} | {s['store_keys']} | {s['rss_mb']} |" for s in out["samples"]]
    return "\n".join(rows)
