"""Checkpoints: the fallback when no live replica holds a lost rank's state, and what a time limit
or a lost controller leaves behind.

Layout: <root>/step<NNNNNNNN>/pp<p>.tp<t>[.dp<s>].pt (+ .sha256), one shard per state key
(`Topology.state_key`: pipeline stage, tp shard, and with layout.dp_shard > 1 the position in the
DP shard group), written by one replica of it (replica 0 unless told otherwise; the replicas
hold identical state). Each file is written to a temporary name, fsynced and renamed, its digest
written after it; a checkpoint is valid only if every shard is present and matches its digest,
so a partial or corrupt one is detected and an older one used.
"""
from __future__ import annotations

import hashlib
import io
import re
import shutil
from pathlib import Path

import torch

from .. import jobdir
from ..events import fsync_write
from ..topology import Topology
from .state import TrainState

_STEP = re.compile(r"^step(\d{8})$")


def root(cfg, job_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(job_dir) / "checkpoints"


def step_dir(root_: Path, step: int) -> Path:
    return Path(root_) / f"step{step:08d}"


def shard_name(topo: Topology, rank: int) -> str:
    return topo.state_key(rank)


def shards(topo: Topology) -> list[str]:
    return sorted({shard_name(topo, r) for r in range(topo.world)})


def save(root_: Path, step: int, rank: int, topo: Topology, state: TrainState,
         writer: bool | None = None) -> Path | None:
    """Write this rank's shard of the state at the start of `step`. By default replica 0 writes;
    `writer` overrides that (None: not written here)."""
    if not (topo.replica_index(rank) == 0 if writer is None else writer):
        return None
    d = step_dir(root_, step)
    jobdir.private_dir(d)
    payload = {"step": step, "rank": rank, "model": state.model.state_dict(),
               "optimizer": state.optimizer.state_dict() if state.optimizer else None,
               "scheduler": state.scheduler.state_dict() if state.scheduler else None,
               "extra": state.extra}
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    name = shard_name(topo, rank)
    try:
        fsync_write(d / f"{name}.pt", data)
        fsync_write(d / f"{name}.sha256", hashlib.sha256(data).hexdigest().encode())
    except OSError:
        for f in (d / f"{name}.pt", d / f"{name}.sha256"):     # no half of a shard left behind
            f.unlink(missing_ok=True)
        raise
    return d


def _verified(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
        want = path.with_suffix(".sha256").read_text().strip()
    except OSError:
        return None
    return data if hashlib.sha256(data).hexdigest() == want else None


def bad_shards(d: Path, topo: Topology) -> list[str]:
    return [s for s in shards(topo) if _verified(Path(d) / f"{s}.pt") is None]


def candidates(root_: Path) -> list[tuple[int, Path]]:
    """Checkpoint directories, newest first."""
    out = []
    if Path(root_).is_dir():
        for p in Path(root_).iterdir():
            m = _STEP.match(p.name)
            if m and p.is_dir():
                out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)


def latest_valid(root_: Path, topo: Topology) -> tuple[tuple[int, Path] | None, list[tuple[int, str]]]:
    """(newest valid checkpoint, [(step, why) for each newer one that was rejected])."""
    rejected = []
    for step, p in candidates(root_):
        bad = bad_shards(p, topo)
        if not bad:
            return (step, p), rejected
        rejected.append((step, f"shards {bad} missing or not matching their digest"))
    return None, rejected


def prune(root_: Path, topo: Topology, keep: int) -> list[int]:
    valid = [(s, p) for s, p in candidates(root_) if not bad_shards(p, topo)]
    for _, p in valid[keep:]:
        shutil.rmtree(p, ignore_errors=True)
    return [s for s, _ in valid[keep:]]


def load(d: Path, rank: int, topo: Topology, state: TrainState) -> int:
    """Load `rank`'s shard from checkpoint directory `d` (verified); returns the step to resume at."""
    path = Path(d) / f"{shard_name(topo, rank)}.pt"
    data = _verified(path)
    if data is None:
        raise RuntimeError(f"checkpoint shard {path} is missing or does not match its digest")
    # weights_only: a checkpoint is data; torch's restricted unpickler builds tensors and plain
    # containers only, so a planted file cannot run code as the job's user
    obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    state.model.load_state_dict(obj["model"])
    if state.optimizer is not None and obj["optimizer"] is not None:
        state.optimizer.load_state_dict(obj["optimizer"])
    if state.scheduler is not None and obj["scheduler"] is not None:
        state.scheduler.load_state_dict(obj["scheduler"])
    state.extra.clear()
    state.extra.update(obj["extra"])
    return int(obj["step"])
