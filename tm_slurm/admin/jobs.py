"""What `tm-slurm evacuate` and `tm-slurm notify-nodes` share: the running jobs on some nodes,
which of them are tm_slurm jobs, and a request dropped into such a job's inbox (the package
docstring says who may do that).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .. import jobdir
from ..controller.requests import request_file, slurm_user_uid
from ..findjob import JOBS_ROOT
from ..slurm import SlurmError, hostlist
from . import userfiles

MAX_STATUS = 16 << 20          # status.json of a job of thousands of nodes
# roles in which a node still belongs to a tm_slurm job (status.json), whatever Slurm says
LIVE_ROLES = frozenset({"ACTIVE", "STANDBY", "JOINING", "LEAVING"})


@dataclass(frozen=True)
class RunningJob:
    job_id: str
    user: str
    nodes: tuple[str, ...]       # the current Slurm allocation
    workdir: str

    @property
    def job_dir(self) -> Path | None:
        """The tm_slurm job directory, None when this is not a tm_slurm job (or it put its job
        directory elsewhere with --job-dir: then it only reacts to Slurm's own node states)."""
        if not self.workdir:
            return None
        d = Path(self.workdir) / JOBS_ROOT / self.job_id
        try:
            os.close(userfiles.open_dir(d, "control", "requests"))
        except OSError:
            return None
        return d


Runner = Callable[..., subprocess.CompletedProcess]

# %A: the job id that is unique per array element (= SLURM_JOB_ID, what tm_slurm names its
# directory after); %Z last because a working directory may contain the separator
SQUEUE_FORMAT = "%A|%u|%N|%Z"


def running_jobs(nodes: Sequence[str] | None = None, *, run: Runner = subprocess.run,
                 timeout: float = 30.0) -> list[RunningJob]:
    """Running jobs (on `nodes` only, if given), from one `squeue` call."""
    argv = ["squeue", "--noheader", "--all", "--states=RUNNING", f"--format={SQUEUE_FORMAT}"]
    if nodes:
        argv.append(f"--nodelist={hostlist.compress(nodes, sort=True)}")
    try:
        cp = run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SlurmError("Slurm CLI not found (is slurm-client installed / on PATH?): cannot "
                         "run 'squeue'", argv=argv) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{shlex.join(argv)}` timed out after {timeout:g} s (slurmctld "
                         "unreachable or overloaded?)", argv=argv) from None
    if cp.returncode != 0:
        raise SlurmError(f"`{shlex.join(argv)}` failed with exit code {cp.returncode}: "
                         f"{(cp.stderr or cp.stdout or '').strip() or '(no output)'}",
                         argv=argv, returncode=cp.returncode, stderr=cp.stderr or "")
    return parse_squeue(cp.stdout)


def parse_squeue(text: str) -> list[RunningJob]:
    jobs = []
    for line in (text or "").splitlines():
        parts = line.strip().split("|", 3)
        if len(parts) != 4 or not parts[0]:
            continue
        job_id, user, nodes, workdir = parts
        jobs.append(RunningJob(job_id, user, tuple(hostlist.expand(nodes)) if nodes else (), workdir))
    return jobs


def job_nodes(job_dir: Path, roles: frozenset[str] = LIVE_ROLES) -> set[str]:
    """The nodes a tm_slurm job counts as its own, by role (status.json, rewritten within 0.5 s
    of a role change). Slurm drops a DOWN node from a --no-kill job at once, so its allocation may not
    show a node the job still has."""
    try:
        st = json.loads(userfiles.read(job_dir, jobdir.status_file(job_dir).name, MAX_STATUS))
        return {n for n, v in st["nodes"].items() if v["role"] in roles}
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError):
        return set()        # not there, or not what the runtime writes: Slurm's view alone


def affected(jobs: Sequence[RunningJob], nodes: Sequence[str],
             roles: frozenset[str] = LIVE_ROLES) -> list[tuple[RunningJob, list[str]]]:
    """(job, which of `nodes` it holds) for every job holding at least one of them: in its Slurm
    allocation, or (tm_slurm jobs) in one of `roles` in its status."""
    wanted = set(nodes)
    out = []
    for job in jobs:
        held = set(job.nodes) & wanted
        if job.job_dir is not None:
            held |= job_nodes(job.job_dir, roles) & wanted
        if held:
            out.append((job, sorted(held)))
    return out


def ask(job: RunningJob, verb: str, nodes: Sequence[str], reason: str, source: str) -> list[str]:
    """Drop one request per node into a tm_slurm job's inbox; returns the file names."""
    names = []
    for n in nodes:
        name, body = request_file(verb, n, reason, source=source)
        userfiles.write_request(job.job_dir, name, body)
        names.append(name)
    return names


def privilege_note() -> str | None:
    """Why requests from this user may be refused (None: they will be accepted)."""
    uid = os.geteuid()
    if uid == 0 or uid == slurm_user_uid():
        return None
    return (f"running as uid {uid}, not root or SlurmUser: tm_slurm jobs of other users refuse "
            "these requests (logged as request_refused) and react only to Slurm's node state, "
            "within their slurm.poll_interval_s")
