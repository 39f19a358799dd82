"""The controller is gone (its batch host died): the survivors write a consistent checkpoint of
the last committed step without it, through the shared job directory.

Why this is consistent: a step commits only once every rank has voted on it, so when the store
vanishes every live rank has committed either the last committed step K or K-1, and a rank at
K-1 is the one blocked in K's vote, still holding K's gradients. Each rank publishes
(committed, pending); whoever is one behind applies K's update; then one live replica per shard
writes the state at the start of K+1. A rank that cannot catch up writes nothing.
"""
from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

from .. import checkpoints, jobdir
from ..comm.groups import bind_device
from ..events import fsync_write
from ..exits import Exit
from ..messages import Checkpoint, LostState
from . import checkpoint as ckpt
from .rank import error_text, exit_clean



class Watch:
    """Who writes this rank's part when the controller is lost: the training thread, which sees
    it first when a store call of its vote fails or when the agent said so between two votes; or
    the inbox's thread in its place, when the agent says so while the training thread is blocked
    in a vote on a store whose host is gone (a call there can last the store's whole timeout).
    The vote runs on the training thread itself: a thread of its own cost two hand-offs a step
    (~0.12 ms here)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.voting: int | None = None      # the step whose vote the training thread is in
        self._taken = False

    def enter(self, w, step: int) -> None:
        """Before the vote of `step`."""
        with self._lock:
            if not self._taken and w.inbox.lost_controller is None:
                self.voting = step
                return
            mine, self._taken = not self._taken, True
        if mine:
            controller_lost(w, pending=step, error=None)
        _park()

    def leave(self, w, step: int, error: BaseException | None = None) -> None:
        """After it (`error`: a store call failed: the controller is gone)."""
        with self._lock:
            self.voting = None
            mine = not self._taken
            if mine and error is None:
                return
            self._taken = True
        if mine:
            controller_lost(w, pending=step, error=error)
        _park()

    def take_over(self, w) -> None:
        """The inbox's thread, when the agent says the controller is lost."""
        with self._lock:
            if self.voting is None or self._taken:
                return
            self._taken, step = True, self.voting
        threading.Thread(target=_bound, args=(w, step), name="tm-lost", daemon=True).start()


def _bound(w, step: int) -> None:
    bind_device(w.device)
    controller_lost(w, step, None)


def _park() -> None:
    """The other thread writes this rank's part and ends the process."""
    threading.Event().wait()


def controller_lost(w, pending: int | None, error) -> None:
    """Never returns: the process exits once its part is written."""
    if w.inbox.lost_controller is None:
        # the store failing is the first sign; the agent confirms (heartbeat silence, and a
        # status.json no longer touched: agent.controller_alive) or not
        deadline = time.monotonic() + w.T.controller_timeout_s + 4 * jobdir.STATUS_EVERY_S + 5
        msg = None
        while not isinstance(msg, Checkpoint) and time.monotonic() < deadline:
            try:
                msg = w.inbox.recoveries.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
        if not isinstance(msg, Checkpoint):
            w.report("store_lost", pending, error=str(error)[:300])
            exit_clean(Exit.GAVE_UP)
    d = jobdir.lost_dir(w.job_dir)
    me = LostState(w.rank, w.node, w.committed, pending, checkpoints.shard_name(w.topo, w.rank))
    fsync_write(d / f"rank{w.rank}.json", w.transfer_sealer().seal(me))
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and len(list(d.glob("rank*.json"))) < w.topo.world:
        time.sleep(0.05)
    time.sleep(0.5)                      # the last survivors' files, if they are slower
    peers = _peers(w, d)
    k = max((p.committed for p in peers if p.committed is not None), default=None)
    if k is None:
        exit_clean(Exit.REQUEUE)
    if w.committed == k - 1 and pending == k:
        w.apply(k)                       # K committed (someone saw it): catch up
    elif pending is not None and w.rollback is not None:
        w.rollback.restore()             # the step in its vote did not commit: its buffers go
    if w.committed != k:
        exit_clean(Exit.REQUEUE)
    able = sorted(p.rank for p in peers if p.shard == me.shard and
                  (p.committed == k or (p.committed == k - 1 and p.pending == k)))
    if able and able[0] == w.rank:
        try:
            ckpt.save(checkpoints.root(w.cfg, w.job_dir), k + 1, w.rank, w.topo, w.state, writer=True)
        except Exception as e:
            # a full disk: the next run resumes from an older checkpoint; raised, this would end
            # only the thread that writes, and the other one stays parked for good
            w.report("checkpoint", k + 1, reason="controller lost", path=None, save_s=0.0, error=error_text(e))
            exit_clean(Exit.REQUEUE)
    fsync_write(d / f"rank{w.rank}.done", b"")
    exit_clean(Exit.REQUEUE)


def _peers(w, d: Path) -> list[LostState]:
    """The survivors' notes; one that is unreadable or not sealed by this job counts as absent."""
    out = []
    for p in d.glob("rank*.json"):
        try:
            m = w.transfer_sealer().open(p.read_bytes()[:65536])
        except (OSError, ValueError):
            continue
        if isinstance(m, LostState):
            out.append(m)
    return out
