"""Which job directory a command means (`--job DIR_OR_ID`): `tm-slurm status`, `report`, `drain`,
`checkpoint` and `fail` all take one.
"""
from __future__ import annotations

from pathlib import Path

JOBS_ROOT = "tm_slurm_jobs"          # under a job's working directory (admin/jobs.py finds jobs by it too)


def find_job(arg: str | None) -> Path:
    """A job directory from a path, a job id (under ./tm_slurm_jobs or the Slurm job's working
    directory), or nothing (the newest job under ./tm_slurm_jobs)."""
    if arg:
        p = Path(arg)
        if (p / "events.jsonl").exists() or (p / "control").is_dir():
            return p
        for base in (Path.cwd(), *_slurm_workdir(arg)):
            q = base / JOBS_ROOT / arg
            if q.is_dir():
                return q
        raise SystemExit(f"no job directory for {arg!r} (looked for {arg}/events.jsonl and "
                         f"{JOBS_ROOT}/{arg} here and in the Slurm job's working directory)")
    root = Path.cwd() / JOBS_ROOT
    jobs = sorted((p for p in root.glob("*") if (p / "events.jsonl").exists()),
                  key=lambda p: (p / "events.jsonl").stat().st_mtime) if root.is_dir() else []
    if not jobs:
        raise SystemExit(f"no job found under {root}; pass --job DIR_OR_ID")
    return jobs[-1]


def _slurm_workdir(job_id: str) -> list[Path]:
    from .slurm import backend_for
    try:
        wd = backend_for("auto").job_workdir(job_id)
    except Exception:
        return []
    return [Path(wd)] if wd else []
