"""Ending a job: optionally wait for the workers to finish what they were told (a checkpoint and
exit), tell every agent to shut down, give them a moment, then settle the final state."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..messages import Shutdown
from ..roles import JobState, Role

if TYPE_CHECKING:
    from .core import Controller


@dataclass
class Ending:
    why: str
    final: JobState
    code: int
    wait_workers: bool
    t: float
    t_shutdown: float | None = None

    def drive(self, ctl: "Controller", now: float) -> None:
        if self.t_shutdown is None:
            if self.wait_workers and self._busy(ctl) and now - self.t < ctl.T.shutdown_s * 3:
                return
            self.t_shutdown = now
            ctl.broadcast(Shutdown(self.why))
        alive = [n for n in ctl.channels if n not in ctl._agents_gone]
        if alive and now - self.t_shutdown < ctl.T.shutdown_s + 2:
            return
        ctl.job.set(self.final, why=self.why)
        ctl.exit_code = self.code

    @staticmethod
    def _busy(ctl: "Controller") -> bool:
        """Some live active worker has not exited yet."""
        for r, n in ctl.holder.items():
            node = ctl.nodes.nodes[n]
            if node.role == Role.ACTIVE and n not in ctl._agents_gone:
                if (n, ctl.topo.slot_ranks(node.slot).index(r)) not in ctl.exited:
                    return True
        return False
