"""The one state machine for nodes and for the job. Every change goes through `NodeTable.set_role`
or `JobStatus.set`, which check the transition and log it once to the event log."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Mapping

from .events import EventLog


class Role(str, enum.Enum):
    ACTIVE = "ACTIVE"
    STANDBY = "STANDBY"
    LEAVING = "LEAVING"
    JOINING = "JOINING"
    FAILED = "FAILED"
    RELEASED = "RELEASED"


class JobState(str, enum.Enum):
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    SWAPPING = "SWAPPING"
    RECOVERING = "RECOVERING"
    STOPPING = "STOPPING"
    FINISHED = "FINISHED"
    REQUEUED = "REQUEUED"
    FAILED = "FAILED"


NODE_TRANSITIONS: Mapping[Role, frozenset[Role]] = {
    Role.ACTIVE: frozenset({Role.LEAVING, Role.FAILED, Role.RELEASED, Role.STANDBY}),  # STANDBY: shrunk away
    Role.LEAVING: frozenset({Role.RELEASED, Role.FAILED, Role.ACTIVE}),   # ACTIVE: swap cancelled
    Role.STANDBY: frozenset({Role.JOINING, Role.FAILED, Role.RELEASED}),
    Role.JOINING: frozenset({Role.ACTIVE, Role.FAILED, Role.STANDBY}),    # STANDBY: swap cancelled
    Role.FAILED: frozenset({Role.RELEASED}),
    Role.RELEASED: frozenset(),
}

JOB_TRANSITIONS: Mapping[JobState, frozenset[JobState]] = {
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.STOPPING, JobState.FAILED}),
    JobState.RUNNING: frozenset({JobState.SWAPPING, JobState.RECOVERING, JobState.STOPPING}),
    JobState.SWAPPING: frozenset({JobState.RUNNING, JobState.RECOVERING, JobState.STOPPING}),
    JobState.RECOVERING: frozenset({JobState.RUNNING, JobState.RECOVERING, JobState.STOPPING,
                                    JobState.FAILED}),
    JobState.STOPPING: frozenset({JobState.FINISHED, JobState.REQUEUED, JobState.FAILED}),
    JobState.FINISHED: frozenset(),
    JobState.REQUEUED: frozenset(),
    JobState.FAILED: frozenset(),
}


class TransitionError(RuntimeError):
    pass


@dataclass(frozen=True)
class Node:
    name: str
    role: Role
    slot: int | None = None        # which active slot it holds (ACTIVE/LEAVING/JOINING)
    ready: bool = False            # admitted and its workers are up (standby: warmed)
    host: str = ""


@dataclass
class NodeTable:
    log: EventLog
    nodes: dict[str, Node] = field(default_factory=dict)

    def add(self, name: str, role: Role, slot: int | None = None) -> Node:
        if name in self.nodes:
            raise TransitionError(f"node {name} added twice")
        n = self.nodes[name] = Node(name, role, slot)
        self.log.emit("node_role", node=name, role=role.value, prev=None, slot=slot)
        return n

    def set_role(self, name: str, role: Role, *, reason: str = "", slot: int | None = None,
                 **details) -> Node:
        n = self.nodes[name]
        if role not in NODE_TRANSITIONS[n.role]:
            raise TransitionError(f"node {name}: {n.role.value} -> {role.value} is not allowed")
        keep_slot = role in (Role.ACTIVE, Role.LEAVING, Role.JOINING)
        new = replace(n, role=role, slot=(slot if slot is not None else n.slot) if keep_slot else None,
                      ready=n.ready and role not in (Role.FAILED, Role.RELEASED))
        self.nodes[name] = new
        self.log.emit("node_role", node=name, role=role.value, prev=n.role.value, slot=new.slot,
                      reason=reason, **details)
        return new

    def set_slot(self, name: str, slot: int, *, reason: str) -> Node:
        """An ACTIVE node keeps its processes' place but its ranks are renumbered (a shrink)."""
        n = self.nodes[name]
        if n.role != Role.ACTIVE:
            raise TransitionError(f"node {name}: only an ACTIVE node changes slot, not {n.role.value}")
        if n.slot != slot:
            self.nodes[name] = replace(n, slot=slot)
            self.log.emit("node_slot", node=name, role=n.role.value, prev=n.slot, slot=slot, reason=reason)
        return self.nodes[name]

    def set_ready(self, name: str, ready: bool = True, **details) -> Node:
        n = self.nodes[name]
        if n.ready != ready:
            self.nodes[name] = replace(n, ready=ready)
            self.log.emit("node_ready" if ready else "node_unready", node=name, role=n.role.value,
                          **details)
        return self.nodes[name]

    def set_host(self, name: str, host: str) -> None:
        self.nodes[name] = replace(self.nodes[name], host=host)

    def with_role(self, *roles: Role) -> list[Node]:
        return sorted((n for n in self.nodes.values() if n.role in roles), key=lambda n: n.name)

    def slot_holder(self, slot: int) -> Node | None:
        for n in self.nodes.values():
            if n.slot == slot and n.role in (Role.ACTIVE, Role.LEAVING):
                return n
        return None


@dataclass
class JobStatus:
    log: EventLog
    state: JobState = JobState.STARTING

    def set(self, state: JobState, **details) -> None:
        if state not in JOB_TRANSITIONS[self.state]:
            raise TransitionError(f"job: {self.state.value} -> {state.value} is not allowed")
        prev, self.state = self.state, state
        self.log.emit("job_state", state=state.value, prev=prev.value, **details)
