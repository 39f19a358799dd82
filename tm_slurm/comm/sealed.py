"""The job's view of the TCPStore: every key under a prefix derived from the job secret, every value
sealed with an HMAC over (key, value) (security model: docs/design.md §9).

torch's TCPStore has no authentication, and in torch 2.13 any client can `list_keys()`, so a
stranger who reaches the port learns key names; the prefix only keeps the job apart from every
other key in the store. What protects the job is the seal: a value written without the secret
(a forged vote, switch decision or group rendezvous address) fails the check and is refused as if
it were absent. Counters (`add`) cannot be sealed; the vote does not trust them alone
(comm/vote.py). An appended key is a run of sealed pieces of one size, each checked on its own.
A Python `dist.Store`, so gloo/NCCL rendezvous through PrefixStore go through it.
"""
from __future__ import annotations

import hmac
from datetime import timedelta

import torch.distributed as dist

from ..control.auth import MAC_BYTES, AuthError, Keys, mac

# compare_set with this as both expected and desired value reads a key in one round trip without
# waiting for it (a get is two: wait, then get) and without creating it: a sealed value or a run
# of sealed pieces never is this
_ABSENT = b"\0absent"


class SealedStore(dist.Store):
    def __init__(self, inner: dist.Store, keys: Keys):
        super().__init__()
        self.inner, self._key, self._prefix = inner, keys.store, keys.store_prefix
        self.refused = 0
        self.set_timeout(inner.timeout)

    def _k(self, key: str) -> str:
        return self._prefix + key

    def _seal(self, key: str, value) -> bytes:
        v = value.encode() if isinstance(value, str) else bytes(value)
        return mac(self._key, key.encode(), v) + v

    def _open(self, key: str, raw) -> bytes:
        raw = bytes(raw)
        v = raw[MAC_BYTES:]
        if len(raw) < MAC_BYTES or not hmac.compare_digest(raw[:MAC_BYTES], mac(self._key, key.encode(), v)):
            self.refused += 1
            raise AuthError(f"store value of {key!r} was not written by this job")
        return v

    def set(self, key, value) -> None:
        self.inner.set(self._k(key), self._seal(key, value))

    def get(self, key) -> bytes:
        return self._open(key, self.inner.get(self._k(key)))

    def compare_set(self, key, expected, desired) -> bytes:
        # the store's "expected empty" means "absent"; a sealed value is never empty
        exp = b"" if expected in ("", b"") else self._seal(key, expected)
        return self._open(key, self.inner.compare_set(self._k(key), exp, self._seal(key, desired)))

    def peek(self, key) -> bytes | None:
        """The value of KEY, or None if there is none yet, without waiting for it."""
        raw = self._raw(key)
        return None if raw is None else self._open(key, raw)

    def append(self, key, value) -> None:
        """Add a sealed piece to KEY. The store does not answer an append, so it costs no round
        trip; what this client sends later reaches the store after it."""
        self.inner.append(self._k(key), self._seal(key, value))

    def pieces(self, key, size: int) -> list[bytes]:
        """The values of the pieces appended to KEY (none if it is absent), each `size` bytes;
        AuthError if any was not written by this job."""
        raw = self._raw(key) or b""
        step = MAC_BYTES + size
        if len(raw) % step:
            self.refused += 1
            raise AuthError(f"store value of {key!r} is not a run of sealed pieces")
        return [self._open(key, raw[i:i + step]) for i in range(0, len(raw), step)]

    def _raw(self, key) -> bytes | None:
        raw = bytes(self.inner.compare_set(self._k(key), _ABSENT, _ABSENT))
        return None if raw == _ABSENT else raw

    def multi_get(self, keys) -> list[bytes]:
        return [self._open(k, v) for k, v in zip(keys, self.inner.multi_get([self._k(k) for k in keys]))]

    def add(self, key, amount) -> int:
        return self.inner.add(self._k(key), amount)

    def check(self, keys) -> bool:
        return self.inner.check([self._k(k) for k in keys])

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        ks = [self._k(k) for k in keys]
        self.inner.wait(ks) if timeout is None else self.inner.wait(ks, timeout)

    def delete_key(self, key) -> bool:
        return self.inner.delete_key(self._k(key))

    def num_keys(self) -> int:
        return self.inner.num_keys()
