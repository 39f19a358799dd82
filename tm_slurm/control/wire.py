"""Agent <-> worker framing over an inherited socketpair: length-prefixed sealed frames
(control/auth.py), the same codec and checks as the MPI links.

The agent's first frame is the bootstrap: the job secret itself, unsealed (the socketpair is
private to the two processes); every frame after it is sealed. A closed socket is how each side
learns the other is gone (the worker exits when its agent dies)."""
from __future__ import annotations

import socket
import struct
import threading
from typing import Any

from .auth import MAX_FRAME, Sealer

_HDR = struct.Struct("!I")


class Wire:
    def __init__(self, sock: socket.socket, sealer: Sealer | None = None):
        self.sock = sock
        self.sealer = sealer
        self.refused = 0
        self._wlock = threading.Lock()
        self._rbuf = bytearray()

    def send_bootstrap(self, secret: bytes) -> bool:
        with self._wlock:
            return self._send_frame(secret)

    def recv_bootstrap(self) -> bytes:
        return self._recv_frame()

    def send(self, msg: Any) -> bool:
        # sealed under the lock: a worker sends from two threads (its loop, its heartbeat), and
        # frames sealed in one order but written in the other are refused as replays
        with self._wlock:
            return self._send_frame(self.sealer.seal(msg))

    def _send_frame(self, data: bytes) -> bool:
        try:
            self.sock.sendall(_HDR.pack(len(data)) + data)
            return True
        except OSError:
            return False

    def recv(self) -> Any:
        """Blocking read of one message; raises EOFError when the peer is gone. A frame that fails
        its check is dropped and counted."""
        while True:
            msg = self._open(self._recv_frame())
            if msg is not None:
                return msg[0]

    def _recv_frame(self) -> bytes:
        while True:
            frame = self._take()
            if frame is not None:
                return frame
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise EOFError("peer closed")
            self._rbuf += chunk

    def recv_ready(self) -> list[Any]:
        """Non-blocking: read what the socket has (call when select() says readable)."""
        try:
            chunk = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
        except BlockingIOError:
            chunk = None
        except OSError:
            raise EOFError("peer closed") from None
        if chunk == b"":
            raise EOFError("peer closed")
        if chunk:
            self._rbuf += chunk
        out = []
        while (frame := self._take()) is not None:
            msg = self._open(frame)
            if msg is not None:
                out.append(msg[0])
        return out

    def _open(self, frame: bytes):
        try:
            return (self.sealer.open(frame),)
        except ValueError:
            self.refused += 1
            return None

    def _take(self) -> bytes | None:
        if len(self._rbuf) < _HDR.size:
            return None
        (n,) = _HDR.unpack_from(self._rbuf)
        if n > MAX_FRAME:
            raise EOFError(f"frame of {n} bytes: not a peer of this job")
        if len(self._rbuf) < _HDR.size + n:
            return None
        data = bytes(self._rbuf[_HDR.size:_HDR.size + n])
        del self._rbuf[:_HDR.size + n]
        return data

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
