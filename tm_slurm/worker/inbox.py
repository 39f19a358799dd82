"""The worker's link to its agent: a reader thread sorting the agent's messages into queues, and
a heartbeat thread reporting progress. A closed link means the agent (so the node's control) is
gone, and the worker exits at once."""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Callable

import torch

from ..comm.groups import bind_device
from ..control.wire import Wire
from ..exits import Exit
from ..messages import (AbortComms, Beat, CancelPlan, Checkpoint, Prepare, Recover, Report, Resume, Stop,
                        WriteCheckpoint)



class Inbox:
    def __init__(self, wire: Wire, node: str, on_prepare: Callable[[Prepare], None],
                 on_abort: Callable[[AbortComms], None]):
        self.wire, self.node = wire, node
        self.on_prepare, self.on_abort = on_prepare, on_abort
        self.plans: dict = {}
        self.cancelled: set[int] = set()
        self.assignments: queue.Queue = queue.Queue()   # for a standby: plans naming its node
        self.recoveries: queue.Queue = queue.Queue()    # for an active rank after an abort
        self.stop_reason: str | None = None
        self.lost_controller: str | None = None
        self.on_lost: Callable[[], None] = lambda: None     # the training loop's (lost.Watch)
        self.promoted = False
        self._progress: list = []
        self._plock = threading.Lock()

    def start(self, hb_interval: float, status: Callable[[], tuple], device: torch.device,
              watch: Callable[[], None]) -> None:
        """`watch`: called after each beat (the collectives watchdog: Worker.watch)."""
        self._status, self._watch = status, watch
        threading.Thread(target=self._read, args=(device,), name="tm-inbox", daemon=True).start()
        threading.Thread(target=self._beat, args=(hb_interval,), name="tm-heartbeat", daemon=True).start()

    def send(self, report: Report) -> None:
        if self._progress and not isinstance(report, Beat):
            # the steps committed since the last beat go first: a report can be the last word
            # before the process leaves (a swap, a checkpoint and exit), and they would be lost
            self.beat()
        if not self.wire.send(report):
            os._exit(Exit.AGENT_GONE)

    def progress(self, entry: tuple) -> None:
        with self._plock:
            self._progress.append(entry)

    def _both(self, msg) -> None:
        self.assignments.put(msg)
        self.recoveries.put(msg)

    def _read(self, device: torch.device) -> None:
        bind_device(device)      # the lost-controller checkpoint is written from here (lost.Watch)
        while True:
            try:
                msg = self.wire.recv()
            except (EOFError, OSError):
                os._exit(Exit.AGENT_GONE)
            if isinstance(msg, (Prepare, Recover)):
                self.plans[msg.plan.id] = msg.plan
                joiner = self.node in msg.plan.joiners and not self.promoted
                if isinstance(msg, Prepare) and not joiner:
                    self.on_prepare(msg)
                else:
                    (self.assignments if joiner else self.recoveries).put(msg)
            elif isinstance(msg, AbortComms):
                self.on_abort(msg)
            elif isinstance(msg, CancelPlan):
                self.cancelled.add(msg.plan_id)
                self._both(msg)
            elif isinstance(msg, Resume):
                self._both(msg)
            elif isinstance(msg, WriteCheckpoint):
                self.recoveries.put(msg)
            elif isinstance(msg, Checkpoint):
                self.lost_controller = msg.reason
                self._both(msg)
                self.on_lost()
            elif isinstance(msg, Stop):
                self.stop_reason = msg.reason
                self._both(msg)

    def _beat(self, interval: float) -> None:
        while True:
            time.sleep(interval)
            self.beat()
            self._watch()

    def beat(self) -> None:
        with self._plock:
            prog, self._progress = self._progress, []
        gen, rank, step, committed = self._status()
        self.send(Beat(gen, rank, step, committed=committed, progress=prog))
