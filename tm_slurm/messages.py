"""Messages between controller, agents and workers, and the plans they carry.

All frozen dataclasses of plain fields, encoded by control/codec.py (JSON; only these types are
ever built from the wire) and sealed by control/auth.py (MPI between controller and agents, a
socketpair between an agent and its workers). Every message that can act on state carries the generation it
was made for; receivers drop messages of an older generation (fencing).
No torch here: agents never import it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


# ---------------------------------------------------------------- plans

@dataclass(frozen=True)
class GroupBuild:
    """Build group `id` over `members` (global ranks, in group-rank order) under store `prefix`."""
    id: str
    members: tuple[int, ...]
    prefix: str


@dataclass(frozen=True)
class Transfer:
    """Joiner's copy of `rank` gets its state from the worker holding `src_rank` (the leaver itself
    in a planned swap, a DP replica after a failure) over a two-member link under `prefix`."""
    rank: int
    src_rank: int
    prefix: str


@dataclass(frozen=True)
class Move:
    slot: int
    leaver: str          # node giving up the slot (planned) or the failed node
    joiner: str          # standby taking it


@dataclass(frozen=True)
class SwapPlan:
    id: int
    kind: str                         # "planned" | "unplanned"
    gen_from: int
    gen_to: int
    moves: tuple[Move, ...]
    ranks: tuple[int, ...]            # global ranks that change hands
    builds: tuple[GroupBuild, ...]    # groups rebuilt; every other group is kept as is
    kept: tuple[str, ...]             # ids of the groups kept
    transfers: tuple[Transfer, ...]
    resume_step: int | None = None    # unplanned: every rank restarts this step
    checkpoint: str | None = None     # unplanned without a replica: every rank loads this
    reason: str = ""

    @property
    def joiners(self) -> tuple[str, ...]:
        return tuple(m.joiner for m in self.moves)

    @property
    def leavers(self) -> tuple[str, ...]:
        return tuple(m.leaver for m in self.moves)


# ---------------------------------------------------------------- controller -> agent

@dataclass(frozen=True)
class Launch:
    """Start this node's workers. Active nodes get `ranks`; standbys get none and park."""
    job: str
    gen: int
    role: str                         # ACTIVE | STANDBY
    slot: int | None
    ranks: tuple[int, ...]
    local_ranks: int                  # worker processes per node
    command: tuple[str, ...]
    cwd: str
    env: tuple[tuple[str, str], ...]
    config: dict
    store: tuple[str, int]            # TCPStore host, port
    groups: tuple[GroupBuild, ...]    # the current instance of every group of the job
    start_step: int = 0
    checkpoint: str | None = None     # resume every rank from this (requeued job)


@dataclass(frozen=True)
class ToWorkers:
    """Forward `payload` to this node's workers (all of them)."""
    payload: Any


@dataclass(frozen=True)
class Fence:
    """Kill this node's workers now (SIGKILL): a suspect must not come back."""
    gen: int
    reason: str


@dataclass(frozen=True)
class Shutdown:
    reason: str
    graceful: bool = True


@dataclass(frozen=True)
class Ping:
    seq: int
    t: float


@dataclass(frozen=True)
class Challenge:
    """First frame on a newly accepted link: the agent's Hello must carry `nonce` back."""
    nonce: str


# ---------------------------------------------------------------- agent -> controller

@dataclass(frozen=True)
class Hello:
    node: str
    host: str
    pid: int
    pgid: int
    step: str | None = None        # the agent's Slurm step id (fencing through slurmctld)
    job: str | None = None         # its Slurm job (another one: a companion standby job)
    nonce: str = ""                # the link's Challenge, answered


@dataclass(frozen=True)
class Announce:
    """An agent's sealed note in control/join/: a Connect is coming, so the controller Accepts."""
    node: str
    pid: int


@dataclass(frozen=True)
class WorkerInfo:
    local: int
    pid: int
    rank: int | None
    step: int | None          # step being worked on
    committed: int | None     # last committed step
    alive: bool
    silent_s: float
    progress: tuple = ()      # (step, duration_s, loss, wall time) committed since the last beat


@dataclass(frozen=True)
class Heartbeat:
    node: str
    seq: int
    t: float
    workers: tuple[WorkerInfo, ...]


@dataclass(frozen=True)
class WorkerReport:
    node: str
    local: int
    report: "Report"


@dataclass(frozen=True)
class WorkerExited:
    node: str
    local: int
    pid: int
    rc: int
    rank: int | None


@dataclass(frozen=True)
class WorkerSuspect:
    node: str
    local: int
    pid: int
    rank: int | None
    silent_s: float


@dataclass(frozen=True)
class Signalled:
    """Slurm signalled this node's step (SIGTERM: a time limit, or scancel; SIGKILL follows after
    KillWait): the controller, which may run where no signal comes, checkpoints and ends."""
    node: str
    signal: str


@dataclass(frozen=True)
class AgentBye:
    node: str
    reason: str


# ---------------------------------------------------------------- worker <-> agent

@dataclass(frozen=True)
class Report:
    """Anything a worker tells the controller: kind + step + free-form data (JSON-able)."""
    kind: str
    gen: int
    rank: int | None
    step: int | None = None
    data: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Assign:
    """Agent -> worker: your ranks, groups and where to find the store (first message)."""
    launch: Launch
    node: str
    local: int


@dataclass(frozen=True)
class Prepare:
    """Phase 1 of a planned swap: build what `plan` needs in the background. A joiner's local
    worker i takes rank i of its move's slot."""
    plan: SwapPlan


@dataclass(frozen=True)
class CancelPlan:
    """A planned swap will not happen (a member failed during phase 1): drop what was built."""
    plan_id: int
    reason: str


@dataclass(frozen=True)
class Recover:
    plan: SwapPlan


@dataclass(frozen=True)
class Resume:
    """Recovery: every member has built its part of the plan; move state and continue."""
    plan_id: int
    gen_to: int


@dataclass(frozen=True)
class Checkpoint:
    """Agent -> workers when the controller is gone: write what you hold and exit."""
    reason: str


@dataclass(frozen=True)
class WriteCheckpoint:
    """Controller -> aborted ranks (no standby left, no recovery possible): the `writers` save their
    shard of the last committed state (the start of `step`), then every rank exits."""
    gen: int
    step: int
    writers: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class Stop:
    reason: str


@dataclass(frozen=True)
class StateManifest:
    """What precedes a rank's raw tensors on a transfer link (worker/state.py): their names, shapes
    and dtypes in canonical order, and the optimizer's, scheduler's and user's plain values."""
    step: int
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]
    param_groups: tuple[dict, ...] = ()
    opt_scalars: dict = field(default_factory=dict)     # param index -> {name: plain value}
    scheduler: dict | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class LostState:
    """A surviving rank's sealed note in control/lost/ when the controller is gone (worker/lost.py)."""
    rank: int
    node: str
    committed: int | None
    pending: int | None
    shard: str
