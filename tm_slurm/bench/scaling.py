"""Swap cost vs world size: the delta rule says a planned swap touches only the groups of the
moving rank. With DP fixed at 2 and the pipeline deepened, the world grows but a middle node's
groups stay one DP pair and two stage pairs: phase 1 and the stall should stay flat. With the
world all data parallel, the moving rank's DP group is the whole world: the contrast."""
from __future__ import annotations

import time
from pathlib import Path

from ..demo import JobRun

TINY = ["--vocab", "64", "--dim", "32", "--heads", "2", "--seq", "16", "--batch", "4", "--layers", "8",
        "--sleep", "0.05"]


def _one(root: Path, dp: int, pp: int) -> dict:
    world = dp * pp
    slot = world // 2 if pp == 1 else dp * (pp // 2)     # a middle stage (DP rank 0) / a middle rank
    node = f"node{slot + 1}"
    job = root / f"scaling-dp{dp}-pp{pp}-{time.strftime('%H%M%S')}"
    r = JobRun(job, f"{world}+1", 250, [(20, "drain", node)], extra_args=["--dp", str(dp), "--pp", str(pp)],
               script_args=TINY, sets=["checkpoint.every_steps=0", "timeouts.heartbeat_timeout_s=5",
                                       "timeouts.worker_heartbeat_timeout_s=5"])
    if r.run(900) != 0:
        raise RuntimeError(f"scaling run dp={dp} pp={pp} failed; see {job}")
    swaps = [i for i in r.result()["interruptions"] if i["kind"] == "planned"]
    if not swaps:
        return {"dp": dp, "pp": pp, "world": world, "error": f"no swap happened; see {job}"}
    sw = swaps[0]
    return {"dp": dp, "pp": pp, "world": world, "node": node, "groups_rebuilt": sw["groups_rebuilt"],
            "groups_kept": sw["groups_kept"], "phase1_s": sw["phases"]["phase1_s"],
            "switch_s": sw["phases"]["switch_s"], "stall_s": sw["stall_s"], "state_bytes": sw["state_bytes"]}


def swap_scaling(root: Path, quick: bool = False) -> dict:
    pps = [1, 2] if quick else [1, 2, 4]
    deep = [_one(root, 2, pp) for pp in pps]
    wide = [_one(root, dp, 1) for dp in ([2, 4] if quick else [2, 4, 8])]
    return {"dp2_deeper_pipeline": deep, "all_data_parallel": wide}
