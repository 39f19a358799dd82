"""The same script without the runtime: launched by torchrun (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set), `tm_slurm.run` trains with plain torch.distributed groups (built by the same
code), no vote, no agent, no swaps. This is the baseline of the steady-state overhead benchmark,
and a way to debug a ported script without tm-slurm. Layout: TM_SLURM_DP / _PP / _TP /
_DP_SHARD (default: all data parallel). Writes per-step times and the final digest to $TM_SLURM_PLAIN_OUT.
"""
from __future__ import annotations

import atexit
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm.groups import build_group, pick_backend
from ..comm.handles import GroupTable
from ..config import Layout
from ..messages import GroupBuild
from ..topology import Topology
from .context import make_context
from .rng import Seeds
from .state import digest


def _raise(gid, e):
    raise RuntimeError(f"collective on {gid} failed (plain mode has no recovery): {e}") from e


def _store(env, rank: int, world: int):
    """torchrun's rendezvous store; MASTER_PORT=0 (the benchmark): rank 0 takes a free port and
    leaves it in $TM_SLURM_PLAIN_OUT/port for the others (no race for a port picked earlier)."""
    port = int(env["MASTER_PORT"])
    t = timedelta(seconds=300)
    if port:
        return dist.TCPStore(env["MASTER_ADDR"], port, world, is_master=rank == 0, timeout=t)
    f = Path(env["TM_SLURM_PLAIN_OUT"]) / "port"
    if rank == 0:
        store = dist.TCPStore(env["MASTER_ADDR"], 0, world, is_master=True, wait_for_workers=False, timeout=t)
        tmp = f.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        os.replace(tmp, f)
        return store
    while not f.exists():
        time.sleep(0.05)
    return dist.TCPStore(env["MASTER_ADDR"], int(f.read_text()), world, is_master=False, timeout=t)


class PlainRun:
    """This torchrun rank: its context, its groups built on torchrun's store."""

    def __init__(self):
        env = os.environ
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        lay = Layout(dp=int(env.get("TM_SLURM_DP", world)), pp=int(env.get("TM_SLURM_PP", 1)),
                     tp=int(env.get("TM_SLURM_TP", 1)), dp_shard=int(env.get("TM_SLURM_DP_SHARD", 1)))
        if lay.world != world:
            raise SystemExit(f"TM_SLURM_DP x PP x TP = {lay.world} but WORLD_SIZE = {world}")
        topo = Topology(lay)
        device = torch.device("cuda", int(env.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
        self.store = _store(env, rank, world)
        table = GroupTable(_raise, op_timeout=300)
        for g in sorted(topo.groups_of(rank), key=lambda g: g.id):
            table.swap({g.id: build_group(self.store, GroupBuild(g.id, g.members, f"plain/{g.id}"),
                                          g.members.index(rank), device=device,
                                          backend=pick_backend("auto", device), timeout=300,
                                          iface=env.get("TM_SLURM_IFACE", "127.0.0.1"))})
        self.ctx = make_context(topo, rank, table, device, int(env.get("TM_SLURM_SEED", 0)))
        self.seeds = Seeds(device, self.ctx.seed)

    def steps(self, st, steps: int):
        """The steps, each seeded and its gradients cleared as the runtime does; after the last
        one, the per-step times and the final digest go to $TM_SLURM_PLAIN_OUT and the script's
        code after its loop runs (as under the runtime)."""
        times = []
        t_prev = time.perf_counter()
        for i in range(steps):
            self.seeds.step(i, self.ctx.rank)
            (st.optimizer or st.model).zero_grad(set_to_none=True)
            yield i
            now = time.perf_counter()
            times.append(now - t_prev)          # step to step, as the runtime measures its steps
            t_prev = now
        self._finish(st, times)

    def _finish(self, st, times: list[float]) -> None:
        rank = self.ctx.rank
        out = os.environ.get("TM_SLURM_PLAIN_OUT")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "step_s": times,
                                                                    "digest": digest(st)}))
        # rank 0 hosts the store, so it leaves last; the others leave as soon as their `add` is
        # acknowledged (a rank still waiting on the store when rank 0 exits would see a reset)
        self.store.add("done", 1)
        while rank == 0 and self.store.add("done", 0) < self.ctx.world:
            time.sleep(0.05)
        atexit.register(os._exit, 0)     # no interpreter teardown of gloo's threads (as under the runtime)


def run_plain(build, step, steps: int) -> None:
    run = PlainRun()
    st = build(run.ctx)
    for i in run.steps(st, steps):
        step(run.ctx, st, i)
        if st.optimizer is not None:
            st.optimizer.step()
        if st.scheduler is not None:
            st.scheduler.step()
