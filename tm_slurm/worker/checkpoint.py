"""Checkpoints: the fallback when no live replica holds a lost rank's state, what a time limit or
a lost controller leaves behind, and how a shrink changes the job's shape.

Layout: <root>/step<NNNNNNNN>/<key>/ for each state key (`Topology.state_key`: pipeline stage, tp
shard, and with layout.dp_shard > 1 the position in the DP shard group), written by one replica of
it (replica 0 unless told otherwise; the replicas hold identical state) with
torch.distributed.checkpoint (DCP) and no collectives (`no_dist`: a shard is one rank's write,
whatever state the job's groups are in):
  __0_0.distcp   DCP's data file (each tensor torch.save'd; read back weights_only)
  index.json     a `CheckpointIndex`: DCP's metadata for this shard (each tensor's global shape and
                 the piece held here), the non-tensor state, each data file's sha256
  index.sha256   the index's digest, written last
DCP's own metadata file is a pickle and is never written: the index is the control plane's JSON
codec, so nothing read back from the job's directory is unpickled. A checkpoint is valid only if
every shard of the layout it was written in is present and matches its digests, so a partial or
corrupt one is detected and an older one used (tm_slurm/checkpoints.py reads and checks them).

Loading merges the indexes of every shard of the rank's pipeline stage into one DCP metadata and
lets DCP's planner read each sharded tensor's part (a DTensor: FSDP2, HSDP, TP) from whichever
shards hold its pieces: a rank reads its shard whatever DP shard layout wrote it, which is how a
shrink reshards. Plain tensors come from the rank's own key, or when the layout no longer has that
key, from the same tp shard's lowest DP position (plain tensors are the same on every position).

Periodic checkpoints are asynchronous: the state is copied at the step boundary (`stage`) and
written by a thread while training goes on (`Writer`); one is in flight at most.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from .. import jobdir
from ..checkpoints import (INDEX, INDEX_SUM, parts, read_indexes, sha, shard_name, shards, step_dir,
                           unusable)
from ..control import codec
from ..events import fsync_write
from ..messages import CheckpointIndex
from ..topology import Topology
from . import state as st
from .state import TrainState



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
    return Staged(step, key, tuple(keys), pieces, st.manifest(state, step))


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
    return d


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

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tm-ckpt")

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


def _merge(order: list[CheckpointIndex]) -> Metadata:
    """One DCP metadata over several shards: each tensor's pieces from all of them, the first
    shard in `order` winning where pieces coincide or a plain tensor's shape differs."""
    md, storage = {}, {}
    for ix in order:
        for n, (size, dtype, chunks) in ix.tensors.items():
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
    st.apply_plain(state, order[0].state)
    return order[0].step
