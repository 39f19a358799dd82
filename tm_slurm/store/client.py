"""A client of the job's store, as a `torch.distributed.Store` (docs/design.md §9): PrefixStore and
ProcessGroupGloo/NCCL rendezvous on it as they did on TCPStore, and the vote's extras (`peek`,
`append`, `pieces`) are one request each.

One connection, one request at a time (a lock): a thread that must not wait behind another's
rendezvous opens its own client, as the workers do for each build. A failed or timed-out request
raises `torch.distributed.DistStoreError`, as TCPStore's do. Connecting is retried until the
timeout: the server drops the oldest unauthenticated connections when strangers crowd it, and a
real client's retry then gets through.
"""
from __future__ import annotations

import hmac
import secrets
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from . import wire

_SLACK_S = 5.0        # beyond a wait's own timeout, for the answer to come back
_RETRY_S = (0.01, 0.2)


class StoreClient(dist.Store):
    def __init__(self, host: str, port: int, key: bytes, timeout: float):
        super().__init__()
        self.host, self.port, self._key = host, port, key
        self.set_timeout(timedelta(seconds=timeout))
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._sealer: wire.Sealer | None = None
        self._buf = bytearray()
        self._connect(time.monotonic() + timeout)

    @property
    def addr(self) -> tuple[str, int]:
        return self.host, self.port

    def clone(self) -> "StoreClient":
        return StoreClient(self.host, self.port, self._key, self.timeout.total_seconds())

    # ------------------------------------------------------------- connection
    def _connect(self, deadline: float) -> None:
        pause, why = _RETRY_S[0], ""
        while True:
            try:
                self._handshake(deadline)
                return
            except (OSError, wire.ProtocolError) as e:
                why = f"{type(e).__name__}: {e}"
            if time.monotonic() + pause > deadline:
                raise dist.DistStoreError(f"cannot reach the job's store at {self.host}:{self.port}: {why}")
            time.sleep(pause)
            pause = min(pause * 2, _RETRY_S[1])

    def _handshake(self, deadline: float) -> None:
        sock = socket.create_connection((self.host, self.port), timeout=max(0.05, deadline - time.monotonic()))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = _read_exact(sock, wire.HELLO)
            if hello[:len(wire.MAGIC)] != wire.MAGIC:
                raise wire.ProtocolError("not the job's store (wrong greeting)")
            s_nonce, c_nonce = hello[len(wire.MAGIC):], secrets.token_bytes(wire.NONCE)
            sock.sendall(c_nonce + wire.client_proof(self._key, s_nonce, c_nonce))
            if not hmac.compare_digest(_read_exact(sock, wire.MAC), wire.server_proof(self._key, s_nonce, c_nonce)):
                raise wire.ProtocolError("the store at this address does not hold the job's key")
        except BaseException:
            sock.close()
            raise
        self._sock, self._buf = sock, bytearray()
        self._sealer = wire.Sealer(wire.session_key(self._key, s_nonce, c_nonce), b"c")

    def _call(self, op: bytes, *fields: bytes, wait_s: float = 0.0, answer: bool = True) -> list[bytes] | None:
        got = self._exchange([(op, fields, answer)], wait_s)
        return got[0] if answer else None

    def _exchange(self, requests: list[tuple[bytes, tuple, bool]], wait_s: float = 0.0) -> list:
        """Send `requests` (op, fields, answered) in one write and read the answers of those
        answered, in order: the store serves a connection's requests in the order they came, so
        a batch costs one round trip. Only the last may wait (`wait_s`): a parked request holds
        the ones behind it."""
        with self._lock:
            if self._sock is None:
                raise dist.DistStoreError("the job's store connection is closed")
            try:
                self._sock.settimeout(wait_s + _SLACK_S if wait_s else self.timeout.total_seconds() + _SLACK_S)
                self._sock.sendall(b"".join(self._sealer.seal(wire.pack(op, *fields)) for op, fields, _ in requests))
                bodies = [self._next() for _, _, answer in requests if answer]
            except (OSError, wire.ProtocolError) as e:
                self._close()
                raise dist.DistStoreError(f"the job's store at {self.host}:{self.port} failed: "
                                          f"{type(e).__name__}: {e}") from None
        out = []
        for body in bodies:        # every answer is read before any raises: the link stays in step
            kind, got = wire.unpack(body)
            if kind == wire.ERROR[0]:
                raise dist.DistStoreError(f"the job's store refused: {got[0].decode(errors='replace')}")
            if kind == wire.TIMEOUT[0]:
                raise dist.DistStoreError(f"timed out after {wait_s:.1f} s waiting for the job's store")
            out.append(None if kind == wire.ABSENT[0] else got)
        return out

    def _next(self) -> bytes:
        while True:
            for body in self._sealer.frames(self._buf):
                return body
            chunk = self._sock.recv(1 << 16)
            if not chunk:
                raise ConnectionResetError("closed by the store")
            self._buf += chunk

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close()

    # ------------------------------------------------------ torch's Store API
    def _wait_s(self, timeout: timedelta | None) -> float:
        return (self.timeout if timeout is None else timeout).total_seconds()

    def set(self, key, value) -> None:
        self._call(wire.SET, _b(key), _b(value))

    def get(self, key) -> bytes:
        return self.wait_get(key, self._wait_s(None))

    def multi_get(self, keys) -> list[bytes]:
        wait_s = self._wait_s(None)
        return self._call(wire.MULTI_GET, str(int(wait_s * 1000)).encode(), *map(_b, keys), wait_s=wait_s)

    def multi_set(self, keys, values) -> None:
        self._call(wire.MULTI_SET, *(x for kv in zip(keys, values) for x in map(_b, kv)))

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        wait_s = self._wait_s(timeout)
        self._call(wire.WAIT, str(int(wait_s * 1000)).encode(), *map(_b, keys), wait_s=wait_s)

    def add(self, key, amount) -> int:
        return int(self._call(wire.ADD, _b(key), str(int(amount)).encode())[0])

    def compare_set(self, key, expected, desired) -> bytes:
        return self._call(wire.CAS, _b(key), _b(expected), _b(desired))[0]

    def check(self, keys) -> bool:
        return self._call(wire.CHECK, *map(_b, keys))[0] == b"1"

    def delete_key(self, key) -> bool:
        return self._call(wire.DELETE, _b(key))[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(wire.NUM_KEYS)[0])

    # ------------------------------------------------------------ the vote's
    def peek(self, key) -> bytes | None:
        """The value of KEY, or None if there is none yet, without waiting for it."""
        got = self._call(wire.GET, _b(key), str(wire.NO_WAIT).encode())
        return None if got is None else got[0]

    def wait_get(self, key, timeout_s: float) -> bytes:
        """KEY's value once it exists, in one round trip; DistStoreError after `timeout_s`."""
        return self._call(wire.GET, _b(key), str(int(timeout_s * 1000)).encode(), wait_s=timeout_s)[0]

    def append(self, key, value) -> None:
        """Add to KEY's value. Not answered, so it costs no round trip; what this client sends
        later reaches the store after it."""
        self._call(wire.APPEND, _b(key), _b(value), answer=False)

    def pipeline(self, *calls: tuple) -> list:
        """Several calls in one write and one round trip (one wake-up of the store's thread and
        of this one): ("append", key, value) (None), ("add", key, amount) (the new value),
        ("peek", key) (the value or None), ("cas", key, expected, desired) (the value that
        stands), ("delete", key) (whether it was there), ("set", key, value) (None), and last
        only, ("wait_get", key, timeout_s) (the value once it exists). The store applies them in
        this order (another connection's requests may come in between); their results, in order."""
        reqs, conv, wait_s = [], [], 0.0
        for i, (name, key, *rest) in enumerate(calls):
            k = _b(key)
            if name == "append":
                reqs.append((wire.APPEND, (k, _b(rest[0])), False))
                conv.append(None)
                continue
            if name == "add":
                reqs.append((wire.ADD, (k, str(int(rest[0])).encode()), True))
                conv.append(lambda g: int(g[0]))
            elif name == "peek":
                reqs.append((wire.GET, (k, str(wire.NO_WAIT).encode()), True))
                conv.append(lambda g: None if g is None else g[0])
            elif name == "cas":
                reqs.append((wire.CAS, (k, _b(rest[0]), _b(rest[1])), True))
                conv.append(lambda g: g[0])
            elif name == "delete":
                reqs.append((wire.DELETE, (k,), True))
                conv.append(lambda g: g[0] == b"1")
            elif name == "set":
                reqs.append((wire.SET, (k, _b(rest[0])), True))
                conv.append(lambda g: None)
            elif name == "wait_get" and i == len(calls) - 1:
                wait_s = float(rest[0])
                reqs.append((wire.GET, (k, str(int(wait_s * 1000)).encode()), True))
                conv.append(lambda g: g[0])
            else:
                raise ValueError(f"pipeline: {name!r} is not a call it makes (a wait comes last)")
        got = iter(self._exchange(reqs, wait_s))
        return [None if f is None else f(next(got)) for f in conv]

    def pieces(self, key, size: int) -> list[bytes]:
        """KEY's value (none if absent) cut into pieces of `size` bytes; ValueError if it is not."""
        raw = self.peek(key) or b""
        if len(raw) % size:
            raise ValueError(f"store value of {key!r} is not a run of {size}-byte pieces")
        return [raw[i:i + size] for i in range(0, len(raw), size)]


def _b(x) -> bytes:
    return x.encode() if isinstance(x, str) else bytes(x)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionResetError("closed during the handshake")
        out += chunk
    return bytes(out)
