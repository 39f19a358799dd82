"""Watching Slurm for the job's nodes (docs/design.md §6): one batched node query and one reservation
query per interval, on a thread of its own (Slurm's CLIs take tens of milliseconds; the
controller's loop must not wait for them), classified into planned and unplanned node events."""
from __future__ import annotations

import queue
import threading
import time

from . import SlurmError, backend_for
from .classify import CLEARED, EventDebouncer, NodeEvent, classify


class Watcher:
    def __init__(self, cfg, job_id: str, backend=None, clock=time.time):
        self.cfg, self.job_id = cfg, job_id
        self.backend = backend or backend_for(cfg.slurm.backend)
        self.clock = clock
        self.nodes: tuple[str, ...] = ()       # set by the controller: the nodes it still holds
        self.events: queue.Queue = queue.Queue()
        self.errors: queue.Queue = queue.Queue()
        self._debounce = EventDebouncer()
        self._acted: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tm-slurm-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.cfg.slurm.poll_interval_s + 15)

    def check(self, names) -> list[NodeEvent]:
        """One poll: the events for `names` that were not reported before, and a CLEARED event
        for a node whose reported state is gone (resumed): its next drain is news again."""
        states = self.backend.nodes(names)
        res = self.backend.reservations()
        now = self.clock()
        raw = classify(states, res, names, now, self.cfg.slurm.maint_horizon_s)
        evs = self._debounce.filter(raw, now)
        current = {e.node for e in raw}
        cleared = [NodeEvent(n, CLEARED, "resume", "", None) for n in sorted(self._acted) if n not in current]
        for e in cleared:
            del self._acted[e.node]
        new = [e for e in evs if self._acted.get(e.node) != e.kind]
        for e in new:
            self._acted[e.node] = e.kind
        return cleared + new

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.slurm.poll_interval_s):
            names = self.nodes
            if not names:
                continue
            t0 = time.monotonic()
            try:
                for e in self.check(names):
                    self.events.put((e, self.clock(), time.monotonic() - t0))
            except SlurmError as e:
                self.errors.put(("slurm_query_failed", str(e)))
            except Exception as e:         # Slurm's output it did not expect: say so, poll on
                self.errors.put(("watcher_error", f"{type(e).__name__}: {e}"))

    def poll(self, nodes) -> tuple[list, list[str]]:
        """From the controller's loop: tell the thread which nodes to watch, take its results."""
        self.nodes = tuple(nodes)
        evs, errs = [], []
        while not self.events.empty():
            evs.append(self.events.get_nowait())
        while not self.errors.empty():
            errs.append(self.errors.get_nowait())
        return evs, errs
