"""Ending a job: optionally wait for the workers to finish what they were told (a checkpoint and
exit), tell every agent to shut down, give them a moment, then settle the final state.

waiting:  the workers write their checkpoint and exit (wait_workers), at most 3 x shutdown_s.
shutdown: Shutdown sent; the agents go, or shutdown_s + 2 s pass.
done:     the job's final state and exit code are set.
"""
from __future__ import annotations

import enum

from ...messages import Shutdown
from ...roles import JobState, Role
from .base import Episode


class State(str, enum.Enum):
    WAITING = "waiting"
    SHUTDOWN = "shutdown"
    DONE = "done"


S = State
TRANSITIONS = {S.WAITING: frozenset({S.SHUTDOWN}), S.SHUTDOWN: frozenset({S.DONE}), S.DONE: frozenset()}


class Ending(Episode):
    # never dropped: once done, the controller's loop ends with it
    State, TRANSITIONS, FINAL = State, TRANSITIONS, frozenset()

    def __init__(self, port, why: str, final: JobState, code: int, wait_workers: bool):
        super().__init__(port, S.WAITING)
        self.why, self.final, self.code, self.wait_workers = why, final, code, wait_workers
        self.t = port.now()
        self.t_shutdown: float | None = None
        self.checkpoint_error: tuple[int, str] | None = None   # the exit checkpoint's first failure

    def checkpoint_failed(self, step: int, error: str) -> None:
        if self.checkpoint_error is None:
            self.checkpoint_error = (step, error)

    def start(self) -> None:
        self.port.job.set(JobState.STOPPING, why=self.why)

    def tick(self, now: float) -> None:
        p = self.port
        if self.state == S.WAITING:
            if self.wait_workers and self._busy() and now - self.t < p.T.shutdown_s * 3:
                return
            self.t_shutdown = now
            self.to(S.SHUTDOWN)
            p.broadcast(Shutdown(self.why))
        if p.agents_alive() and now - self.t_shutdown < p.T.shutdown_s + 2:
            return
        why = self.why
        if self.checkpoint_error is not None and self.final == JobState.REQUEUED:
            # still requeue-able: the newest valid checkpoint stays, only the steps since are lost
            step, error = self.checkpoint_error
            last = p.latest_checkpoint()
            since = f"step {last[0]} ({last[1]})" if last else "the start (no valid checkpoint)"
            p.log.emit("exit_checkpoint_failed", step=step, error=error, resume_from=last and last[1])
            why = f"{why}; the checkpoint of step {step} could not be written ({error}): the next run resumes from {since}"
        p.job.set(self.final, why=why)
        p.set_exit_code(self.code)
        self.to(S.DONE)

    def _busy(self) -> bool:
        """Some live active worker has not exited yet."""
        p = self.port
        alive = set(p.agents_alive())
        for r, n in p.holders.ranks.items():
            node = p.nodes.nodes[n]
            if node.role == Role.ACTIVE and n in alive:
                if not p.has_exited(n, p.topo.slot_ranks(node.slot).index(r)):
                    return True
        return False
