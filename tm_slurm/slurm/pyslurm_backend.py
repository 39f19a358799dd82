"""SlurmBackend over pyslurm (in-process libslurm), for sites where pyslurm matches Slurm.

pyslurm X.Y.* is built against Slurm X.Y only (PyPI's current pyslurm targets Slurm 25.11), so
`backend_for("auto")` picks this backend only when pyslurm's major.minor equals
`sinfo --version`'s. On the development cluster (Slurm 22.05) pyslurm cannot be installed or
built: HERE THIS BACKEND IS COVERED BY UNIT TESTS OF ITS PURE MAPPING FUNCTIONS AND OF ITS
METHODS AGAINST A FAKE pyslurm MODULE ONLY, never against a real libslurm.

API used (pyslurm 24.x/25.x, from the pyslurm sources; 23.x differs in places, handled below):
- `pyslurm.Nodes.load()` -> dict-like (MultiClusterMap) of `pyslurm.Node`: `name`, `state`
  (`MIXED+DRAIN`-style string from slurm_node_state_string_complete), `reason`,
  `reason_user`, `reason_time` (epoch int; 23.x: formatted str + `reason_time_raw`),
  `boot_time`.
- `pyslurm.Reservations.load()` -> dict-like of `pyslurm.Reservation`: `name`, `nodes`
  (hostlist str), `start_time`, `end_time` (epoch), `flags` (`pyslurm.ReservationFlags`, an
  enum.Flag with members MAINTENANCE, IGNORE_RUNNING_JOBS, SPECIFIC_NODES, ...), `is_active`.
- `pyslurm.Job.load(id)`: `id`, `state`, `state_reason`, `allocated_nodes` (hostlist str),
  `user_name`, `working_directory`, `batch_host`, `time_limit` (minutes, None = unlimited),
  `requeue_count`, `is_requeueable`, `start_time`, `end_time`.
- `pyslurm.Job(id).modify(pyslurm.JobSubmitDescription(required_nodes=...))` is
  slurm_update_job with req_nodes set: the same RPC as `scontrol update JobId=J NodeList=...`.
- `pyslurm.Job(id).notify(msg)`, `.requeue()`; `pyslurm.Node(name).modify(pyslurm.Node(
  state="DRAIN", reason=...))` / `state="RESUME"`. Errors are `pyslurm.RPCError`.
In-process libslurm must reach slurmctld directly: under slurmlab run it via `slurmlab-exec`.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from . import hostlist
from .backend import (JobInfo, NodeState, Reservation, SlurmError, check_release, split_state)
from .cli_backend import parse_time

# pyslurm.ReservationFlags member names -> the names scontrol prints in Flags=
RESV_FLAG_NAMES = {
    "MAINTENANCE": "MAINT",
    "IGNORE_RUNNING_JOBS": "IGNORE_JOBS",
    "SPECIFIC_NODES": "SPEC_NODES",
    "PARTITION_NODES_ONLY": "PART_NODES",
    "USER_DELETION": "USER_DELETE",
    "PURGE": "PURGE_COMP",
    "STATIC_NODES": "STATIC",
    "NO_JOB_HOLD_AFTER_END": "NO_HOLD_JOBS_AFTER_END",
}


def _values(collection: Any) -> Iterable[Any]:
    """pyslurm collections are dict-like (25.x MultiClusterMap, 23.x dict) or list-like."""
    values = getattr(collection, "values", None)
    return list(values()) if callable(values) else list(collection or [])


def _str(v: Any) -> str:
    if v is None:
        return ""
    s = str(v)
    return "" if s.strip().lower() in ("none", "(null)", "n/a") else s


def _flag_names(flags: Any) -> list[str]:
    """A pyslurm enum.Flag value, a list of names/members, or "A,B" -> upper-case names."""
    if flags is None:
        return []
    if isinstance(flags, str):
        return [f.strip().upper() for f in flags.split(",") if f.strip()]
    if isinstance(flags, (list, tuple, set, frozenset)):
        return [str(getattr(f, "name", f)).upper() for f in flags]
    cls = type(flags)
    try:                                   # enum.Flag: the members contained in the value
        members = [m for m in cls if m.value and (m & flags) == m]
        return [m.name.upper() for m in members]
    except TypeError:
        name = getattr(flags, "name", None)
        return [str(name).upper()] if name else []


def node_from_pyslurm(node: Any) -> NodeState:
    """A `pyslurm.Node` (or anything with its attributes) -> NodeState."""
    state = getattr(node, "state", "") or ""
    if isinstance(state, (list, tuple, set, frozenset)):
        state = "+".join(str(s) for s in state)
    base, flags = split_state(str(state))
    rt = getattr(node, "reason_time_raw", None)
    if rt is None:
        rt = getattr(node, "reason_time", None)
    bt = getattr(node, "boot_time_raw", None)
    if bt is None:
        bt = getattr(node, "boot_time", None)
    return NodeState(name=str(node.name), state=base, flags=flags,
                     reason=_str(getattr(node, "reason", "")), reason_time=parse_time(rt),
                     reason_user=_str(getattr(node, "reason_user", "")), boot_time=parse_time(bt))


def reservation_from_pyslurm(r: Any) -> Reservation:
    """A `pyslurm.Reservation` -> Reservation, flags renamed to scontrol's names."""
    flags = frozenset(RESV_FLAG_NAMES.get(f, f) for f in _flag_names(getattr(r, "flags", None)))
    start = parse_time(getattr(r, "start_time", None))
    end = parse_time(getattr(r, "end_time", None))
    active = getattr(r, "is_active", None)
    return Reservation(name=str(r.name), nodes=tuple(hostlist.expand(_str(getattr(r, "nodes", "")))),
                       start=start if start is not None else 0.0,
                       end=end if end is not None else float("inf"), flags=flags,
                       state="" if active is None else ("ACTIVE" if active else "INACTIVE"))


def job_from_pyslurm(j: Any) -> JobInfo:
    """A `pyslurm.Job` -> JobInfo."""
    tl = getattr(j, "time_limit", None)
    if isinstance(tl, str):
        from .cli_backend import parse_duration
        tl_s = parse_duration(tl)
    else:
        tl_s = None if tl is None else float(tl) * 60.0
    restarts = None
    for attr in ("requeue_count", "restart_count", "restart_cnt"):
        restarts = getattr(j, attr, None)
        if restarts is not None:
            break
    requeue = getattr(j, "is_requeueable", None)
    return JobInfo(job_id=str(j.id), state=_str(getattr(j, "state", "")).upper(),
                   nodes=tuple(hostlist.expand(_str(getattr(j, "allocated_nodes", "")))),
                   user=_str(getattr(j, "user_name", "")),
                   workdir=_str(getattr(j, "working_directory", "")),
                   batch_host=_str(getattr(j, "batch_host", "")),
                   time_limit_s=tl_s, restarts=int(restarts or 0),
                   reason=_str(getattr(j, "state_reason", "")),
                   start_time=parse_time(getattr(j, "start_time", None)),
                   end_time=parse_time(getattr(j, "end_time", None)),
                   requeue=None if requeue is None else bool(requeue))


def _jid(job_id: str) -> int:
    s = str(job_id).strip()
    if not s.isdigit():                 # (int() would also accept "12_3" as 123)
        raise SlurmError(f"pyslurm backend: job id {job_id!r} is not a plain numeric job id "
                         "(array/het job ids are not supported here)")
    return int(s)


def _is_invalid_job(e: Exception) -> bool:
    return getattr(e, "errno", None) == 2017 or "invalid job id" in str(e).lower()


class PyslurmBackend:
    """SlurmBackend over pyslurm; `module` injects a (fake) pyslurm for tests."""

    name = "pyslurm"

    def __init__(self, module: Any = None):
        self._mod = module

    @property
    def ps(self) -> Any:
        if self._mod is None:
            try:
                import pyslurm  # lazy: optional dependency
            except Exception as e:
                raise SlurmError(f"pyslurm backend: cannot import pyslurm ({e}); install the "
                                 "pyslurm that matches your Slurm, or use slurm.backend=cli") from e
            self._mod = pyslurm
        return self._mod

    def _guard(self, what: str, fn, *args, **kwargs):
        err = getattr(self.ps, "RPCError", None)
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if isinstance(e, SlurmError):
                raise
            if (err is not None and isinstance(e, err)) or isinstance(e, (OSError, ValueError)):
                raise SlurmError(f"pyslurm {what} failed: {e}") from e
            raise

    def nodes(self, names: Sequence[str]) -> dict[str, NodeState]:
        wanted = set(names)
        if not wanted:
            return {}
        loaded = self._guard("Nodes.load()", self.ps.Nodes.load)
        out = {}
        for n in _values(loaded):
            if n.name in wanted:
                out[n.name] = node_from_pyslurm(n)
        return out

    def reservations(self) -> list[Reservation]:
        loaded = self._guard("Reservations.load()", self.ps.Reservations.load)
        return [reservation_from_pyslurm(r) for r in _values(loaded)]

    def job(self, job_id: str) -> JobInfo | None:
        try:
            j = self.ps.Job.load(_jid(job_id))
        except Exception as e:
            if _is_invalid_job(e):
                return None
            err = getattr(self.ps, "RPCError", None)
            if err is not None and isinstance(e, err):
                raise SlurmError(f"pyslurm Job.load({job_id}) failed: {e}") from e
            raise
        return job_from_pyslurm(j)

    def job_workdir(self, job_id: str) -> str | None:
        info = self.job(job_id)
        return (info.workdir or None) if info else None

    def release_nodes(self, job_id: str, keep: Sequence[str]) -> None:
        """Same semantics (and pre-checks) as CliBackend.release_nodes: slurm_update_job with
        req_nodes = keep on a RUNNING job shrinks it; steps on removed nodes are killed."""
        keep = check_release(job_id, self.job(job_id), keep)
        if keep is None:
            return
        desc = self.ps.JobSubmitDescription(required_nodes=hostlist.compress(keep, sort=True))
        self._guard(f"Job({job_id}).modify(required_nodes=...)", self.ps.Job(_jid(job_id)).modify, desc)

    def resizes_once(self) -> bool:
        # pyslurm X.Y talks to Slurm X.Y only, and the pyslurm on PyPI is 25.11, which has no such
        # hold; with an older one the launcher learns it from the first refusal
        return False

    def notify(self, job_id: str, message: str) -> None:
        self._guard(f"Job({job_id}).notify()", self.ps.Job(_jid(job_id)).notify, message)

    def requeue(self, job_id: str) -> None:
        self._guard(f"Job({job_id}).requeue()", self.ps.Job(_jid(job_id)).requeue)

    def _set_state(self, nodes: Sequence[str], **changes) -> None:
        for n in nodes:
            self._guard(f"Node({n}).modify({changes})", self.ps.Node(n).modify,
                        self.ps.Node(**changes))

    def drain(self, nodes: Sequence[str], reason: str) -> None:
        if not reason or not reason.strip():
            raise SlurmError("drain: Slurm requires a reason to drain a node")
        self._set_state(nodes, state="DRAIN", reason=reason)

    def resume(self, nodes: Sequence[str]) -> None:
        self._set_state(nodes, state="RESUME")


__all__ = ["PyslurmBackend", "node_from_pyslurm", "reservation_from_pyslurm", "job_from_pyslurm",
           "RESV_FLAG_NAMES"]
