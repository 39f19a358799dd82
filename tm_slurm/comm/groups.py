"""Build one communication group directly from a store prefix (docs/design.md §3).

No world collective and no default process group: any member set, including a brand-new process,
builds a group by calling `build_group` with the same prefix. Gloo on CPU; NCCL on GPUs with eager
initialisation on a bound device, so a swap's phase 1 really pays the communicator's cost; gloo
with NCCL's semantics (`nccl-like`, comm/nccllike.py) to test the GPU path on a CPU.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ..messages import GroupBuild
from .listeners import gloo_group
from .nccllike import NcclLikeGroup


def bind_device(device: torch.device) -> None:
    """CUDA's current device belongs to each host thread: a thread of the runtime that touches
    CUDA without this opens a context on cuda:0, on every process of the node."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def pick_backend(requested: str, device: torch.device) -> str:
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise RuntimeError("comm.backend=nccl needs a CUDA device; this worker has none")
    return requested


@dataclass
class Group:
    id: str
    prefix: str
    members: tuple[int, ...]
    rank: int                 # this process's rank inside the group
    pg: object                # dist.ProcessGroup (nccl-like: NcclLikeGroup)
    backend: object           # the backend object (ProcessGroupGloo / ProcessGroupNCCL / NcclLikeGroup)
    kind: str                 # "gloo" | "nccl" | "nccl-like"
    build_s: float = 0.0
    aborted: bool = False

    @property
    def size(self) -> int:
        return len(self.members)


_ABORT = threading.Lock()


def abort_together(groups: list[Group], why: str = "replaced") -> None:
    """Abort the communicators of `groups`, once each, so that nothing waits on a dead peer and
    every work pending on them ends with an error (callable from any thread: the training thread
    may be the one blocked). NCCL's inside one ncclGroupStart/End: aborts one after another can
    deadlock each other (torch aborts all its groups the same way, pytorch#119797). Gloo has no
    working abort for a blocked op (a hung peer is fenced by killing it instead): nothing to do."""
    with _ABORT:
        live = [g for g in groups if not g.aborted and g.kind != "gloo"]
        for g in live:
            g.aborted = True
    for g in live:
        if g.kind == "nccl-like":
            g.backend.abort(why)
    nccl = [g for g in live if g.kind == "nccl"]
    if not nccl:
        return
    lead = nccl[0].backend
    lead._group_start()
    try:
        for g in nccl:
            try:
                g.backend.abort()
            except Exception:
                pass
    finally:
        lead._group_end()


# ProcessGroupNCCL's own error handling, for every worker (docs/design.md §11): the runtime
# aborts a failed group's communicators itself, and torch must neither abort them too nor kill a
# healthy rank. ASYNC_ERROR_HANDLING=0: the watchdog neither aborts nor tears down (torch's
# _abort_process_group: "should be used with TORCH_NCCL_ASYNC_ERROR_HANDLING turned off (i.e.
# set to 0)"; the default, 3, kills the process). ENABLE_MONITORING=0: the heartbeat monitor
# kills the process when the watchdog makes no progress for 8 minutes, and an abort holds the
# lock the watchdog waits for. DUMP_ON_TIMEOUT=0: one rank's error would otherwise make every
# other rank of the store dump and exit (and the key stays for the groups rebuilt on it).
# WAIT_TIMEOUT_DUMP_MILSEC: the watchdog sleeps 4x this (60 s by default) after a failed work.
# NONBLOCKING_TIMEOUT: how long torch waits on a nonblocking communicator (its initialisation,
# an abort from another thread), 1,800 s by default; phase 1 has phase1_timeout_s (120 s).
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_ENABLE_MONITORING": "0",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000",
            "TORCH_NCCL_NONBLOCKING_TIMEOUT": "120"}


def _nccl(store, build: GroupBuild, grank: int, timeout: float, device: torch.device):
    # TORCH_NCCL_*: NCCL_ENV, in every worker's environment from its launch (launch/job.py)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout)
    # nonblocking: creating this communicator on phase 1's thread cannot hold up the training
    # thread's collectives on the same GPU (NCCL, "Using multiple NCCL communicators
    # concurrently": they can deadlock), and an abort from another thread is one NCCL supports.
    # The eager connect starts the initialisation now, in NCCL's background; torch makes the
    # group's first collective wait until it is done (ProcessGroupNCCL's getNcclComm). Nothing
    # here launches a collective: the build thread never touches the GPU's streams.
    opts.config.blocking = 0
    be = dist.ProcessGroupNCCL(store, grank, len(build.members), opts)
    be.eager_connect_single_device(device)
    return be


class BuildAbandoned(RuntimeError):
    """The plan a group was being built for was cancelled while this rank waited for the others."""


def gather(pstore, build: GroupBuild, grank: int, abandon: Callable[[], bool] | None = None) -> None:
    """Wait until every member has arrived, so that the backend opens its listener only for the
    milliseconds its pairs take to connect, not for as long as the slowest member takes to start
    (comm/listeners.py). With `abandon`, give up as soon as it says so: a member that died never
    arrives, and a rank blocked inside the backend's own rendezvous could not take part in the
    next plan until the store timeout (a second failure during a recovery). Without, one wait in
    the store (a job's start: thousands of ranks, none polling)."""
    pstore.set(f"here/{grank}", "1")
    keys = [f"here/{i}" for i in range(len(build.members))]
    if abandon is None:
        pstore.wait(keys)
        return
    end = time.monotonic() + pstore.timeout.total_seconds()
    while not pstore.check(keys):
        if abandon():
            raise BuildAbandoned(f"{build.id}: plan cancelled while waiting for its members")
        if time.monotonic() > end:
            raise TimeoutError(f"{build.id}: not every member of {build.members} arrived")
        time.sleep(0.002)


def build_group(store, build: GroupBuild, grank: int, *, device: torch.device, backend: str,
                timeout: float, gloo_threads: int = 2, iface: str = "",
                abandon: Callable[[], bool] | None = None) -> Group:
    """Collective over the members of `build` only; blocks until all of them have called it
    (or, with `abandon`, until that says the build is no longer wanted).
    `grank` is this process's rank in the group (explicit: a transfer link may hold the same
    global rank twice, the leaving and the joining copy)."""
    t0 = time.perf_counter()
    pstore = dist.PrefixStore(build.prefix, store)
    gather(pstore, build, grank, abandon)
    pg = dist.ProcessGroup(pstore, grank, len(build.members))
    if backend == "nccl":
        be = _nccl(pstore, build, grank, timeout, device)
        btype = dist.ProcessGroup.BackendType.NCCL
        pg.bound_device_id = device
    else:
        be = gloo_group(pstore, grank, len(build.members), iface=iface, timeout_s=timeout, threads=gloo_threads)
        btype = dist.ProcessGroup.BackendType.GLOO
    pg._set_default_backend(btype)
    be._set_sequence_number_for_group()
    pg._register_backend(device, btype, be)
    if backend == "nccl-like":
        pg = be = NcclLikeGroup(pg, timeout)
    return Group(build.id, build.prefix, build.members, grank, pg, be, backend,
                 build_s=time.perf_counter() - t0)


class Reaper:
    """Drops replaced groups off the critical path: tearing down a gloo group costs ~10 ms a peer."""

    def __init__(self, device: torch.device):
        self._device = device
        self._items: list = []
        self._cv = threading.Condition()
        self._t = threading.Thread(target=self._run, name="tm-reaper", daemon=True)
        self._t.start()

    def drop(self, groups) -> None:
        with self._cv:
            self._items.extend(groups)
            self._cv.notify()

    def _run(self) -> None:
        bind_device(self._device)
        while True:
            with self._cv:
                while not self._items:
                    self._cv.wait()
                items, self._items = self._items, []
            try:
                abort_together(items)
            except Exception:
                pass
            del items
