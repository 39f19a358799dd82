"""Where things live in a job directory (shared by controller, agents, workers and the CLI).

The job directory is its owner's alone (0700; files 0600): it holds the MPI port name, the
store's address, the checkpoints and the logs (docs/design.md §9)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


_made: set[Path] = set()
USER_UMASK_ENV = "TM_SLURM_USER_UMASK"   # the user's own umask, for their training processes


def _d(p: Path) -> Path:
    if p not in _made:              # the controller asks every few milliseconds
        p.mkdir(parents=True, exist_ok=True, mode=0o700)
        _made.add(p)
    return p


def private_dir(p: Path) -> Path:
    """A directory the runtime makes in the job directory (any process of the job): 0700, whatever
    the training processes' umask."""
    p = Path(p)
    for d in reversed([p, *p.parents]):
        if not d.exists():
            d.mkdir(mode=0o700, exist_ok=True)
    return p


def make_private(job: Path) -> Path:
    """Create the job directory 0700 (and make an existing one of ours 0700), and make every file
    this process creates from now on private (umask 077). The user's umask is kept for the
    training processes (agent: Popen(umask=...))."""
    os.environ.setdefault(USER_UMASK_ENV, oct(os.umask(0o077)))
    job = Path(job)
    job.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(job, 0o700)
    return job


def user_umask() -> int:
    try:
        return int(os.environ.get(USER_UMASK_ENV, "0o022"), 8)
    except ValueError:
        return 0o022


def control_dir(job: Path) -> Path:
    return _d(Path(job) / "control")


def port_file(job: Path) -> Path:
    return Path(job) / "control" / "port"


def join_dir(job: Path) -> Path:
    return _d(Path(job) / "control" / "join")


def requests_dir(job: Path) -> Path:
    return _d(Path(job) / "control" / "requests")


def refused_dir(job: Path) -> Path:
    """Request files the controller refused, moved out of the inbox (controller/requests.py)."""
    return _d(Path(job) / "control" / "refused")


def controller_exit_file(job: Path) -> Path:
    """The controller's exit code (launch/supervise.py): its launcher says 0 for a killed one."""
    return control_dir(job) / "controller-exit"


def log_dir(job: Path) -> Path:
    return _d(Path(job) / "logs")


def events_file(job: Path) -> Path:
    return Path(job) / "events.jsonl"


def lost_dir(job: Path) -> Path:
    """Where the survivors of a lost controller meet (worker/lost.py, agent.py): one directory per
    run of the job (Slurm's requeue count), so a requeued run never reads an earlier run's notes."""
    return private_dir(Path(job) / "control" / "lost" / f"run{os.environ.get('SLURM_RESTART_COUNT') or 0}")


STATUS_EVERY_S = 0.5        # the controller touches status.json this often: the agents' liveness sign


def snapshot_every_s(nodes: int) -> float:
    """How often status.json's content is rewritten when nothing was logged (a change is written
    at the next touch): a snapshot costs ~30 us a node (8 workers each), so 1,024 nodes rewritten
    at every touch would cost 7% of a core; this keeps it under 1%, and small jobs as fresh as
    their touches."""
    return min(5.0, max(STATUS_EVERY_S, nodes / 200))


def status_file(job: Path) -> Path:
    return Path(job) / "status.json"


def final_dir(job: Path) -> Path:
    return Path(job) / "final"


def result_file(job: Path) -> Path:
    return Path(job) / "result.json"


def steps_file(job: Path) -> Path:
    return Path(job) / "steps.jsonl"


def grant_slurm_user(job: Path, uid: int | None) -> tuple[int, bool] | None:
    """A SlurmUser other than root and the owner (trigger programs, admin verbs run as it) may read
    the job's files and drop requests: a POSIX ACL on the job directory, inherited by what is
    created in it. Returns (uid, whether the ACL took) when there is such a user."""
    if uid is None or uid in (0, os.getuid()):
        return None
    tool = shutil.which("setfacl")
    if tool is None:
        return uid, False
    ok = True
    for args in (["-R", "-m", f"u:{uid}:rX,d:u:{uid}:rX", str(job)],
                 ["-m", f"u:{uid}:rwx", str(requests_dir(job))]):
        ok = ok and subprocess.run([tool, *args], capture_output=True, timeout=10).returncode == 0
    return uid, ok
