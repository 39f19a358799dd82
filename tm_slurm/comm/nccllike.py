"""`comm.backend: nccl-like`: gloo underneath, with NCCL's delivery of results and errors, so that
what the runtime relies on for NCCL is exercised on CPU (docs/design.md §11, "GPU semantics").

What NCCL does, and this group does too:
- a collective's future never carries its failure: it completes (successfully) without waiting
  for the network to succeed, and `wait()` never raises;
- a failure is visible only in the work's status (`is_completed()`, `exception()`), and later
  than the future's completion;
- a peer's death leaves the survivor's work pending, whatever the transport said, until the
  communicator is aborted (`abort`) or the work's own timeout passes (the watchdog's);
- after an abort, a new collective fails when it is enqueued.

What cannot be copied on a CPU: NCCL's future completes when the work is enqueued and the
consumer is ordered after it on the GPU's stream. Here there is no stream, so the future (and
`wait()`) completes when gloo's work has ended, whether it succeeded or failed: the host waits
where the stream would, and never longer than NCCL's host would at its next synchronisation.
Each group has one thread (its "stream") that waits for its works in the order they were issued.
"""
from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist

def outputs(args: tuple) -> list:
    """The tensors a collective writes (its future's value): its first argument (torchgroup.py's
    collectives too)."""
    if not args or not isinstance(args[0], (list, torch.Tensor)):
        return []                              # barrier
    return args[0] if isinstance(args[0], list) else [args[0]]


class Aborted(dist.DistBackendError):
    pass


class NcclLikeWork(dist.Work):
    def __init__(self, outs: list, timeout_s: float):
        super().__init__()
        self._outs = outs
        self._fut: torch.futures.Future = torch.futures.Future()
        self._deadline = time.monotonic() + timeout_s
        self._lock = threading.Lock()
        self._ended = False                     # gloo's work has ended (either way)
        self._ok = False                        # ... successfully
        self._error: BaseException | None = None  # what the status says: an abort, a timeout

    def _end(self, ok: bool) -> None:
        """Gloo's work has ended: its data is in place (or never will be). The future completes
        either way; only a success completes the work."""
        with self._lock:
            if self._ended:
                return
            self._ended, self._ok = True, ok
            done = self._fut.done()
        if not done:
            self._fut.set_result(self._outs)

    def _abort(self, why: str) -> None:
        with self._lock:
            if self._error is None and not self._ok:
                self._error = Aborted(f"NCCL communicator aborted: {why}")
            done = self._fut.done()
        if not done:
            try:
                self._fut.set_result(self._outs)
            except RuntimeError:                 # completed by gloo's end meanwhile
                pass

    def _status(self) -> tuple[bool, BaseException | None]:
        with self._lock:
            if self._ok:
                return True, None
            if self._error is None and time.monotonic() > self._deadline:
                # the watchdog's verdict on a work that never completed
                self._error = dist.DistBackendError("Watchdog caught collective operation timeout")
            return self._error is not None, self._error

    def is_completed(self) -> bool:
        return self._status()[0]

    def exception(self):
        return self._status()[1]

    def is_success(self) -> bool:
        done, err = self._status()
        return done and err is None

    def wait(self, timeout=None) -> bool:
        self._fut.wait()
        return True

    synchronize = wait

    def get_future(self) -> torch.futures.Future:
        return self._fut


class NcclLikeGroup:
    """A gloo `dist.ProcessGroup` (`pg`) whose collectives return `NcclLikeWork`s. It stands where
    a ProcessGroup is used: GroupTable.call and the transfers call its collectives by name."""

    def __init__(self, pg, timeout_s: float):
        self._pg, self._timeout_s = pg, timeout_s
        self._stream: queue.Queue = queue.Queue()
        self._works: set[NcclLikeWork] = set()   # issued and not yet ended or aborted
        self._lock = threading.Lock()
        self._aborted: str | None = None
        threading.Thread(target=self._run, name="tm-nccl-like", daemon=True).start()

    def rank(self) -> int:
        return self._pg.rank()

    def size(self) -> int:
        return self._pg.size()

    def __getattr__(self, op: str):
        base = getattr(self._pg, op)
        if not callable(base):
            return base

        def issue(*args, **kwargs):
            if self._aborted is not None:
                raise Aborted(f"NCCL communicator was aborted ({self._aborted}): {op} refused")
            work = NcclLikeWork(outputs(args), self._timeout_s)
            try:
                inner = base(*args, **kwargs)
            except Exception:
                # NCCL's enqueue does not see the peer: the work is pending until an abort
                inner = None
            with self._lock:
                self._works.add(work)
            self._stream.put((inner, work))
            return work
        return issue

    def _run(self) -> None:
        while True:
            inner, work = self._stream.get()
            ok = False
            if inner is not None:
                try:
                    inner.wait()      # once: a gloo work waited twice waits for a second completion
                    ok = True
                except Exception:
                    pass
            work._end(ok)
            if ok:            # a failed one stays pending, for the abort to end
                with self._lock:
                    self._works.discard(work)

    def abort(self, why: str = "aborted by the runtime") -> None:
        """ncclCommAbort: every pending work ends with an error, and no new one starts."""
        with self._lock:
            self._aborted = self._aborted or why
            works = list(self._works)
        for w in works:
            w._abort(why)
