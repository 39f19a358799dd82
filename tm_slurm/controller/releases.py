"""Giving nodes back to Slurm (`launcher.release`: `scontrol update JobId=J NodeList=<rest>`).

An evacuated node goes back so that its drain completes; a failed one so that the job never
waits for it again. Slurm holds a job COMPLETING until every node of it has answered, so a
crashed node the job still held kept the ending job in the queue until slurmctld declared the
node DOWN (SlurmdTimeout, ~16 s on the mini cluster) or, if the node came back first, until
slurmctld resent its terminate (73 s measured); released, the job left the queue 1.3 s after
its `scancel`. A released node's steps are killed by Slurm too, the strongest fence there is.

The calls run on one thread of their own, one at a time (each computes the node list from the
last), never on the main loop: a recovery does not wait for slurmctld, which may take seconds (a
job resized before, on Slurm 21.08-24.05 without slurmdbd: slurmctld retries for 5 s and refuses,
"the DB index is being set"; the launcher knows it from the config and does not ask). `close`
gives what is still pending `timeouts.fence_grace_s` before the job ends: the release is the
Slurm side of the fence."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor


class Releases:
    def __init__(self, launcher, emit, enabled: bool):
        """`emit`: the event log's; `enabled`: `slurm.release_nodes` (false: every node is kept)."""
        self.launcher, self.emit, self.enabled = launcher, emit, enabled
        self._pending: list[tuple[str, str, Future]] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tm-slurm-release")

    def submit(self, node: str, why: str) -> None:
        if not self.enabled:
            self.emit("node_released", node=node, why=why, result="kept: slurm.release_nodes is false",
                      release_s=0.0)
            return
        self._pending.append((node, why, self._pool.submit(self._release, node)))

    def _release(self, node: str) -> tuple[str, float]:
        t0 = time.monotonic()
        try:
            result = self.launcher.release(node)
        except Exception as e:            # SlurmError: the node stays in the job, training goes on
            result = f"not released: {e}"
        return result, time.monotonic() - t0

    def poll(self) -> None:
        """Log the releases that ended."""
        while self._pending and self._pending[0][2].done():
            node, why, fut = self._pending.pop(0)
            result, took = fut.result()
            self.emit("node_released", node=node, why=why, result=result, release_s=round(took, 4))

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self, timeout: float) -> None:
        """Wait up to `timeout` for the pending releases, log them, and stop the thread."""
        end = time.monotonic() + timeout
        for _, _, fut in self._pending:
            try:
                fut.result(max(0.0, end - time.monotonic()))
            except Exception:              # TimeoutError: logged as not released below
                pass
        self.poll()
        for node, why, _ in self._pending:
            self.emit("node_released", node=node, why=why,
                      result=f"not released: slurmctld did not answer within {timeout:.0f} s",
                      release_s=round(timeout, 4))
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
