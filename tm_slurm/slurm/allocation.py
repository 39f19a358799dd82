"""The Slurm allocation we run in, from the environment Slurm gives a job.

Variables, as observed on Slurm 22.05.8:
- sbatch (batch step): SLURM_JOB_ID (+ legacy SLURM_JOBID), SLURM_JOB_NODELIST and
  SLURM_NODELIST (both the compressed list), SLURM_JOB_NUM_NODES / SLURM_NNODES,
  SLURMD_NODENAME (the batch host: first node of the allocation), SLURM_JOB_USER,
  SLURM_SUBMIT_DIR, SLURM_SUBMIT_HOST, SLURM_RESTART_COUNT (only after a requeue; unset = 0).
- salloc (the shell/command on the submit host): SLURM_JOB_ID, SLURM_JOB_NODELIST,
  SLURM_NODELIST, SLURM_JOB_NUM_NODES, SLURM_SUBMIT_DIR, SLURM_SUBMIT_HOST; NO SLURMD_NODENAME
  and NO SLURM_JOB_USER (the process is not on a compute node).
- inside an srun step additionally SLURM_STEP_ID, and SLURMD_NODENAME is that task's node.
None of these change when the allocation shrinks (a lost node, `release_nodes`): ask the
backend (`job(job_id).nodes`) for the current list. The time limit is not in the 22.05
environment; SLURM_JOB_START_TIME/SLURM_JOB_END_TIME (newer Slurm) are used when present.
"""
from __future__ import annotations

import getpass
import os
from dataclasses import dataclass
from typing import Mapping

from . import hostlist


class AllocationError(ValueError):
    """SLURM_JOB_ID is set but the rest of the allocation environment is unusable."""


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: tuple[str, ...]          # expanded SLURM_JOB_NODELIST, allocation order
    user: str
    submit_dir: str
    restart_count: int = 0          # SLURM_RESTART_COUNT: times Slurm requeued this job
    time_limit_s: float | None = None   # only when the environment says (newer Slurm)
    # "batch" (sbatch script), "salloc", or "step" (inside srun); where this process runs (the
    # controller serves from there: slurm/address.py) is the batch host, the submit host, or
    # the step's node
    kind: str = "batch"
    submit_host: str = ""           # where sbatch/salloc ran

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)


def _int(v: str | None, default: int = 0) -> int:
    try:
        return int(str(v).strip())
    except (TypeError, ValueError):
        return default


def from_env(env: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation described by `env` (default os.environ), None outside Slurm.

    Raises AllocationError (a ValueError) if SLURM_JOB_ID is set but no node list is, or the
    node list does not parse (a broken environment).
    """
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    try:
        nodes = tuple(hostlist.expand(nodelist))
    except ValueError as e:
        raise AllocationError(f"SLURM_JOB_NODELIST={nodelist!r}: {e}") from None
    if not nodes:
        raise AllocationError(f"SLURM_JOB_ID={job_id} is set but SLURM_JOB_NODELIST/SLURM_NODELIST "
                         "is empty: not a usable Slurm allocation environment")
    if env.get("SLURM_STEP_ID") is not None or env.get("SLURM_STEPID") is not None:
        kind = "step"
    elif env.get("SLURMD_NODENAME"):
        kind = "batch"
    else:
        kind = "salloc"
    user = env.get("SLURM_JOB_USER") or env.get("USER") or env.get("LOGNAME") or ""
    if not user:
        try:
            user = getpass.getuser()
        except Exception:
            user = ""
    time_limit = None
    start, end = env.get("SLURM_JOB_START_TIME"), env.get("SLURM_JOB_END_TIME")
    if start and end and _int(end) > _int(start) > 0:
        time_limit = float(_int(end) - _int(start))
    return Allocation(job_id=str(job_id), nodes=nodes, user=user,
                      submit_dir=env.get("SLURM_SUBMIT_DIR") or os.getcwd(),
                      restart_count=_int(env.get("SLURM_RESTART_COUNT"), 0),
                      time_limit_s=time_limit, kind=kind,
                      submit_host=env.get("SLURM_SUBMIT_HOST", ""))


__all__ = ["Allocation", "AllocationError", "from_env"]
