"""The job secret and what it protects (security model: docs/design.md §9).

The controller draws 256 random bits at start. Agents get them through the environment of their
launch (local: the process's own environment; Slurm: srun's, which slurmstepd keeps out of argv),
workers through the first frame on their agent's socketpair; the secret never appears in argv,
events, status or logs. From it come independent keys: one for control-plane frames and one that
opens the job's store (tm_slurm/store/).

A frame is HMAC-SHA256(frame key, payload) || payload, the payload JSON of (job, generation,
sender, sequence number, body). A receiver checks the MAC before it parses anything, then the
job, the expected sender and a strictly increasing sequence number (no replay on a link).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from typing import Any

from . import codec

SECRET_ENV = "TM_SLURM_SECRET"
MAC_BYTES = 32
MAX_FRAME = 64 << 20      # a Launch carries the config; nothing legitimate comes near this


class AuthError(ValueError):
    """A frame or value that was not made with this job's secret (or was replayed)."""


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def agent_env(secret: bytes) -> dict[str, str]:
    """What an agent's launch adds to its environment."""
    return {SECRET_ENV: secret.hex()}


def take_secret_from_env() -> bytes:
    """Read the secret and remove it from this process's environment, so no child inherits it."""
    raw = os.environ.pop(SECRET_ENV, "")
    try:
        secret = bytes.fromhex(raw)
    except ValueError:
        secret = b""
    if len(secret) != 32:
        raise SystemExit(f"no job secret in ${SECRET_ENV}: agents are started by `tm-slurm run`")
    return secret


@dataclass(frozen=True)
class Keys:
    frame: bytes
    store: bytes

    @staticmethod
    def derive(secret: bytes) -> "Keys":
        def sub(label: bytes) -> bytes:
            return hmac.new(secret, b"tm_slurm/" + label, hashlib.sha256).digest()
        return Keys(sub(b"frame"), sub(b"store"))


def mac(key: bytes, *parts: bytes) -> bytes:
    # one-shot (OpenSSL's HMAC in one call): a controller opens ~2,000 frames a second at
    # 1,024 nodes, and an HMAC object fed piece by piece cost ~2.5 us more each
    return hmac.digest(key, b"".join(len(p).to_bytes(8, "big") + p for p in parts), "sha256")


class Sealer:
    """One side of one link: seals what it sends, opens (and checks) what it receives."""

    def __init__(self, keys: Keys, job: str, me: str, peer: str | None = None):
        self.keys, self.job, self.me = keys, job, me
        self.peer = peer          # the sender we accept; None: whoever authenticates first
        self.gen = 0
        self._out = 0
        self._in = 0

    def seal(self, msg: Any) -> bytes:
        """`msg`: a message, or one already encoded (codec.prepare) for many links."""
        payload = msg if isinstance(msg, codec.Encoded) else codec.prepare(msg)
        self._out += 1
        body = f"[{json.dumps(self.job)},{self.gen},{json.dumps(self.me)},{self._out},{payload}]".encode()
        return mac(self.keys.frame, body) + body

    def open(self, frame: bytes) -> Any:
        """The message in `frame`; AuthError before anything is parsed if it is not ours."""
        if len(frame) <= MAC_BYTES or len(frame) > MAX_FRAME:
            raise AuthError(f"frame of {len(frame)} bytes")
        body = frame[MAC_BYTES:]
        if not hmac.compare_digest(frame[:MAC_BYTES], mac(self.keys.frame, body)):
            raise AuthError("bad MAC")
        try:
            job, _gen, sender, seq, payload = json.loads(body)
        except (ValueError, TypeError, RecursionError) as e:
            raise AuthError(f"malformed frame: {e}") from None
        if job != self.job or not isinstance(seq, int) or not isinstance(sender, str):
            raise AuthError(f"frame of job {job!r}")
        if self.peer is not None and sender != self.peer:
            raise AuthError(f"frame from {sender!r}, expected {self.peer!r}")
        if seq <= self._in:
            raise AuthError(f"replayed frame (sequence {seq} after {self._in})")
        msg = codec.decode(payload)
        self._in = seq
        if self.peer is None:
            self.peer = sender
        return msg
