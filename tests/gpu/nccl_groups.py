"""The NCCL groups part of tests/gpu/check.sh: real ProcessGroupNCCL objects, built the runtime's way,
used, aborted from another thread and replaced, in one process on cuda:0.

World size 1 (NCCL refuses two ranks of one communicator on one GPU), so no data crosses a link:
what this shows is the life cycle of the runtime's NCCL groups, through its own code.
  1. `build_group(backend="nccl")`: a nonblocking communicator whose initialisation starts
     eagerly on cuda:0; torch makes its first collective wait until it is done. Timed.
  2. installed in a `GroupTable`: begin_step / allreduce / settle; right values, nothing broken.
  3. `table.abort_members([0], ...)` from a second thread (as the worker's watchdog or control
     thread does), with the step's work issued and not yet settled. Timed. The step's settle
     names the group broken; in the next step an allreduce on it fails through (returns False)
     and settle names it broken again. A collective issued on the aborted backend directly is
     refused: the communicator itself is aborted (the table never issues one).
  4. the reconfiguration path: a new instance of the group built after the abort (a second
     communicator on the same GPU, the aborted one still alive), swapped in with `table.swap`
     (which hands back the aborted one); the next step works and nothing is broken.
`--cpu` (and `run("nccl-like")`): the same on CPU with gloo under NCCL's semantics
(comm/nccllike.py), so CI runs every line of it.

A rank 0 in both instances is the only kind of group one GPU allows: a group that survives the
abort (one without the dead rank) needs a second rank, so it is not here (see check.sh).

Run alone: `python -m tests.gpu.nccl_groups [--cpu]` prints one JSON object (exit 1 if not ok)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from tm_slurm.comm.groups import NCCL_ENV, abort_together, bind_device, build_group
from tm_slurm.comm.handles import GroupTable
from tm_slurm.messages import GroupBuild

GID = "dp/pp0.tp0"
FLAGS = ("build_ok", "step_ok", "abort_ok", "fails_through_ok", "rebuild_ok")


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def _step(table: GroupTable, step: int, device: torch.device, settle_s: float) -> dict:
    """One step's collective on GID: (allreduce's answer, values right, broken after settle)."""
    table.begin_step(step)
    t = torch.full((1024,), float(step), device=device)
    ok = table.allreduce(GID, t, "sum")          # world size 1: the sum is the tensor itself
    table.settle(settle_s)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"allreduce": ok, "values_right": bool((t == float(step)).all().item()),
            "broken": sorted(table.broken)}


def _direct_op(g, device: torch.device, timeout: float) -> str:
    """An allreduce issued on `g`'s backend directly, not through the table: "refused: ..." (it
    raised), "failed: ..." (its work ended with an error) or "accepted"."""
    o = dist.AllreduceOptions()
    o.timeout = timedelta(seconds=timeout)
    try:
        w = g.pg.allreduce([torch.ones(4, device=device)], o)
    except Exception as e:
        return f"refused: {_err(e)}"
    end = time.monotonic() + min(timeout, 5)
    while not w.is_completed() and time.monotonic() < end:
        time.sleep(0.01)
    e = w.exception() if w.is_completed() else None
    return f"failed: {_err(e)}" if e is not None else "accepted"


def _probe_eager_init(store, device: torch.device, timeout: float) -> dict:
    """When a build times out: does a nonblocking, eagerly connected ProcessGroupNCCL ever report
    `_is_initialized()` by itself, and does it after a first collective? (torch's NCCLComm marks a
    nonblocking communicator initialised only when a collective first reaches it.)"""
    out = {}
    try:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout)
        opts.config.blocking = 0
        be = dist.ProcessGroupNCCL(dist.PrefixStore("check/probe", store), 0, 1, opts)
        be.eager_connect_single_device(device)
        end = time.monotonic() + 3
        while not be._is_initialized() and time.monotonic() < end:
            time.sleep(0.01)
        out["initialized_without_a_collective"] = be._is_initialized()
        out["stage"] = "first collective"
        t0 = time.perf_counter()
        be.allreduce([torch.ones(1, device=device)]).wait()
        torch.cuda.synchronize(device)
        out["first_collective_s"] = round(time.perf_counter() - t0, 3)
        out["initialized_after_a_collective"] = be._is_initialized()
        out["stage"] = "abort"
        be.abort()
        del out["stage"]
    except Exception as e:
        out["error"] = _err(e)
    return out


def run(backend: str = "nccl", timeout: float = 20.0) -> dict:
    """The whole part; never raises (what failed is in the result). `backend`: "nccl" (cuda:0) or
    "nccl-like" (CPU). `timeout`: each build's, the groups' op timeout and each wait here."""
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    out: dict = {"backend": backend, "device": str(device), **{k: False for k in FLAGS}, "ok": False}
    errors: list[tuple[str, str]] = []
    stage = "setup"
    try:
        if backend == "nccl":
            # what every worker gets at its launch (launch/job.py); read by ProcessGroupNCCL's
            # constructor. NONBLOCKING_TIMEOUT bounds a wait for a nonblocking communicator
            # (30 minutes by default), read once per process
            os.environ.update(NCCL_ENV)
            os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(int(timeout) * 3))
            bind_device(device)
            torch.ones(1, device=device)              # the CUDA context, outside the build's time
            out["nccl_version"] = str(torch.cuda.nccl.version())
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout))
        table = GroupTable(lambda gid, e: errors.append((gid, _err(e))), op_timeout=timeout)

        def build(gen: int):
            t0 = time.perf_counter()
            g = build_group(store, GroupBuild(GID, (0,), f"check/{GID}@{gen}"), 0, device=device,
                            backend=backend, timeout=timeout, gloo_threads=2, iface="127.0.0.1")
            return g, round(time.perf_counter() - t0, 3)

        # 1. build, eagerly initialised
        stage = "build"
        try:
            old, s = build(1)
        except TimeoutError as e:
            out["build_error"] = _err(e)
            if backend == "nccl":
                out["eager_init_probe"] = _probe_eager_init(store, device, timeout)
            return out
        out["build_s"] = [s]
        out["kind"] = old.kind
        if backend == "nccl":
            try:
                out["nonblocking"] = old.backend.options.config.blocking == 0
            except Exception as e:
                out["nonblocking"] = _err(e)
        out["build_ok"] = old.kind == backend and not old.aborted

        # 2. used through the table
        stage = "step"
        table.swap({GID: old})
        first = out["step1"] = _step(table, 1, device, timeout)
        out["step_ok"] = first == {"allreduce": True, "values_right": True, "broken": []}
        if not out["step_ok"]:
            return out

        # 3. aborted from another thread, the step's work issued and not settled
        stage = "abort"
        table.begin_step(2)
        t = torch.full((1024,), 2.0, device=device)
        issued = table.allreduce(GID, t, "sum")
        done: dict = {}

        def abort():
            bind_device(device)                       # CUDA's current device is per thread
            t0 = time.perf_counter()
            try:
                done["hit"] = table.abort_members([0], "check")
            except Exception as e:
                done["error"] = _err(e)
            done["s"] = round(time.perf_counter() - t0, 6)
        th = threading.Thread(target=abort, name="check-abort", daemon=True)
        th.start()
        th.join(timeout)
        if th.is_alive():
            out["abort_error"] = f"abort_members still running after {timeout:g} s"
            return out
        out["abort_s"] = done.get("s")
        if "error" in done:
            out["abort_error"] = done["error"]
        table.settle(timeout)
        in_flight = GID in table.broken
        # the communicator itself is aborted, not only the table's flag (abort_together swallows
        # a backend's failure to abort): a collective issued on it directly is refused
        out["direct_op_after_abort"] = _direct_op(old, device, timeout)
        out["abort_ok"] = (issued and done.get("hit") == [GID] and old.aborted and "error" not in done
                           and out["direct_op_after_abort"].startswith(("refused", "failed")))

        # ... the next step fails through on it
        stage = "fail through"
        nxt = out["step3"] = _step(table, 3, device, timeout)
        out["fails_through_ok"] = in_flight and nxt["allreduce"] is False and nxt["broken"] == [GID]

        # 4. the reconfiguration path: a new instance, swapped in
        stage = "rebuild"
        new, s = build(2)
        out["build_s"].append(s)
        replaced = table.swap({GID: new})
        after = out["step4"] = _step(table, 4, device, timeout)
        out["rebuild_ok"] = (len(replaced) == 1 and replaced[0] is old and table.groups[GID] is new and not new.aborted
                             and after == {"allreduce": True, "values_right": True, "broken": []})
        stage = "cleanup"
        t0 = time.perf_counter()
        abort_together([new], "check done")
        out["cleanup_abort_s"] = round(time.perf_counter() - t0, 6)
    except Exception as e:
        out["error"] = f"{stage}: {_err(e)}"
        out["traceback"] = traceback.format_exc(limit=6)[-2000:]
    finally:
        out["on_error"] = errors[:6]
        out["ok"] = all(out[k] for k in FLAGS)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help='nccl-like groups on CPU instead of NCCL on cuda:0')
    ap.add_argument("--timeout", type=float, default=20.0)
    a = ap.parse_args()
    r = run("nccl-like" if a.cpu else "nccl", a.timeout)
    print(json.dumps(r, default=str), flush=True)
    sys.stdout.flush()
    # a communicator's teardown at interpreter exit is no part of the check
    os._exit(0 if r["ok"] else 1)


if __name__ == "__main__":
    main()
