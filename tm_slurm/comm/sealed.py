"""The job's view of the TCPStore: every key under a prefix derived from the job secret, every value
sealed with an HMAC over (key, value) (security model: docs/design.md §9).

torch's TCPStore has no authentication, and in torch 2.13 any client can `list_keys()`, so a
stranger who reaches the port learns key names; the prefix only keeps the job apart from every
other key in the store. What protects the job is the seal: a value written without the secret
(a forged vote, switch decision or group rendezvous address) fails the check and is refused as if
it were absent. Counters (`add`) cannot be sealed; the vote does not trust them alone
(comm/vote.py). A Python `dist.Store`, so gloo/NCCL rendezvous through PrefixStore go through it.
"""
from __future__ import annotations

import hmac
from datetime import timedelta

import torch.distributed as dist

from ..control.auth import MAC_BYTES, AuthError, Keys, mac


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
