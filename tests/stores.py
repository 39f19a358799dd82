"""The job's store for tests: a real server process (tm_slurm/store/server.py) and its clients."""
from __future__ import annotations

from tm_slurm.store import process as storeserver
from tm_slurm.store.client import StoreClient

KEY = b"t" * 32


class Served:
    def __init__(self, key: bytes = KEY):
        self.key = key
        self.spawned = storeserver.spawn(key, "127.0.0.1")
        self.port = self.spawned.port
        self._clients: list[StoreClient] = []

    def client(self, timeout: float = 10.0) -> StoreClient:
        c = StoreClient("127.0.0.1", self.port, self.key, timeout)
        self._clients.append(c)
        return c

    def close(self) -> None:
        for c in self._clients:
            c.close()
        self.spawned.close()
