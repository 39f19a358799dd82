"""Checkpoints: the fallback when no live replica holds a lost rank's state, what a time limit or
a lost controller leaves behind, and how a shrink changes the job's shape.

Layout: <root>/step<NNNNNNNN>/<key>/ for each state key (`Topology.state_key`: pipeline stage, tp
shard, and with layout.dp_shard > 1 the position in the DP shard group), written by one replica of
it (replica 0 unless told otherwise; the replicas hold identical state) with
torch.distributed.checkpoint (DCP) and no collectives (`no_dist`: a shard is one rank's write,
whatever state the job's groups are in):
  __0_0.distcp   DCP's data file (each tensor torch.save'd; read back weights_only)
  index.json     a `CheckpointIndex`: DCP's metadata for this shard (each tensor's global shape and
                 the piece held here), the non-tensor state (the optimizer's param groups with
                 their parameters' numbers, `params`, as Optimizer.state_dict() has them), each
                 data file's sha256
  index.sha256   the index's digest, written last
Tensor names: `model.<state_dict key>` and `opt.<i>.<state key>` (the i-th parameter in
param_groups order). The index is the control plane's JSON codec, so nothing the runtime reads
back from the job's directory is unpickled. A checkpoint is valid only if every shard of the layout
it was written in is present and matches its digests, so a partial or corrupt one is detected and
an older one used (tm_slurm/checkpoints.py reads and checks them).

For torch's own tools (`dcp.load(sd, checkpoint_id=step_dir)`, `dcp_to_torch_save`), a whole
checkpoint's step directory also gets DCP's `.metadata` (a pickle: written here, never read here;
a checkpoint is whole or not by its indexes alone). It is the indexes merged as a load merges
them, storage paths `<key>/<file>`: each tensor whole, assembled from the DP shard positions'
pieces, the lowest position's taken where pieces coincide. Names are the index's, prefixed
`pp<k>.` when there are several pipeline stages (each stage has its own `model.*` and `opt.<i>.*`).
With tp > 1 none is written: a plain (non-DTensor) tensor may be a different slice under one name
on each tp shard (hand-rolled TP), which the indexes cannot tell from a replicated one;
`tm-slurm export` (tm_slurm/export.py) reads such a checkpoint, refusing it where copies differ.
The shard writers do not coordinate: the one that finds, after writing its own, every shard's
index written (their digests checked, not their data's) writes it (tmp file, fsync, rename; racing
writers write the same bytes), and a shard being rewritten removes it first. Best effort: where a
writer cannot see the others' shards yet (a shared filesystem's caching) or cannot write it, there
is none, and `tm-slurm export` still reads the checkpoint.

Loading merges the indexes of every shard of the rank's pipeline stage into one DCP metadata and
lets DCP's planner read each sharded tensor's part (a DTensor: FSDP2, HSDP, TP) from whichever
shards hold its pieces: a rank reads its shard whatever DP shard layout wrote it, which is how a
shrink reshards. Plain tensors come from the rank's own key, or when the layout no longer has that
key, from the same tp shard's lowest DP position (plain tensors are the same on every position).

Periodic checkpoints are asynchronous: the state is copied at the step boundary (`stage`) and
written by a thread while training goes on (`Writer`); one is in flight at most.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import pickle
import shutil
import tempfile
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import (CURRENT_DCP_VERSION, FileSystemReader, FileSystemWriter,
                                                     _StorageInfo)
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from .. import jobdir
from ..checkpoints import (DCP_METADATA, INDEX, INDEX_SUM, index_of, parts, read_indexes, sha, shard_name,
                           shards, step_dir, unusable)
from ..comm.groups import bind_device
from ..control import codec
from ..events import fsync_write
from ..messages import CheckpointIndex, StateManifest
from ..topology import Topology
from . import state as st
from .state import TrainState

# every shard is one rank's write without collectives (no_dist), which DCP warns about on each
# save and load: on the user's terminal (rank 0's output is streamed there) it is only noise
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)


# ---------------------------------------------------------------- writing

@dataclass
class Staged:
    """A shard's state at a step boundary, ready to be written: each tensor's local piece (a copy
    when the write is asynchronous) with its place in the global tensor."""
    step: int
    key: str
    keys: tuple[str, ...]
    pieces: list[tuple[str, torch.Tensor, torch.Size, torch.Size]]   # name, local, global size, offsets
    plain: object                                                     # StateManifest


def stage(state: TrainState, step: int, key: str, keys: list[str], copy: bool) -> Staged:
    pieces = []
    for n, t in st.named(state):
        if isinstance(t, DTensor):
            (chunk,) = t.__create_chunk_list__()        # DCP's protocol: this rank's piece of it
            local, off = t.to_local(), chunk.offsets
        else:
            local, off = t, torch.Size([0] * t.dim())
        local = local.detach()
        local = local.to("cpu", copy=True) if copy else local.cpu()
        pieces.append((n, local.contiguous(), torch.Size(t.shape), torch.Size(off)))
    return Staged(step, key, tuple(keys), pieces, _numbered(state, st.manifest(state, step)))


def _numbered(state: TrainState, m: StateManifest) -> StateManifest:
    """The manifest with each param group's parameter numbers: a transfer has the optimizer to
    group them, an export of the checkpoint has not."""
    if state.optimizer is None:
        return m
    groups, i = [], 0
    for g, saved in zip(state.optimizer.param_groups, m.param_groups):
        groups.append({**saved, "params": list(range(i, i + len(g["params"])))})
        i += len(g["params"])
    return dataclasses.replace(m, param_groups=tuple(groups))


def _unnumbered(m: StateManifest) -> StateManifest:
    """What a loading optimizer's groups take: their own parameters stay theirs."""
    return dataclasses.replace(m, param_groups=tuple({k: v for k, v in g.items() if k != "params"}
                                                     for g in m.param_groups))


class _SavePlanner(DefaultSavePlanner):
    """Plans from a `Staged` shard: the write never touches the live state (it may be training)."""

    def __init__(self, staged: Staged):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.staged = staged
        self.data = {n: t for n, t, _, _ in staged.pieces}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(MetadataIndex(n, off), WriteItemType.SHARD,
                           tensor_data=TensorWriteData(ChunkStorageMetadata(off, t.shape),
                                                       TensorProperties(dtype=t.dtype), size))
                 for n, t, size, off in self.staged.pieces]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, item: WriteItem) -> torch.Tensor:
        return self.data[item.index.fqn]


class _Writer(FileSystemWriter):
    """DCP's file writer, keeping the metadata for the index instead of pickling it."""

    def __init__(self, d: Path):
        super().__init__(d, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self.metadata: Metadata | None = None
        self.results: list = []

    def finish(self, metadata: Metadata, results) -> None:
        self.metadata, self.results = metadata, [wr for rs in results for wr in rs]


def _dcp(fn, what: str, *args, **kwargs):
    """Call DCP, turning its CheckpointException (a BaseException: it would pass every `except
    Exception` of the worker) back into what went wrong: an OSError (a full disk) stays one."""
    try:
        return fn(*args, **kwargs)
    except CheckpointException as e:
        exc = next((x for x, _ in e.failures.values()), None)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, f"{what}: {exc.strerror or exc}") from None
        raise RuntimeError(f"{what}: {type(exc).__name__}: {exc}") from None


def write(root_: Path, s: Staged) -> Path:
    """Write a staged shard; on failure (a full disk) nothing of it is left behind."""
    d = step_dir(root_, s.step)
    jobdir.private_dir(d)
    (d / DCP_METADATA).unlink(missing_ok=True)     # it would describe the shard being replaced
    sd = d / s.key
    shutil.rmtree(sd, ignore_errors=True)            # an earlier attempt's leftovers
    jobdir.private_dir(sd)
    try:
        w = _Writer(sd)
        _dcp(dcp.save, f"writing checkpoint shard {sd}", {}, storage_writer=w, planner=_SavePlanner(s),
             no_dist=True)
        tensors: dict[str, list] = {}
        for n, _, size, _ in s.pieces:
            tensors[n] = [list(size), str(w.metadata.state_dict_metadata[n].properties.dtype), []]
        for wr in w.results:
            info = wr.storage_data
            if info.transform_descriptors:
                raise ValueError(f"unexpected DCP transforms {info.transform_descriptors}")
            meta = w.metadata.state_dict_metadata[wr.index.fqn]
            sizes = next(c.sizes for c in meta.chunks if c.offsets == wr.index.offset)
            tensors[wr.index.fqn][2].append([list(wr.index.offset), list(sizes), info.relative_path,
                                             info.offset, info.length])
        files = {f: sha(sd / f) for f in sorted({wr.storage_data.relative_path for wr in w.results})}
        for f in files:
            os.chmod(sd / f, 0o600)                  # DCP creates them with the umask
        data = codec.dumps(CheckpointIndex(s.step, s.key, s.keys, tensors, s.plain, files))
        fsync_write(sd / INDEX, data)
        fsync_write(sd / INDEX_SUM, hashlib.sha256(data).hexdigest().encode())
    except BaseException as e:
        shutil.rmtree(sd, ignore_errors=True)
        if isinstance(e, RuntimeError) and _no_room(root_, s):
            raise OSError(errno.ENOSPC, f"writing checkpoint shard {sd}: No space left on device ({e})") from None
        raise
    _publish(d, s)
    return d


def _publish(d: Path, s: Staged) -> None:
    """Write the step's `.metadata` if this shard was the last of the layout to be written. A
    convenience for torch's tools: whatever fails here (a full disk), the shard is written and the
    checkpoint whole without it."""
    if any(parts(k)[1] for k in s.keys):
        return                                        # tp > 1: none (see above)
    tmp = None
    try:
        if not all((d / k / INDEX_SUM).exists() for k in s.keys):
            return                                    # not the last: cheap stats first
        found = {k: index_of(d / k) for k in s.keys}
        if any(ix is None or ix.step != s.step or ix.keys != s.keys for ix in found.values()):
            return
        fd, tmp = tempfile.mkstemp(prefix=DCP_METADATA + ".", suffix=".tmp", dir=d)
        with os.fdopen(fd, "wb") as f:
            pickle.dump(dcp_metadata(found), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / DCP_METADATA)
    except Exception:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def stage_prefix(key: str, keys: tuple[str, ...]) -> str:
    """What a tensor's name is prefixed with outside its shard: its pipeline stage, when the
    layout has several (each stage has its own `model.*` and `opt.<i>.*`)."""
    return f"pp{parts(key)[0]}." if any(parts(k)[0] for k in keys) else ""


def dcp_metadata(found: dict[str, CheckpointIndex]) -> Metadata:
    """DCP's metadata for a whole checkpoint's step directory (one of tp == 1): each stage's
    shards merged as a load merges them, names prefixed by `stage_prefix`."""
    out = Metadata({}, storage_data={}, version=CURRENT_DCP_VERSION)
    for pp in sorted({parts(k)[0] for k in found}):
        order = sorted((ix for k, ix in found.items() if parts(k)[0] == pp), key=lambda ix: parts(ix.key))
        md = _merge(order, stage_prefix(order[0].key, order[0].keys))
        out.state_dict_metadata.update(md.state_dict_metadata)
        out.storage_data.update(md.storage_data)
    return out


def _no_room(root_: Path, s: Staged) -> bool:
    """Whether the shard cannot fit where it was written. A disk that fills in the middle of a
    tensor's write surfaces from torch's zip writer as a RuntimeError about a short write, with
    no errno: the free space says what it was."""
    try:
        fs = os.statvfs(root_)
    except OSError:
        return False
    return fs.f_bavail * fs.f_frsize < sum(t.numel() * t.element_size() for _, t, _, _ in s.pieces)


def save(root_: Path, step: int, rank: int, topo: Topology, state: TrainState,
         writer: bool | None = None) -> Path | None:
    """Write this rank's shard of the state at the start of `step`, now. By default replica 0
    writes; `writer` overrides that (None: not written here)."""
    s = _staged(state, step, rank, topo, writer, copy=False)
    return write(root_, s) if s is not None else None


def _staged(state: TrainState, step: int, rank: int, topo: Topology, writer: bool | None,
            copy: bool) -> Staged | None:
    if not (topo.replica_index(rank) == 0 if writer is None else writer):
        return None
    return stage(state, step, shard_name(topo, rank), shards(topo), copy)


class Writer:
    """Asynchronous shard writes, one at a time, on a thread of their own."""

    def __init__(self, device: torch.device | None = None):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tm-ckpt", initializer=bind_device,
                                        initargs=(device or torch.device("cpu"),))

    def submit(self, root_: Path, step: int, rank: int, topo: Topology, state: TrainState) -> Future | None:
        """Copy the shard now (replica 0 only) and write it in the background; None: not a writer."""
        s = _staged(state, step, rank, topo, None, copy=True)
        return self._pool.submit(write, root_, s) if s is not None else None


# ---------------------------------------------------------------- reading

class _Reader(FileSystemReader):
    """DCP's file reader over a metadata merged from shard indexes (never a pickled one)."""

    def __init__(self, d: Path, metadata: Metadata):
        super().__init__(d)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self._metadata


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item, value) -> None:
        raise ValueError(f"checkpoint entry {read_item.dest_index.fqn} is not a tensor")


def _merge(order: list[CheckpointIndex], prefix: str = "") -> Metadata:
    """One DCP metadata over several shards: each tensor's pieces from all of them, the first
    shard in `order` winning where pieces coincide or a plain tensor's shape differs."""
    md, storage = {}, {}
    for ix in order:
        for n, (size, dtype, chunks) in ix.tensors.items():
            n = prefix + n
            size = torch.Size(size)
            cur = md.get(n)
            if cur is None:
                cur = md[n] = TensorStorageMetadata(TensorProperties(dtype=st._dtype(dtype)), size, [])
            elif cur.size != size:
                continue
            for off, sizes, f, offset, length in chunks:
                i = MetadataIndex(n, torch.Size(off))
                if i in storage:
                    continue
                cur.chunks.append(ChunkStorageMetadata(torch.Size(off), torch.Size(sizes)))
                storage[i] = _StorageInfo(f"{ix.key}/{f}", int(offset), int(length))
    return Metadata(md, storage_data=storage)


def load(d: Path, rank: int, topo: Topology, state: TrainState) -> int:
    """Load `rank`'s part of the checkpoint in `d` (verified), resharded to this job's layout if it
    was written in another; returns the step to resume at."""
    key = shard_name(topo, rank)
    pp, tp, pos = parts(key)
    every = read_indexes(d)              # read and hashed once: data files can be gigabytes
    found = {k: ix for k, ix in every.items() if parts(k)[0] == pp}
    bad = unusable(every, topo)
    if bad or not found:
        raise RuntimeError(f"checkpoint {d} is incomplete, corrupt or of another layout: {bad or [key]}")
    order = sorted(found.values(), key=lambda ix: (ix.key != key, parts(ix.key)[1] != tp, parts(ix.key)[2]))
    md = _merge(order)
    st.allocate(state, {n: (tuple(m.size), str(m.properties.dtype))
                        for n, m in md.state_dict_metadata.items()}, local=False)
    target = dict(st.named(state))
    shapes = {n: tuple(t.shape) for n, t in target.items()}
    saved = {n: tuple(m.size) for n, m in md.state_dict_metadata.items()}
    if shapes != saved:
        diff = sorted(set(shapes.items()) ^ set(saved.items()))[:5]
        raise RuntimeError(f"checkpoint {d} does not match this rank's state (name, global shape): {diff}")
    _dcp(dcp.load, f"reading checkpoint {d}", target, storage_reader=_Reader(d, md), planner=_LoadPlanner(),
         no_dist=True)
    st.apply_plain(state, _unnumbered(order[0].state))
    return order[0].step


def read_shard(d: Path, ix: CheckpointIndex) -> list[tuple[str, torch.Size, torch.Tensor]]:
    """Every piece a shard (of the checkpoint in `d`, index verified) holds, as it was written:
    (name, offsets in the global tensor, piece), what an export assembles global tensors from."""
    md, storage, target, where = {}, {}, {}, {}
    for n, (_, dtype, chunks) in ix.tensors.items():
        for j, (off, sizes, f, offset, length) in enumerate(chunks):
            fqn, at = f"{n}#{j}", torch.Size([0] * len(sizes))      # each piece its own tensor
            md[fqn] = TensorStorageMetadata(TensorProperties(dtype=st._dtype(dtype)), torch.Size(sizes),
                                            [ChunkStorageMetadata(at, torch.Size(sizes))])
            storage[MetadataIndex(fqn, at)] = _StorageInfo(f"{ix.key}/{f}", int(offset), int(length))
            target[fqn] = torch.empty(sizes, dtype=st._dtype(dtype))
            where[fqn] = (n, torch.Size(off))
    _dcp(dcp.load, f"reading checkpoint shard {d / ix.key}", target,
         storage_reader=_Reader(d, Metadata(md, storage_data=storage)), planner=_LoadPlanner(), no_dist=True)
    return [(n, off, target[fqn]) for fqn, (n, off) in where.items()]
