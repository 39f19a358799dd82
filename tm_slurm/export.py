"""`tm-slurm export`: a checkpoint as one plain `torch.save` file that needs no tm_slurm to use.

The checkpoint is verified as the runtime verifies it (every shard's index and data digests; DCP's
`.metadata` is never read), every shard is read once and each tensor assembled whole from the
pieces the shards hold (FSDP2/HSDP/TP DTensors), and the state becomes what torch's own
`state_dict()`s look like:

  {"step": N, "model": {...}, "optimizer": {"state": {i: {...}}, "param_groups": [...]},
   "scheduler": <its state_dict> or None, "extra": {...},
   "registered": {name: the state_dict() of the object job.register(name, obj) was given}}

`model` without the wrappers' prefixes (DDP's `module.`, torch.compile's `_orig_mod.`) when every
key has one, so the plain nn.Module loads it; `optimizer` as Optimizer.state_dict() has it. With
several pipeline stages each has its own model and optimizer: {"step": N, "stages": [one such
dict (without "step") per stage]}. A piece held by several shards (a plain tensor on every DP
shard position or tp shard) must be the same in all of them, or the checkpoint has no single
global form (hand-rolled TP keeping different slices under one name) and the export refuses it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import checkpoints
from .messages import CheckpointIndex, StateManifest
from .worker import checkpoint as ck
from .worker import state as st

_WRAPPERS = ("module.", "_orig_mod.")       # DDP's, torch.compile's


class ExportError(Exception):
    """The checkpoint cannot be read whole: missing, corrupt, or with no single global form."""


@dataclass
class Exported:
    """A whole checkpoint read back. `tensors` are keyed by the index's names (`model.<key>`,
    `opt.<i>.<key>`), each global (assembled over the shards), prefixed `pp<k>.` when the job had
    several pipeline stages (worker/checkpoint.py's `.metadata` has the same names). `plain` is the
    non-tensor state (its param groups with `params`, their parameters' numbers) of stage 0, the
    only one without pipeline parallelism; `stages` has every stage's, in order."""
    step: int
    tensors: dict[str, torch.Tensor]
    plain: StateManifest
    stages: tuple[StateManifest, ...] = ()


def resolve(path: Path) -> tuple[Path, dict[str, CheckpointIndex]]:
    """The step directory `path` names, or the newest whole one of a checkpoint root or of a job
    directory's default root, with its verified indexes."""
    path = Path(path)
    if checkpoints.is_step_dir(path):
        found = checkpoints.read_indexes(path)
        bad = checkpoints.gaps(found)
        if bad:
            raise ExportError(f"{path}: shards {bad} are missing or do not match their digests")
        return path, found
    for root in (path, path / "checkpoints"):
        if checkpoints.candidates(root):
            whole = checkpoints.latest_whole(root)
            if whole is None:
                raise ExportError(f"{root}: no whole checkpoint (every step directory has shards missing "
                                  f"or not matching their digests)")
            return whole
    raise ExportError(f"{path}: not a checkpoint step directory, checkpoint root or job directory")


def read_checkpoint(step_dir: Path, indexes: dict[str, CheckpointIndex] | None = None) -> Exported:
    """Verify and read the checkpoint in `step_dir` (`indexes`: its shards' indexes verified
    already, as `resolve` gives them), every tensor whole. Raises ExportError."""
    d = Path(step_dir)
    if indexes is None:
        d, indexes = resolve(d)
    layout = next(ix.keys for ix in indexes.values() if ix is not None)   # stale dirs of no layout: None
    found = {k: indexes[k] for k in layout}
    tensors, stages = {}, []
    for pp in sorted({checkpoints.parts(k)[0] for k in layout}):
        order = sorted((ix for k, ix in found.items() if checkpoints.parts(k)[0] == pp),
                       key=lambda ix: checkpoints.parts(ix.key))
        tensors.update(_assemble(d, order, ck.stage_prefix(order[0].key, layout)))
        stages.append(order[0].state)
    return Exported(stages[0].step, tensors, stages[0], tuple(stages))


def _assemble(d: Path, order: list[CheckpointIndex], prefix: str) -> dict[str, torch.Tensor]:
    """One stage's global tensors from its shards' pieces, each shard read once (in `order`)."""
    out, owner, held, filled = {}, {}, {}, {}
    for ix in order:
        for n, off, piece in ck.read_shard(d, ix):
            size, dtype = ix.tensors[n][:2]
            t = out.get(n)
            if t is None:
                t = out[n] = torch.empty(size, dtype=st._dtype(dtype))
                owner[n], held[n], filled[n] = ix.key, {}, 0
            elif list(t.shape) != list(size) or str(t.dtype) != str(dtype):
                raise ExportError(f"{d}: shards {owner[n]} and {ix.key} hold different tensors under the name "
                                  f"{n} ({list(t.shape)} {t.dtype}, {list(size)} {dtype}): the checkpoint has "
                                  f"no single global form of it")
            region = t[tuple(slice(o, o + s) for o, s in zip(off, piece.shape))]
            where = (tuple(off), tuple(piece.shape))
            if where not in held[n]:
                region.copy_(piece)
                held[n][where] = ix.key
                filled[n] += piece.numel()
            elif not same_bits(region.contiguous(), piece):
                raise ExportError(f"{d}: shards {held[n][where]} and {ix.key} hold different values for the "
                                  f"same piece of {n} (offsets {list(off)}): the checkpoint has no single "
                                  f"global form of it (tensor parallelism with plain, non-DTensor tensors?)")
    gaps = [n for n, t in out.items() if filled[n] != t.numel()]
    if gaps:
        raise ExportError(f"{d}: the shards' pieces do not cover tensors {gaps[:5]}")
    return {prefix + n: t for n, t in out.items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise (NaN equals NaN, -0.0 does not equal 0.0): copies of one piece are byte copies, and
    runs that trained alike end with byte copies (rehearse.py)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)))


# ---------------------------------------------------------------- the torch.save'd form

def state_dicts(x: Exported) -> dict:
    """The exported file's content (see the module docstring)."""
    every = x.stages or (x.plain,)
    stages = [_stage(x, m, f"pp{k}." if len(every) > 1 else "") for k, m in enumerate(every)]
    return {"step": x.step, **stages[0]} if len(stages) == 1 else {"step": x.step, "stages": stages}


def _stage(x: Exported, m: StateManifest, prefix: str) -> dict:
    model = {n[len(prefix) + 6:]: t for n, t in x.tensors.items() if n.startswith(prefix + "model.")}
    return {"model": _unwrapped(model), "optimizer": _optimizer(x, m, prefix), "scheduler": m.scheduler,
            "extra": dict(m.extra), "registered": dict(m.registered)}


def _unwrapped(model: dict) -> dict:
    """Keys as the plain module has them: a wrapper's prefix goes when every key has it (a
    submodule of that name would leave some keys without)."""
    while model:
        w = next((w for w in _WRAPPERS if all(k.startswith(w) for k in model)), None)
        if w is None:
            break
        model = {k[len(w):]: t for k, t in model.items()}
    return model


def _optimizer(x: Exported, m: StateManifest, prefix: str) -> dict | None:
    """Optimizer.state_dict()'s form: per-parameter state by parameter number, and the groups."""
    state: dict[int, dict] = {}
    for n, t in x.tensors.items():
        if n.startswith(prefix + "opt."):
            i, k = n[len(prefix) + 4:].split(".", 1)
            state.setdefault(int(i), {})[k] = t
    for i, values in m.opt_scalars.items():
        if values:
            state.setdefault(int(i), {}).update(values)
    groups = [dict(g) for g in m.param_groups]
    if not groups:
        return None
    if any("params" not in g for g in groups):
        if len(groups) > 1:
            raise ExportError(f"the optimizer has {len(groups)} param groups and this checkpoint (written by "
                              f"an older tm_slurm) does not record which parameters are in which")
        groups[0]["params"] = list(range(len(m.opt_scalars)))       # one entry per parameter
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def export(path: Path, out: Path) -> tuple[int, Path]:
    """Write the checkpoint `path` names (see `resolve`) to `out`; returns (its step, its directory)."""
    d, found = resolve(path)
    x = read_checkpoint(d, found)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        torch.save(state_dicts(x), tmp)
        os.replace(tmp, out)          # no partial file where the export was asked for
    finally:
        tmp.unlink(missing_ok=True)
    return x.step, d
