"""The store server: one thread, every connection non-blocking (docs/design.md §9); its process
is store/process.py.

Bounds, so that nobody can make it grow or stall: an unauthenticated connection has `AUTH_S` to
prove it holds the key and may send `wire.PROOF` bytes, no more; past `PENDING_PER_PEER` (per
peer address) or `PENDING_TOTAL` such connections the oldest is dropped, so a flood of idle
connections costs a real client at most a reconnect; keys, values and the store's total are
capped (`wire.MAX_KEY`, `wire.MAX_VALUE`, `MAX_TOTAL`), and so is what waits to be written to a
peer that does not read (`OUT_CAP`). A request that waits for keys parks its connection, not the
thread.
"""
from __future__ import annotations

import errno
import heapq
import hmac
import itertools
import os
import secrets
import selectors
import socket
import sys
import time
from collections import OrderedDict
from typing import Callable

from . import wire

AUTH_S = 1.0                 # an honest client answers the challenge in one round trip
PENDING_PER_PEER = 64
PENDING_TOTAL = 512
ACCEPTS_PER_WAKE = 256       # a flood of connects costs one wake-up a bounded amount
MAX_TOTAL = 256 << 20        # keys + values; the job's own use is a few MB at 16k nodes
ENTRY_BYTES = 64             # what one key costs besides its bytes
OUT_CAP = 4 * wire.MAX_FRAME
REPORT_EVERY_S = 10.0        # at most one line a period about dropped connections


class _Conn:
    __slots__ = ("sock", "peer", "inbuf", "outbuf", "sealer", "nonce", "deadline", "parked", "writing")

    def __init__(self, sock: socket.socket, peer: str, deadline: float):
        self.sock, self.peer, self.deadline = sock, peer, deadline
        self.inbuf, self.outbuf = bytearray(), bytearray()
        self.sealer: wire.Sealer | None = None
        self.nonce = secrets.token_bytes(wire.NONCE)
        self.parked: _Waiter | None = None
        self.writing = False


class _Waiter:
    __slots__ = ("conn", "op", "keys", "missing", "deadline", "done")

    def __init__(self, conn: _Conn, op: int, keys: list[bytes], missing: set[bytes], deadline: float):
        self.conn, self.op, self.keys, self.missing, self.deadline = conn, op, keys, missing, deadline
        self.done = False


class StoreFull(Exception):
    pass


class Server:
    def __init__(self, key: bytes, host: str, port: int = 0, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)):
        self.key, self.clock, self.log = key, clock, log
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.create_server((host, port), family=family, backlog=4096)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.pending: OrderedDict[_Conn, None] = OrderedDict()    # unauthenticated, oldest first
        self.per_peer: dict[str, int] = {}
        self.data: dict[bytes, bytes] = {}
        self.size = 0
        self.waiters: dict[bytes, list[_Waiter]] = {}
        self.timers: list[tuple[float, int, _Waiter]] = []
        self._tick = itertools.count()
        self.dropped: dict[str, int] = {}
        self._reported = clock()

    # ------------------------------------------------------------------ loop
    def serve(self, stop_fd: int) -> None:
        """Until `stop_fd` (a pipe's read end) reaches its end."""
        self.sel.register(stop_fd, selectors.EVENT_READ, "stop")
        while self.step() != "stop":
            pass

    def serve_until(self, stop: Callable[[], bool]) -> None:
        """In a thread of a test: until `stop()`."""
        while not stop():
            self.step(0.05)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        for key in list(self.sel.get_map().values()):
            if isinstance(key.data, _Conn):
                key.data.sock.close()
        self.sel.close()
        self.listener.close()

    def step(self, max_wait: float = 1.0):
        now = self.clock()
        nxt = min([c.deadline for c in itertools.islice(self.pending, 1)] +
                  [t[0] for t in self.timers[:1]] + [now + max_wait])
        for sk, ev in self.sel.select(max(0.0, nxt - now)):
            if sk.data == "stop":
                if not os.read(sk.fd, 4096):
                    return "stop"
            elif sk.data is None:
                self._accept()
            else:
                conn = sk.data
                if ev & selectors.EVENT_WRITE and conn.sock.fileno() >= 0:
                    self._flush(conn)
                if ev & selectors.EVENT_READ and conn.sock.fileno() >= 0:
                    self._read(conn)
        self._expire(self.clock())
        return None

    def _expire(self, now: float) -> None:
        while self.pending:
            c = next(iter(self.pending))
            if c.deadline > now:
                break
            self._drop(c, "silent")
        while self.timers and self.timers[0][0] <= now:
            _, _, w = heapq.heappop(self.timers)
            if not w.done:
                self._finish(w, timed_out=True)
        if self.dropped and now - self._reported >= REPORT_EVERY_S:
            worst = sorted(self.dropped.items(), key=lambda kv: -kv[1])[:3]
            self.log(f"tm-slurm store: dropped {sum(self.dropped.values())} unauthenticated connection(s) "
                     f"in {now - self._reported:.0f} s (most from {', '.join(f'{p} ({n})' for p, n in worst)})")
            self.dropped.clear()
            self._reported = now

    # ------------------------------------------------------------- connections
    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # out of descriptors: make room by dropping the oldest stranger
                    if self.pending:
                        self._drop(next(iter(self.pending)), "descriptors")
                    return
                if e.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue
                raise
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, addr[0], self.clock() + AUTH_S)
            self.pending[conn] = None
            n = self.per_peer[conn.peer] = self.per_peer.get(conn.peer, 0) + 1
            self.sel.register(sock, selectors.EVENT_READ, conn)
            if n > PENDING_PER_PEER:
                self._drop(next(c for c in self.pending if c.peer == conn.peer), "crowded")
            if len(self.pending) > PENDING_TOTAL:
                self._drop(next(iter(self.pending)), "crowded")
            if sock.fileno() >= 0:
                self._send(conn, wire.MAGIC + conn.nonce)

    def _unpend(self, conn: _Conn) -> None:
        del self.pending[conn]
        self.per_peer[conn.peer] -= 1
        if not self.per_peer[conn.peer]:
            del self.per_peer[conn.peer]

    def _drop(self, conn: _Conn, why: str) -> None:
        if conn in self.pending:
            self._unpend(conn)
            self.dropped[conn.peer] = self.dropped.get(conn.peer, 0) + 1
        elif why:
            self.log(f"tm-slurm store: closed the connection of {conn.peer}: {why}")
        if conn.parked is not None:
            self._unpark(conn.parked)
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        # a stranger's bytes are read no further than one past the proof: one is refused for it
        want = wire.PROOF + 1 - len(conn.inbuf) if conn.sealer is None else 1 << 18
        try:
            got = conn.sock.recv(want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got = b""
        if not got:
            self._drop(conn, "")
            return
        conn.inbuf += got
        if conn.sealer is None:
            self._authenticate(conn)
        elif len(conn.inbuf) > 2 * (wire.MAX_FRAME + wire.MAC + 4):
            self._drop(conn, "sent more than a request while one waited")
        else:
            self._serve(conn)

    def _authenticate(self, conn: _Conn) -> None:
        if len(conn.inbuf) < wire.PROOF:
            return
        c_nonce, proof = bytes(conn.inbuf[:wire.NONCE]), bytes(conn.inbuf[wire.NONCE:wire.PROOF])
        if len(conn.inbuf) > wire.PROOF or not hmac.compare_digest(
                proof, wire.client_proof(self.key, conn.nonce, c_nonce)):
            self._drop(conn, "refused")
            return
        self._unpend(conn)
        conn.inbuf.clear()
        conn.sealer = wire.Sealer(wire.session_key(self.key, conn.nonce, c_nonce), b"s")
        self._send(conn, wire.server_proof(self.key, conn.nonce, c_nonce))

    def _send(self, conn: _Conn, data: bytes) -> None:
        conn.outbuf += data
        if len(conn.outbuf) > OUT_CAP:
            self._drop(conn, "does not read its answers")
            return
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbuf)
            del conn.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn, "")
            return
        want = bool(conn.outbuf)
        if want != conn.writing:
            conn.writing = want
            self.sel.modify(conn.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0), conn)

    # ------------------------------------------------------------------ requests
    def _serve(self, conn: _Conn) -> None:
        try:
            for body in conn.sealer.frames(conn.inbuf):
                op, f = wire.unpack(body)
                try:
                    answer = self._op(conn, op, f)
                except StoreFull as e:
                    answer = wire.pack(wire.ERROR, str(e).encode())
                except (ValueError, IndexError) as e:
                    answer = wire.pack(wire.ERROR, f"bad request: {e}".encode())
                if answer is not None:
                    self._send(conn, conn.sealer.seal(answer))
                if conn.parked is not None or conn.sock.fileno() < 0:
                    return
        except wire.ProtocolError as e:
            self._drop(conn, str(e))

    def _op(self, conn: _Conn, op: int, f: list[bytes]) -> bytes | None:
        for k in f[:1]:
            if len(k) > wire.MAX_KEY:
                raise ValueError(f"a key of {len(k)} bytes (the cap is {wire.MAX_KEY})")
        if op == wire.SET[0]:
            self._put(f[0], f[1])
            return wire.OK
        if op == wire.GET[0]:
            wait_ms = int(f[1])
            if f[0] in self.data or wait_ms == wire.NO_WAIT:
                return wire.pack(wire.OK, self.data[f[0]]) if f[0] in self.data else wire.ABSENT
            return self._park(conn, op, [f[0]], wait_ms)
        if op in (wire.WAIT[0], wire.MULTI_GET[0]):
            return self._park(conn, op, f[1:], int(f[0]))
        if op == wire.ADD[0]:
            cur = int(self.data.get(f[0], b"0"))
            new = str(cur + int(f[1])).encode()
            self._put(f[0], new)
            return wire.pack(wire.OK, new)
        if op == wire.CAS[0]:
            key, expected, desired = f
            cur = self.data.get(key)
            if cur is None and expected:
                return wire.pack(wire.OK, expected)
            if cur is None or cur == expected:
                self._put(key, desired)
                return wire.pack(wire.OK, desired)
            return wire.pack(wire.OK, cur)
        if op == wire.APPEND[0]:            # not answered: what follows on this link comes after it
            try:
                self._put(f[0], self.data.get(f[0], b"") + f[1])
            except StoreFull as e:
                self._drop(conn, f"append: {e}")
            return None
        if op == wire.MULTI_SET[0]:
            for k, v in zip(f[0::2], f[1::2]):
                self._put(k, v)
            return wire.OK
        if op == wire.CHECK[0]:
            return wire.pack(wire.OK, b"1" if all(k in self.data for k in f) else b"0")
        if op == wire.DELETE[0]:
            v = self.data.pop(f[0], None)
            if v is not None:
                self.size -= len(f[0]) + len(v) + ENTRY_BYTES
            return wire.pack(wire.OK, b"0" if v is None else b"1")
        if op == wire.NUM_KEYS[0]:
            return wire.pack(wire.OK, str(len(self.data)).encode())
        raise ValueError(f"unknown op {op}")

    def _put(self, key: bytes, value: bytes) -> None:
        if len(key) > wire.MAX_KEY:
            raise StoreFull(f"a key of {len(key)} bytes (the cap is {wire.MAX_KEY})")
        if len(value) > wire.MAX_VALUE:
            raise StoreFull(f"a value of {len(value)} bytes (the cap is {wire.MAX_VALUE})")
        old = self.data.get(key)
        grow = len(value) - (len(old) if old is not None else -len(key) - ENTRY_BYTES)
        if self.size + grow > MAX_TOTAL:
            raise StoreFull(f"the store is full ({self.size} bytes of {MAX_TOTAL})")
        self.data[key] = value
        self.size += grow
        if old is None:
            for w in self.waiters.pop(key, ()):
                if not w.done:
                    w.missing.discard(key)
                    if not w.missing:
                        self._finish(w, timed_out=False)

    def _park(self, conn: _Conn, op: int, keys: list[bytes], wait_ms: int) -> bytes | None:
        missing = {k for k in keys if k not in self.data}
        w = _Waiter(conn, op, keys, missing, self.clock() + max(wait_ms, 0) / 1000)
        if not missing:
            return self._answer(w, timed_out=False)
        for k in missing:
            self.waiters.setdefault(k, []).append(w)
        heapq.heappush(self.timers, (w.deadline, next(self._tick), w))
        conn.parked = w
        return None

    def _answer(self, w: _Waiter, timed_out: bool) -> bytes:
        if timed_out:
            return wire.TIMEOUT
        if w.op == wire.WAIT[0]:
            return wire.OK
        # a key deleted between its creation and this answer: the waiter saw it exist
        return wire.pack(wire.OK, *(self.data.get(k, b"") for k in w.keys))

    def _unpark(self, w: _Waiter) -> None:
        w.done = True
        w.conn.parked = None
        for k in w.missing:
            lst = self.waiters.get(k)
            if lst is not None:
                lst[:] = [x for x in lst if x is not w]
                if not lst:
                    del self.waiters[k]

    def _finish(self, w: _Waiter, timed_out: bool) -> None:
        conn = w.conn
        self._unpark(w)
        if conn.sock.fileno() < 0:
            return
        self._send(conn, conn.sealer.seal(self._answer(w, timed_out)))
        if conn.sock.fileno() >= 0 and conn.inbuf:
            self._serve(conn)
