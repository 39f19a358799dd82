"""Agent <-> worker framing over an inherited socketpair: length-prefixed pickles.

Both ends are processes of one node started by the same agent, so pickle is safe here. A closed
socket is how each side learns the other is gone (the worker exits when its agent dies)."""
from __future__ import annotations

import pickle
import socket
import struct
import threading
from typing import Any

_HDR = struct.Struct("!I")


class Wire:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._wlock = threading.Lock()
        self._rbuf = bytearray()

    def send(self, msg: Any) -> bool:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._wlock:
                self.sock.sendall(_HDR.pack(len(data)) + data)
            return True
        except OSError:
            return False

    def recv(self) -> Any:
        """Blocking read of one message; raises EOFError when the peer is gone."""
        while True:
            msg = self._take()
            if msg is not None:
                return msg[0]
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
        while (m := self._take()) is not None:
            out.append(m[0])
        return out

    def _take(self):
        if len(self._rbuf) < _HDR.size:
            return None
        (n,) = _HDR.unpack_from(self._rbuf)
        if len(self._rbuf) < _HDR.size + n:
            return None
        data = bytes(self._rbuf[_HDR.size:_HDR.size + n])
        del self._rbuf[:_HDR.size + n]
        return (pickle.loads(data),)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
