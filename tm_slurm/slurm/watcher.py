"""Watching Slurm for the job's nodes (docs/design.md §6): one batched node query per interval and
a reservation query every `slurm.reservation_poll_s`, on a thread of its own (Slurm's CLIs take
tens of milliseconds; the controller's loop must not wait for them), classified into planned and
unplanned node events. The interval backs off while nothing changes: each query costs slurmctld
a pass over every node of the cluster, whatever the filter (22.05)."""
from __future__ import annotations

import queue
import threading
import time

from . import SlurmError, backend_for
from .classify import CLEARED, EventDebouncer, NodeEvent, classify


def next_interval(current: float, changed: bool, base: float, most: float) -> float:
    """After a poll: back to `base` when something changed, else twice as long, up to `most`."""
    return base if changed else min(most, current * 2)


class Watcher:
    def __init__(self, cfg, job_id: str, backend=None, clock=time.time, mono=time.monotonic):
        self.cfg, self.job_id = cfg, job_id
        self.backend = backend or backend_for(cfg.slurm.backend)
        self.clock, self.mono = clock, mono
        self.changed = False                   # the last check saw a node's state change
        self._states: dict = {}
        self._res: list = []
        self._res_at: float | None = None
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
        self._thread.join(self.cfg.slurm.poll_ceiling_s() + 15)

    def check(self, names) -> list[NodeEvent]:
        """One poll: the events for `names` that were not reported before, and a CLEARED event
        for a node whose reported state is gone (resumed): its next drain is news again."""
        states = self.backend.nodes(names)
        t = self.mono()
        if self._res_at is None or t - self._res_at >= self.cfg.slurm.reservation_poll_s:
            self._res, self._res_at = self.backend.reservations(), t
        self.changed, self._states = states != self._states, states
        now = self.clock()
        raw = classify(states, self._res, names, now, self.cfg.slurm.maint_horizon_s)
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
        sl = self.cfg.slurm
        interval = sl.poll_interval_s
        while not self._stop.wait(interval):
            names = self.nodes
            if not names:
                continue
            t0 = time.monotonic()
            changed = False                # an error backs off too: slurmctld may be overloaded
            try:
                for e in self.check(names):
                    self.events.put((e, self.clock(), time.monotonic() - t0))
                changed = self.changed
            except SlurmError as e:
                self.errors.put(("slurm_query_failed", str(e)))
            except Exception as e:         # Slurm's output it did not expect: say so, poll on
                self.errors.put(("watcher_error", f"{type(e).__name__}: {e}"))
            interval = next_interval(interval, changed, sl.poll_interval_s, sl.poll_ceiling_s())

    def poll(self, nodes) -> tuple[list, list[str]]:
        """From the controller's loop: tell the thread which nodes to watch, take its results."""
        self.nodes = tuple(nodes)
        evs, errs = [], []
        while not self.events.empty():
            evs.append(self.events.get_nowait())
        while not self.errors.empty():
            errs.append(self.errors.get_nowait())
        return evs, errs
