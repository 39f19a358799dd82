"""Messages between controller, agents and workers, and the plans they carry.

All frozen dataclasses of plain fields, encoded by control/codec.py (JSON; only these types are
ever built from the wire) and sealed by control/auth.py (MPI between controller and agents, a
socketpair between an agent and its workers). Every message that can act on state carries the generation it
was made for; receivers drop messages of an older generation (fencing).
No torch here: agents never import it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar


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
    builds: tuple[GroupBuild, ...]    # groups rebuilt; every other group is kept as is (a delta:
                                      # at 1,024 x 8 ranks the kept ones are ~7,000)
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
    store: tuple[str, int]            # the job's store (store/): host, port
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


# the flat columns of a Heartbeat, values per row
MOVE_FIELDS = 3               # local, step, committed
RECORD_FIELDS = 8             # rank, then controller/progress.StepRecord's 7 fields


@dataclass(frozen=True)
class Heartbeat:
    """What changed on a node since its previous beat (agent.heartbeat). `workers`: those whose
    process, rank or liveness changed, every worker when `full`; `moves`: (local, step,
    committed) of the others whose step moved; `records`: (rank, *StepRecord) of every step
    committed since. The last two are flat tuples of plain numbers, MOVE_FIELDS and
    RECORD_FIELDS a row: at 1,024 nodes x 8 a controller opens 1,024 beats with a step's
    records every step, and a message per worker and per record was most of its CPU."""
    node: str
    seq: int
    t: float
    workers: tuple[WorkerInfo, ...]
    full: bool = True
    moves: tuple = ()
    records: tuple = ()


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
class Output:
    """Complete lines a streamed rank printed (output.py), for the controller's stdout; `dropped`:
    bytes of that worker's output not forwarded since its last Output (over the agent's rate)."""
    node: str
    local: int
    rank: int
    lines: tuple[str, ...]
    dropped: int = 0


@dataclass(frozen=True)
class AgentBye:
    node: str
    reason: str


# ---------------------------------------------------------------- worker <-> agent

@dataclass(frozen=True)
class Assign:
    """Agent -> worker: your ranks, groups and where to find the store (first message)."""
    launch: Launch
    node: str
    local: int
    spawn: str = ""                   # this set of the node's workers (a restart makes a new one)


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
class AbortComms:
    """Controller -> every worker, when a node holding `ranks` is declared failed: abort each
    group with one of them now (the training thread may be blocked in one: on NCCL a dead
    peer's collective never ends by itself)."""
    gen: int
    ranks: tuple[int, ...]
    why: str


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
    registered: dict = field(default_factory=dict)      # job.register(name, obj): its state_dict()


@dataclass(frozen=True)
class CheckpointIndex:
    """A checkpoint shard's index, written after its data (worker/checkpoint.py): the layout it was
    written in, where each tensor's piece lies in the data files (DCP's metadata, as plain values:
    name -> [global size, dtype, [[offsets, sizes, file, byte offset, length], ...]]), the
    non-tensor state, and each data file's sha256."""
    step: int
    key: str
    keys: tuple[str, ...]              # every shard of this checkpoint
    tensors: dict
    state: StateManifest
    files: dict                        # file name -> sha256


@dataclass(frozen=True)
class LostState:
    """A surviving rank's sealed note in control/lost/ when the controller is gone (worker/lost.py)."""
    rank: int
    node: str
    committed: int | None
    pending: int | None
    shard: str


# ---------------------------------------------------------------- worker -> controller: reports
# One class per kind. `KIND` names the kind in the event log (`rank_<kind>`, `worker_<kind>`).
# A field defaulting to None is an optional part: left out of `data()` when absent, as the
# worker leaves it out when it has nothing to say (a joiner loading a checkpoint moved no state).

@dataclass(frozen=True)
class Report:
    gen: int
    rank: int | None
    step: int | None

    KIND: ClassVar[str] = ""

    def data(self) -> dict:
        """The kind's own fields (not gen, rank, step), as the event log records them."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name not in ("gen", "rank", "step") and not (v is None and f.default is None):
                out[f.name] = v
        return out


@dataclass(frozen=True)
class Beat(Report):
    """Worker -> its agent only: liveness and the steps committed since the last beat."""
    committed: int | None
    progress: tuple = ()      # StepRecord fields of each step committed since the last beat

    KIND: ClassVar[str] = "hb"


@dataclass(frozen=True)
class Started(Report):
    build_s: float
    state_bytes: int
    steps: int | None

    KIND: ClassVar[str] = "started"


@dataclass(frozen=True)
class StandbyReady(Report):
    warm: bool
    sandbox: dict | None = None   # what the rehearsal warmed (roles, timings), first time only

    KIND: ClassVar[str] = "standby_ready"


@dataclass(frozen=True)
class CommError(Report):
    group: str
    error: str
    t: float

    KIND: ClassVar[str] = "comm_error"


@dataclass(frozen=True)
class CheckpointDone(Report):
    reason: str | None
    path: str | None          # None: this rank wrote no shard (not a writer, or it failed)
    save_s: float             # from the step boundary to the shard on disk
    error: str | None = None  # the write failed (a full disk): nothing of this shard was left
    stall_s: float | None = None   # of which training waited (a background write: the copy)

    KIND: ClassVar[str] = "checkpoint"


@dataclass(frozen=True)
class Finished(Report):
    digest: str

    KIND: ClassVar[str] = "finished"


@dataclass(frozen=True)
class CommsAborted(Report):
    """The groups this rank aborted on AbortComms, and when."""
    groups: list
    why: str
    t: float

    KIND: ClassVar[str] = "comms_aborted"


@dataclass(frozen=True)
class Stalled(Report):
    """A collective of this rank's step has been pending for `waited_s` (> hang_timeout_s): the
    worker's watchdog (comm.handles.GroupTable.overdue). `members`: the group's global ranks."""
    group: str
    members: list
    waited_s: float

    KIND: ClassVar[str] = "stalled"


@dataclass(frozen=True)
class Crashed(Report):
    error: str
    script_error: bool = False      # the script misuses the API: it fails the same way anywhere


    KIND: ClassVar[str] = "crashed"


@dataclass(frozen=True)
class Ready(Report):
    """Phase 1 done on this rank: its part of the plan is built."""
    plan: int
    build_s: float
    groups: list
    build_model_s: float | None = None     # a joiner built its model too

    KIND: ClassVar[str] = "ready"


@dataclass(frozen=True)
class PrepareFailed(Report):
    plan: int
    error: str

    KIND: ClassVar[str] = "prepare_failed"


@dataclass(frozen=True)
class Switched(Report):
    plan: int
    switch_s: float
    rebuilt: list
    identity: dict            # group id -> [object id before, after]

    KIND: ClassVar[str] = "switched"


@dataclass(frozen=True)
class Left(Report):
    plan: int
    bytes: int
    transfer_s: float
    tensors: int

    KIND: ClassVar[str] = "left"


@dataclass(frozen=True)
class Joined(Report):
    plan: int
    build_model_s: float
    build_s: float
    reused_sandbox: bool
    wait_s: float
    recv_s: float
    bytes: int | None = None          # the state received from the leaver or a donor
    transfer_s: float | None = None
    tensors: int | None = None

    KIND: ClassVar[str] = "joined"


@dataclass(frozen=True)
class Aborted(Report):
    broken: list
    why: str
    t: float

    KIND: ClassVar[str] = "aborted"


@dataclass(frozen=True)
class RecoverBuilt(Report):
    plan: int
    build_s: float
    groups: list
    build_model_s: float | None = None

    KIND: ClassVar[str] = "recover_built"


@dataclass(frozen=True)
class RecoverFailed(Report):
    plan: int
    error: str

    KIND: ClassVar[str] = "recover_failed"


@dataclass(frozen=True)
class Recovered(Report):
    plan: int
    resume_s: float
    donor: bool
    bytes: int | None = None          # a donor: the state it sent
    transfer_s: float | None = None
    tensors: int | None = None

    KIND: ClassVar[str] = "recovered"


@dataclass(frozen=True)
class RecoveryTimeout(Report):
    KIND: ClassVar[str] = "recovery_timeout"


@dataclass(frozen=True)
class Exiting(Report):
    reason: str | None

    KIND: ClassVar[str] = "exiting"


@dataclass(frozen=True)
class Stopped(Report):
    reason: str | None

    KIND: ClassVar[str] = "stopped"


@dataclass(frozen=True)
class StoreLost(Report):
    error: str

    KIND: ClassVar[str] = "store_lost"


REPORT_KINDS: dict[str, type[Report]] = {c.KIND: c for c in Report.__subclasses__()}


def report(kind: str, gen: int, rank: int | None, step: int | None = None, **data) -> Report:
    """The worker's one way to build a report: by kind name, with that kind's fields."""
    return REPORT_KINDS[kind](gen, rank, step, **data)
