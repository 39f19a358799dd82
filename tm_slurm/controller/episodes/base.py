"""What every membership change has in common: one protocol the controller's loop drives, and a
state machine whose transitions are checked and logged, as `roles.py` does for node roles."""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Mapping

from ...messages import Report
from ...roles import TransitionError

if TYPE_CHECKING:
    from ..port import Port

log = logging.getLogger("tm_slurm.controller")


@dataclass
class Failure:
    """A node was declared failed (fenced, FAILED, logged) by the controller."""
    node: str
    how: str
    info: dict                  # how it was detected, as `failure_detected` records it
    t: float                    # wall clock of the failure (injected) or of its detection
    # the (generation, step) the controller aborted for it; None when nothing was aborted:
    # the node held no rank and was in no plan, or the job is ending
    aborted: tuple[int, int] | None = None


class Episode:
    """One membership change from start to end. `State` is its enum, `TRANSITIONS` what may follow
    each state, `FINAL` the states in which the controller drops it."""
    State: ClassVar[type[enum.Enum]]
    TRANSITIONS: ClassVar[Mapping[enum.Enum, frozenset]]
    FINAL: ClassVar[frozenset]

    def __init__(self, port: "Port", state: enum.Enum):
        self.port = port
        self.state = state

    @property
    def done(self) -> bool:
        return self.state in self.FINAL

    def to(self, state: enum.Enum) -> None:
        if state not in self.TRANSITIONS[self.state]:
            raise TransitionError(f"{type(self).__name__}: {self.state.value} -> {state.value} is not allowed")
        log.debug("%s: %s -> %s", type(self).__name__, self.state.value, state.value,
                  extra={"job": self.port.job_id})
        self.state = state

    # ------------------------------------------------------------ the protocol
    def start(self) -> None:
        """Act on the decision that created it (roles, plans, messages)."""

    def on_report(self, node: str, rep: Report) -> None:
        pass

    def tick(self, now: float) -> None:
        pass

    def involves(self, node: str) -> bool:
        """A failure of `node` concerns the running job even though it holds no rank."""
        return False

    def on_node_failed(self, f: Failure) -> bool:
        """React to a failure; True: this episode takes charge of it (no new one is started)."""
        return False

    def finish(self, why: str) -> None:
        """The job is ending under it: record what was measured, if anything."""


def rounded(x, nd: int = 4):
    return None if x is None else round(float(x), nd)
