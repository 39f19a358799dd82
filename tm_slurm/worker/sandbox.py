"""Communication-free sandboxed warm-up of a standby (docs/design.md §5).

The standby runs the user's own build and step functions for each distinct pipeline role (first,
last, middle; or the one role without PP) with a `SandboxTable` in place of real groups: every
collective is served locally, so the sandbox sends nothing to any active node. Received tensors
are stand-ins recorded from a real iteration of the running job (so numerics stay sane);
without a recording, small deterministic noise of the right shape. Each rehearsal takes real
optimizer steps, so optimizer state, allocator pools, lazily imported modules and compiled
kernels all exist before the standby is needed. The last rehearsed role stays parked: promoted
into it, the same process and the same tensors become the joiner.
"""
from __future__ import annotations

import io
import time
from pathlib import Path

import torch

from .. import jobdir
from ..comm.handles import GroupTable, done
from ..comm.torchgroup import serve_locally
from ..events import fsync_write
from ..topology import Coord, Topology
from .rank import script

STANDINS = "standins.pt"


def standins_path(job_dir: Path) -> Path:
    return Path(job_dir) / "sandbox" / STANDINS


def _key(peer: int, t: torch.Tensor) -> str:
    return f"pp.peer{peer}.{tuple(t.shape)}.{t.dtype}"


class Recorder:
    """On an active rank: keep the first tensor received per (direction, shape, dtype)."""

    def __init__(self):
        self.seen: dict[str, torch.Tensor] = {}

    def note(self, peer: int, t: torch.Tensor) -> None:
        self.seen.setdefault(_key(peer, t), t.detach().clone())

    def save(self, job_dir: Path, pp_rank: int) -> None:
        p = standins_path(job_dir)
        jobdir.private_dir(p.parent)
        buf = io.BytesIO()
        torch.save(self.seen, buf)
        fsync_write(p.with_name(f"stage{pp_rank}.{STANDINS}"), buf.getvalue())


def load_standins(job_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    d = standins_path(job_dir).parent
    for p in sorted(d.glob(f"stage*.{STANDINS}")) if d.is_dir() else []:
        try:
            out.update(torch.load(p, weights_only=True, map_location="cpu"))
        except Exception:
            continue
    return out


class SandboxTable(GroupTable):
    """Every op local (`serve_locally`: an allreduce leaves the local value, every replica
    "agrees"; an all-gather repeats it); a send goes nowhere, a recv is filled with a recorded
    stand-in of the same shape. `sizes`: each group id's size (gathers and scatters need it)."""

    def __init__(self, standins: dict[str, torch.Tensor], sizes: dict[str, int] | None = None):
        super().__init__(lambda gid, e: None, op_timeout=1.0)
        self.standins = standins
        self.sizes = sizes or {}
        self.ops = 0
        self.served_recorded = 0

    def call(self, gid, op, args, outs):
        self.ops += 1
        if op == "recv":
            self._standin(args[0][0], args[1])
        else:
            serve_locally(op, args, self.sizes.get(gid, 1))
        return done(outs)

    def _standin(self, t: torch.Tensor, peer: int) -> None:
        s = self.standins.get(_key(peer, t))
        if s is not None:
            t.copy_(s)
            self.served_recorded += 1
        else:
            g = torch.Generator().manual_seed(t.numel())
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype) * 0.02)


def local_table(topo: Topology, standins: dict[str, torch.Tensor] | None = None) -> SandboxTable:
    return SandboxTable(standins or {}, {g.id: len(g.members) for g in topo.groups})


def rehearsal_ranks(topo: Topology, local: int = 0) -> list[int]:
    """One rank per distinct role, in the order first, last, middle: the standby parks in the
    last one (middle when PP >= 3, the paper's choice). Worker `local` of a node rehearses the
    rank it would hold in a slot of that role: its TP and shard position are those of any slot."""
    pp = topo.layout.pp
    stages = [0] if pp == 1 else ([0, pp - 1] + ([pp // 2] if pp >= 3 else []))
    return [topo.slot_ranks(topo.slot_of(topo.rank(Coord(0, s, 0))))[local] for s in stages]


def rehearse(w, build_fn, step_fn, steps: int, wait_standins_s: float = 30.0) -> dict:
    """Run the rehearsals in worker `w` (not yet holding a rank). Returns what was warmed."""
    # stand-ins are what a stage receives from its neighbour: without PP nothing is received,
    # so nothing is recorded and there is nothing to wait for
    deadline = time.monotonic() + (wait_standins_s if w.topo.layout.pp > 1 else 0.0)
    standins = load_standins(w.job_dir)
    while not standins and time.monotonic() < deadline and w.inbox.assignments.empty():
        time.sleep(0.2)
        standins = load_standins(w.job_dir)
    table = local_table(w.topo, standins)
    report = {"roles": {}, "recorded_standins": len(standins)}
    parked = None
    for r in rehearsal_ranks(w.topo, w.local):
        if parked is not None and not w.inbox.assignments.empty():
            break                          # needed now: stop rehearsing, stay as warm as we are
        # (the first role always: a joiner's model has taken steps; DDP settles its buckets in
        # its second, and a joiner that had not would call a collective no one else calls)
        t0 = time.perf_counter()
        ctx = w.context(r, sandbox=table)
        state = script(build_fn, ctx)
        times = []
        for i in range(steps):
            t1 = time.perf_counter()
            w.seeds.step(i, r)
            (state.optimizer or state.model).zero_grad(set_to_none=True)
            script(step_fn, ctx, state, i)
            if state.optimizer is not None:
                w.step_optimizer(state.optimizer)
            times.append(time.perf_counter() - t1)
        report["roles"][ctx.role] = {"rank": r, "total_s": round(time.perf_counter() - t0, 3),
                                     "step_s": [round(x, 3) for x in times]}
        parked = (ctx.role, state)
    report["ops_served_locally"] = table.ops
    if w.device.type == "cuda":        # what a standby parked on the GPU holds there
        report["cuda_reserved_mb"] = round(torch.cuda.memory_reserved(w.device) / 2**20, 1)
    report["recorded_served"] = table.served_recorded
    w.parked = parked
    return report
