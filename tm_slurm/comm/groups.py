"""Build one communication group directly from a store prefix (docs/design.md §3).

No world collective and no default process group: any member set, including a brand-new process,
builds a group by calling `build_group` with the same prefix. Gloo on CPU; NCCL on GPUs with eager
initialisation on a bound device, so a swap's phase 1 really pays the communicator's cost.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ..messages import GroupBuild
from .listeners import gloo_group


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
    pg: object                # dist.ProcessGroup
    backend: object           # the backend object (ProcessGroupGloo / ProcessGroupNCCL)
    kind: str                 # "gloo" | "nccl"
    build_s: float = 0.0

    @property
    def size(self) -> int:
        return len(self.members)


def abort_together(groups: list[Group]) -> None:
    """NCCL: abort every communicator of `groups` so nothing waits on a dead peer, all inside one
    ncclGroupStart/End: aborts one after another can deadlock each other (torch aborts all its
    groups the same way, pytorch#119797). Gloo has no working abort for a blocked op (a hung peer
    is fenced by killing it instead); dropping it is enough."""
    nccl = [g for g in groups if g.kind == "nccl"]
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


def _nccl(store, build: GroupBuild, grank: int, timeout: float, device: torch.device):
    # read by each new ProcessGroupNCCL: 2 = the watchdog only aborts the failed communicator. The
    # default (3) tears the process down, so a healthy rank would die with its peer instead of
    # failing through to the vote and being kept
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout)
    be = dist.ProcessGroupNCCL(store, grank, len(build.members), opts)
    if hasattr(be, "eager_connect_single_device"):
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
    if backend == "nccl" and not hasattr(be, "eager_connect_single_device"):
        # older torch: a first collective creates the communicator now, not at the first real step
        pg.allreduce([torch.zeros(1, device=device)]).wait()
    return Group(build.id, build.prefix, build.members, grank, pg, be, backend,
                 build_s=time.perf_counter() - t0)


class Reaper:
    """Drops replaced groups off the critical path: tearing down a gloo group costs ~10 ms a peer."""

    def __init__(self):
        self._items: list = []
        self._cv = threading.Condition()
        self._t = threading.Thread(target=self._run, name="tm-reaper", daemon=True)
        self._t.start()

    def drop(self, groups) -> None:
        with self._cv:
            self._items.extend(groups)
            self._cv.notify()

    def _run(self) -> None:
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
