"""gloo groups whose listening socket takes no connection once the group is built (docs/design.md §9).

A gloo device listens for its pairs' connections for as long as it lives and knows a peer only
by an 8-byte sequence number (0 for a two-rank group). Whoever reaches the port can connect:
gloo never closes a connection that sent nothing or a short read, so a loop of connects leaked
~2,000 descriptors a second until `accept` failed with EMFILE on gloo's loop thread and the
worker aborted (33 s here, under a second with a 1,024 limit). torch offers no way to close the
listener; every pair of a group is connected when ProcessGroupGloo's constructor returns. So
`gloo_group` notes the listening socket its device opened and then attaches a socket filter
that drops every packet (`SO_ATTACH_FILTER`, a one-instruction classic BPF program; no
privilege needed): the kernel drops a stranger's SYN before any socket exists, while the
connected pairs, accepted before, are untouched. What stays open is the build's own window,
from the device's creation to its last pair's connect (milliseconds, after every member has
arrived).
"""
from __future__ import annotations

import ctypes
import os
import socket
import threading
from datetime import timedelta

import torch.distributed as dist

SO_ATTACH_FILTER = 26
_LISTEN = "0A"
_lock = threading.Lock()       # two builds at once in one process: each finds its own listener


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Insn))]


_DROP_ALL = (_Insn * 1)(_Insn(0x06, 0, 0, 0))        # BPF_RET | BPF_K: keep 0 bytes
_PROG = _Prog(1, _DROP_ALL)


def gloo_group(store, rank: int, size: int, *, iface: str, timeout_s: float, threads: int | None = None):
    """ProcessGroupGloo on one device bound to `iface` (a hostname or address; "" for gloo's
    default), its listener closed to new connections once every pair is connected."""
    opts = dist.ProcessGroupGloo._Options()
    with _lock:
        before = _our_listeners()
        dev = (dist.ProcessGroupGloo.create_device(hostname=iface) if iface
               else dist.ProcessGroupGloo.create_default_device())
        opened = _our_listeners() - before
    opts._devices = [dev]
    opts._timeout = timedelta(seconds=timeout_s)
    if threads is not None:
        opts._threads = threads
    pg = dist.ProcessGroupGloo(store, rank, size, opts)
    seal(opened)
    return pg


def seal(inodes: set[int]) -> int:
    """Drop every packet that reaches these listening sockets of this process; how many were."""
    done = 0
    for fd, inode in _socket_fds().items():
        if inode in inodes:
            s = socket.socket(fileno=fd)
            try:
                s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER,
                             ctypes.string_at(ctypes.addressof(_PROG), ctypes.sizeof(_PROG)))
                done += 1
            except OSError:
                pass            # a kernel without socket filters: the listener stays as gloo left it
            finally:
                s.detach()      # gloo owns the descriptor
    return done


def _socket_fds() -> dict[int, int]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(name)] = int(link[8:-1])
    return out


def _our_listeners() -> set[int]:
    """Inodes of the listening TCP sockets this process holds."""
    listening = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    parts = line.split(None, 10)
                    if len(parts) > 9 and parts[3] == _LISTEN:
                        listening.add(int(parts[9]))
        except OSError:
            continue
    return listening & set(_socket_fds().values())
