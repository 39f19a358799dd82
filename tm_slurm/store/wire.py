"""The store's protocol, both sides (docs/design.md §9).

Handshake, in the first bytes of a connection:
  server: MAGIC || s_nonce (32)
  client: c_nonce (32) || HMAC(k, "c" || s_nonce || c_nonce)
  server: HMAC(k, "s" || s_nonce || c_nonce)          (the client knows it reached the job's store)
with k the store key derived from the job secret. Both then seal frames under
HMAC(k, "k" || s_nonce || c_nonce), so nothing of one session can be replayed in another.

A frame: u32 length || HMAC(session, direction || sequence || body) || body, with a sequence
number per direction that both sides count (a frame dropped, reordered or replayed fails the
MAC). A body is one op byte and its fields, each u32 length || bytes.
"""
from __future__ import annotations

import hmac
import struct

MAGIC = b"TMS1"
NONCE = 32
MAC = 32
HELLO = len(MAGIC) + NONCE          # what the server sends first
PROOF = NONCE + MAC                 # what the client answers: all an unauthenticated peer may send

MAX_KEY = 4096
MAX_VALUE = 1 << 20                 # group rendezvous and votes are far under this
MAX_FRAME = 4 * MAX_VALUE           # a multi_set or multi_get of a few values
_LEN = struct.Struct(">I")

# requests
SET, GET, WAIT, ADD, CAS, APPEND, MULTI_GET, MULTI_SET, CHECK, DELETE, NUM_KEYS = (bytes([c]) for c in b"SGWACPMTKDN")
# answers
OK, ABSENT, TIMEOUT, ERROR = (bytes([c]) for c in b"+?T-")
NO_WAIT = -1                        # GET's wait in ms: answer at once, absent or not


class ProtocolError(ValueError):
    """A frame or handshake that is not this job's store protocol."""


def _h(key: bytes, *parts: bytes) -> bytes:
    return hmac.digest(key, b"".join(parts), "sha256")


def client_proof(key: bytes, s_nonce: bytes, c_nonce: bytes) -> bytes:
    return _h(key, b"c", s_nonce, c_nonce)


def server_proof(key: bytes, s_nonce: bytes, c_nonce: bytes) -> bytes:
    return _h(key, b"s", s_nonce, c_nonce)


def session_key(key: bytes, s_nonce: bytes, c_nonce: bytes) -> bytes:
    return _h(key, b"k", s_nonce, c_nonce)


def pack(op: bytes, *fields: bytes) -> bytes:
    return op + b"".join(_LEN.pack(len(f)) + f for f in fields)


def unpack(body: bytes) -> tuple[int, list[bytes]]:
    """(op, fields) of a body; ProtocolError if it is not one."""
    if not body:
        raise ProtocolError("empty frame")
    fields, i, n = [], 1, len(body)
    while i < n:
        if i + 4 > n:
            raise ProtocolError("truncated field length")
        (ln,) = _LEN.unpack_from(body, i)
        i += 4
        if i + ln > n:
            raise ProtocolError("truncated field")
        fields.append(body[i:i + ln])
        i += ln
    return body[0], fields


class Sealer:
    """One side's frames of one session: `direction` is what this side writes (b"c" or b"s")."""

    def __init__(self, session: bytes, direction: bytes):
        self.key, self.out_dir = session, direction
        self.in_dir = b"s" if direction == b"c" else b"c"
        self.sent = self.got = 0

    def seal(self, body: bytes) -> bytes:
        self.sent += 1
        tag = _h(self.key, self.out_dir, self.sent.to_bytes(8, "big"), body)
        return _LEN.pack(MAC + len(body)) + tag + body

    def frames(self, buf: bytearray):
        """Yield each whole frame's body in `buf` (removing it), checked; ProtocolError on the
        first that is not ours or too long."""
        while len(buf) >= 4:
            (ln,) = _LEN.unpack_from(buf, 0)
            if ln < MAC or ln > MAX_FRAME + MAC:
                raise ProtocolError(f"frame of {ln} bytes")
            if len(buf) < 4 + ln:
                return
            tag, body = bytes(buf[4:4 + MAC]), bytes(buf[4 + MAC:4 + ln])
            del buf[:4 + ln]
            self.got += 1
            if not hmac.compare_digest(tag, _h(self.key, self.in_dir, self.got.to_bytes(8, "big"), body)):
                raise ProtocolError("bad MAC")
            yield body
