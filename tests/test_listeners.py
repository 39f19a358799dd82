"""A built gloo group's listener takes no connection (comm/listeners.py): real gloo groups of two
ranks (threads here), a stranger's connects against them, with the filter and without it."""
from __future__ import annotations

import gc
import os
import socket
import threading
import time

import pytest
import torch

from tm_slurm.comm import listeners


def _group_of_two(served, prefix: str):
    import torch.distributed as dist
    pgs = [None, None]

    def build(r):
        pgs[r] = listeners.gloo_group(dist.PrefixStore(prefix, served.client()), r, 2,
                                      iface="127.0.0.1", timeout_s=20)
    ths = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(30)
    return pgs


def _allreduce(pgs) -> list[float]:
    ts = [torch.tensor([float(r + 1)]) for r in (0, 1)]
    works = [pg.allreduce([t]) for pg, t in zip(pgs, ts)]
    for w in works:
        w.wait()
    return [t.item() for t in ts]


def _ports(inodes: set[int]) -> list[int]:
    ports = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in open(table).readlines()[1:]:
            parts = line.split()
            if int(parts[9]) in inodes:
                ports.append(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def _knock(port: int, times: int) -> int:
    """Connect and close `times` times (a stranger's loop); how many connects got through."""
    got = 0
    for _ in range(times):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            got += 1
        except OSError:
            pass
    return got


@pytest.mark.parametrize("sealed", [True, False])
def test_a_built_groups_listener_takes_no_connection(served, monkeypatch, sealed):
    if not sealed:
        monkeypatch.setattr(listeners, "seal", lambda inodes: 0)     # the negative control
    before = listeners._our_listeners()
    pgs = _group_of_two(served, f"sealed{sealed}")
    ports = _ports(listeners._our_listeners() - before)
    assert len(ports) == 2                                  # one device a rank
    fds = len(os.listdir("/proc/self/fd"))
    got = sum(_knock(p, 200 if not sealed else 3) for p in ports)
    time.sleep(0.5)                                         # gloo accepts on its own thread
    leaked = len(os.listdir("/proc/self/fd")) - fds
    assert _allreduce(pgs) == [3.0, 3.0]                    # the pairs are untouched
    pgs.clear()               # gloo's threads gone before a later test forks this process
    gc.collect()
    if sealed:
        assert got == 0 and leaked <= 0
    else:
        # what gloo does on its own: every connect is accepted and its descriptor kept
        assert got == 400 and leaked >= 200
