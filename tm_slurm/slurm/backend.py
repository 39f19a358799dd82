"""The one small interface between tm_slurm and Slurm and its value types (`choose.py` picks
the implementation).

Two implementations:

- `cli_backend.CliBackend`: Slurm's command line tools (`sinfo --json`, `scontrol`). Works with
  every Slurm that has `sinfo --json` (21.08+); developed and tested against a real 22.05.8
  cluster.
- `pyslurm_backend.PyslurmBackend`: in-process libslurm through pyslurm, for sites whose
  pyslurm matches their Slurm (pyslurm X.Y.* only talks to Slurm X.Y).

State vocabulary (Slurm 22.05, as `scontrol show node -o` prints `State=` and `sinfo --json`
prints `state` + `state_flags`): a node has ONE base state (UNKNOWN, DOWN, IDLE, ALLOCATED,
MIXED, FUTURE, ERROR) and any number of flags (DRAIN, COMPLETING, NOT_RESPONDING, FAIL,
MAINTENANCE, RESERVED, REBOOT_REQUESTED, REBOOT_ISSUED, POWER_*, PLANNED, CLOUD, ...).
`MIXED+DRAIN` -> NodeState(state="MIXED", flags={"DRAIN"}).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

from . import hostlist

BASE_STATES = frozenset({"UNKNOWN", "DOWN", "IDLE", "ALLOCATED", "MIXED", "FUTURE", "ERROR", "END"})

# base states in which a DRAIN flag means "jobs still running" (Slurm's node_state_string()
# prints DRAINING for these, and also when the COMPLETING flag is set; else DRAINED)
_BUSY_STATES = frozenset({"ALLOCATED", "MIXED", "ERROR", "COMPLETING"})


class SlurmError(RuntimeError):
    """A Slurm query or command failed. The message says what ran, how it failed and stderr."""

    def __init__(self, message: str, *, argv: Sequence[str] | None = None,
                 returncode: int | None = None, stderr: str = ""):
        super().__init__(message)
        self.argv = tuple(argv) if argv else ()
        self.returncode = returncode
        self.stderr = stderr


@dataclass(frozen=True)
class NodeState:
    """One node as slurmctld sees it.

    state: base state, upper case (IDLE, MIXED, ALLOCATED, DOWN, ...). COMPLETING is reported by
        Slurm as a flag; if some source reports it as the base state it is kept as is.
    flags: upper-case state flags (DRAIN, REBOOT_REQUESTED, NOT_RESPONDING, ...). The sinfo
        shorthand `*` (idle*, mixed*) is NOT_RESPONDING.
    reason / reason_time / reason_user: what `scontrol update ... Reason=` set, when (epoch s)
        and by whom; "" / None when no reason is set.
    boot_time: epoch seconds of the node's last boot as slurmd reported it (changes on reboot).
    """
    name: str
    state: str
    flags: frozenset[str] = frozenset()
    reason: str = ""
    reason_time: float | None = None
    reason_user: str = ""
    boot_time: float | None = None

    @property
    def drain_requested(self) -> bool:
        """The DRAIN flag is set, whatever the base state (draining or already drained)."""
        return "DRAIN" in self.flags

    @property
    def draining(self) -> bool:
        """Slurm's DRAINING: DRAIN flag set while jobs still run on the node.

        True for MIXED+DRAIN, ALLOCATED+DRAIN (a drain on a node running our job: what
        `scontrol update NodeName=X State=DRAIN` gives, and also `scontrol reboot ASAP`, which
        shows MIXED+DRAIN+REBOOT_REQUESTED) and for anything+DRAIN+COMPLETING. False for
        IDLE+DRAIN / DOWN+DRAIN (DRAINED: no jobs left; what a node becomes right after its last
        job, e.g. ours, gave it back with `release_nodes`) and for nodes without DRAIN.
        This mirrors Slurm's node_state_string(): DRAINING iff DRAIN and (ALLOCATED or MIXED or
        COMPLETING).
        """
        return "DRAIN" in self.flags and (self.state in _BUSY_STATES or "COMPLETING" in self.flags)

    @property
    def drained(self) -> bool:
        """Slurm's DRAINED: DRAIN flag set and no job left on the node (IDLE+DRAIN, DOWN+DRAIN)."""
        return "DRAIN" in self.flags and not self.draining

    @property
    def down(self) -> bool:
        return self.state == "DOWN"

    @property
    def not_responding(self) -> bool:
        return "NOT_RESPONDING" in self.flags

    @property
    def state_string(self) -> str:
        """`MIXED+DRAIN+REBOOT_REQUESTED`-style, flags sorted."""
        return "+".join([self.state, *sorted(self.flags)])


@dataclass(frozen=True)
class Reservation:
    """A reservation as `scontrol show res -o` shows it. Times are epoch seconds; flags are
    Slurm's upper-case names as scontrol prints them (MAINT, IGNORE_JOBS, SPEC_NODES, ...)."""
    name: str
    nodes: tuple[str, ...]
    start: float
    end: float
    flags: frozenset[str] = frozenset()
    state: str = ""                 # ACTIVE / INACTIVE (scontrol's State=), "" if unknown

    @property
    def maint(self) -> bool:
        return "MAINT" in self.flags

    def active_at(self, now: float) -> bool:
        return self.start <= now < self.end


@dataclass(frozen=True)
class JobInfo:
    """A job as `scontrol show job -o J` shows it.

    nodes: the CURRENT allocation (changes when the job is shrunk or loses a node), () while
        pending. time_limit_s: None for UNLIMITED. restarts: how often Slurm requeued it.
    reason: Slurm's job state reason ("" for None).
    """
    job_id: str
    state: str
    nodes: tuple[str, ...]
    user: str
    workdir: str
    batch_host: str
    time_limit_s: float | None
    restarts: int
    reason: str
    start_time: float | None = None
    end_time: float | None = None   # start + limit for a running job (moves with the limit)
    requeue: bool | None = None     # may Slurm requeue it (sbatch --requeue / JobRequeue=1)


@runtime_checkable
class SlurmBackend(Protocol):
    name: str

    def nodes(self, names: Sequence[str]) -> dict[str, NodeState]:
        """State of `names`, in ONE batched query. Names Slurm does not know are absent."""

    def reservations(self) -> list[Reservation]:
        """Every reservation (active and future)."""

    def job(self, job_id: str) -> JobInfo | None:
        """The job, or None when Slurm no longer (or never) knew it."""

    def job_workdir(self, job_id: str) -> str | None:
        """The job's working directory, None when the job is unknown."""

    def release_nodes(self, job_id: str, keep: Sequence[str]) -> None:
        """Shrink a running job's allocation to `keep` so the other nodes go back to Slurm."""

    def resizes_once(self) -> bool:
        """Whether this Slurm refuses every update of a job once it has been resized
        (`resizes_once` below)."""

    def notify(self, job_id: str, message: str) -> None:
        """`scontrol notify`: a message to the job's srun/salloc (stderr)."""

    def requeue(self, job_id: str) -> None:
        """`scontrol requeue`: kill and put the job back in the queue (needs --requeue)."""

    def drain(self, nodes: Sequence[str], reason: str) -> None:
        """Admin: drain nodes (scontrol update NodeName=... State=DRAIN Reason=...)."""

    def resume(self, nodes: Sequence[str]) -> None:
        """Admin: undrain nodes (State=RESUME)."""


def check_release(job_id: str, info: JobInfo | None, keep: Sequence[str]) -> list[str] | None:
    """Validate a `release_nodes(job_id, keep)` request against the job's current info.

    Returns the de-duplicated `keep` list, or None when there is nothing to do (keep is the
    whole allocation). Raises SlurmError, with the real reason, for what Slurm 22.05 would
    reject only as "Invalid node name specified" (empty keep, nodes outside the allocation,
    dropping the batch host) and for a job that is not RUNNING (on a PENDING job the same
    update would replace its required node list instead of shrinking anything).
    """
    keep = list(dict.fromkeys(keep))
    if not keep:
        raise SlurmError(f"release_nodes({job_id}): refusing to release every node of the "
                         "job (keep is empty); cancel or requeue the job instead")
    if info is None:
        raise SlurmError(f"release_nodes({job_id}): no such job")
    if info.state != "RUNNING":
        raise SlurmError(f"release_nodes({job_id}): job is {info.state or 'in an unknown state'}, "
                         "not RUNNING; only a running job's allocation can be shrunk")
    extra = [n for n in keep if n not in info.nodes]
    if extra:
        raise SlurmError(f"release_nodes({job_id}): {hostlist.compress(extra)} not in the job's "
                         f"allocation {hostlist.compress(info.nodes)}")
    if info.batch_host and info.batch_host not in keep:
        raise SlurmError(f"release_nodes({job_id}): the batch host {info.batch_host} must be kept "
                         "(Slurm cannot remove the batch host when resizing a job)")
    if set(keep) == set(info.nodes):
        return None
    return keep


def resizes_once(version: str, accounting_storage: str) -> bool:
    """Slurm 21.08 to 24.05 without slurmdbd resizes a job once. `job_post_resize_acctg` sets the
    job's db_index to NO_VAL64 for the database to fill in, which accounting_storage/none never
    does; every later update of the job then holds a slurmctld thread 5 s and fails with "the DB
    index is being set" (or, where MessageTimeout <= 5 s, times out in the client first).
    Read in SchedMD/slurm at slurm-21-08-8-1 .. slurm-24-05-8-1; commit 98c2add5bc (24.11)
    removed the hold. `version` is SLURM_VERSION ("22.05.8"), `accounting_storage`
    AccountingStorageType, both as `scontrol show config` prints them."""
    v = parse_version(version)
    return v is not None and (21, 8) <= v <= (24, 5) and \
        accounting_storage.strip().lower() == "accounting_storage/none"


def parse_version(text: str) -> tuple[int, int] | None:
    """`slurm-wlm 22.05.8` / `slurm 24.05.1` / `24.5.1` (pyslurm) -> (22, 5) / (24, 5)."""
    m = re.search(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def split_state(text: str) -> tuple[str, frozenset[str]]:
    """`MIXED+DRAIN+REBOOT_REQUESTED` -> ("MIXED", {"DRAIN", "REBOOT_REQUESTED"}).

    Also accepts a trailing `*` (sinfo's NOT_RESPONDING marker) and a leading flag-only string.
    """
    text = (text or "").strip().upper()
    flags: set[str] = set()
    while text.endswith("*"):
        flags.add("NOT_RESPONDING")
        text = text[:-1]
    parts = [p for p in re.split(r"[+,]", text) if p]
    base = ""
    for p in parts:
        if not base and p in BASE_STATES:
            base = p
        else:
            flags.add(p)
    if not base:
        # e.g. a bare "COMPLETING" or an unknown word: keep it visible as the base state
        base = parts[0] if parts else "UNKNOWN"
        flags.discard(base)
    return base, frozenset(flags)


__all__ = ["NodeState", "Reservation", "JobInfo", "SlurmBackend", "SlurmError",
           "check_release", "parse_version", "resizes_once", "split_state", "BASE_STATES"]
