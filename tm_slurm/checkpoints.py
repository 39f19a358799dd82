"""The checkpoint directory, without torch: where a checkpoint lives, which shards a layout
writes, whether a checkpoint is whole (every shard's index and data files match their digests),
the newest whole one, pruning. The controller needs only this, so it never imports DCP (0.5 s
and ~50 MB of a process); writing and loading shards is worker/checkpoint.py's, which also
describes the format.

A step directory may also hold DCP's `.metadata` (a pickle, for torch's own tools): nothing here
reads it, and it neither makes a checkpoint whole nor spoils one (only shard directories count);
pruning removes it with the rest of the step.
"""
from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

from .control import codec
from .messages import CheckpointIndex
from .topology import Topology

_STEP = re.compile(r"^step(\d{8})$")
_KEY = re.compile(r"^pp(\d+)\.tp(\d+)(?:\.dp(\d+))?$")
INDEX, INDEX_SUM = "index.json", "index.sha256"
DCP_METADATA = ".metadata"       # DCP's file name: written for torch's tools, never read by us
_MAX_INDEX = 64 << 20            # an index is names and numbers: anything bigger is not one of ours


def root(cfg, job_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(job_dir) / "checkpoints"


def step_dir(root_: Path, step: int) -> Path:
    return Path(root_) / f"step{step:08d}"


def shard_name(topo: Topology, rank: int) -> str:
    return topo.state_key(rank)


def shards(topo: Topology) -> list[str]:
    return sorted({shard_name(topo, r) for r in range(topo.world)})


def parts(key: str) -> tuple[int, int, int]:
    m = _KEY.match(key)
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def index_of(sd: Path) -> CheckpointIndex | None:
    """A shard's index if it matches its digest, its data files unread: that the shard's write
    has finished, not that its data is intact (`read_index` checks that)."""
    try:
        data = (sd / INDEX).read_bytes()[:_MAX_INDEX + 1]
        if len(data) > _MAX_INDEX or hashlib.sha256(data).hexdigest() != (sd / INDEX_SUM).read_text().strip():
            return None
        ix = codec.loads(data)
    except (OSError, ValueError, TypeError):
        return None
    return ix if isinstance(ix, CheckpointIndex) and ix.key == sd.name else None


def read_index(sd: Path) -> CheckpointIndex | None:
    """A shard's verified index (its data files' digests checked too); None if anything is off."""
    ix = index_of(sd)
    if ix is None:
        return None
    try:
        for f, want in ix.files.items():
            if "/" in f or f.startswith(".") or sha(sd / f) != want:
                return None
    except (OSError, ValueError, TypeError):
        return None
    return ix


def read_indexes(d: Path) -> dict[str, CheckpointIndex | None]:
    return {p.name: read_index(p) for p in Path(d).iterdir() if p.is_dir() and _KEY.match(p.name)}


def bad_shards(d: Path, topo: Topology) -> list[str]:
    """Shards of the checkpoint in `d` that are missing or do not match their digests, for the
    layout it was written in; or why this job (`topo`) cannot load it at all."""
    return unusable(read_indexes(d), topo)


def gaps(found: dict[str, CheckpointIndex | None]) -> list[str]:
    """Shards of the layout the checkpoint was written in that are missing or do not match their
    digests (every valid one when they disagree on the layout; [] only for a whole checkpoint)."""
    good = {k: ix for k, ix in found.items() if ix is not None}
    layouts = {ix.keys for ix in good.values()}
    if len(layouts) != 1:
        return sorted(good) or sorted(found) or ["(no shard)"]
    return [k for k in next(iter(layouts)) if k not in good]


def unusable(found: dict[str, CheckpointIndex | None], topo: Topology) -> list[str]:
    good = [ix for ix in found.values() if ix is not None]
    if not good:
        return shards(topo)
    bad = gaps(found)
    if not bad:
        theirs = {parts(k)[:2] for k in good[0].keys}
        if theirs != {parts(k)[:2] for k in shards(topo)}:
            return [f"written with pipeline/tensor shards {sorted(theirs)}, this job has "
                    f"{sorted({parts(k)[:2] for k in shards(topo)})}"]
    return bad


def is_step_dir(p: Path) -> bool:
    return bool(_STEP.match(Path(p).name)) and Path(p).is_dir()


def latest_whole(root_: Path) -> tuple[Path, dict[str, CheckpointIndex]] | None:
    """The newest whole checkpoint under `root_` whatever layout wrote it (for reading it outside
    a job), with its shards' verified indexes."""
    for _, p in candidates(root_):
        found = read_indexes(p)
        if not gaps(found):
            return p, found
    return None


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
