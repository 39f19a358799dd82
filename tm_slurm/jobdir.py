"""Where things live in a job directory (shared by controller, agents, workers and the CLI)."""
from __future__ import annotations

from pathlib import Path


_made: set[Path] = set()


def _d(p: Path) -> Path:
    if p not in _made:              # the controller asks every few milliseconds
        p.mkdir(parents=True, exist_ok=True)
        _made.add(p)
    return p


def control_dir(job: Path) -> Path:
    return _d(Path(job) / "control")


def port_file(job: Path) -> Path:
    return Path(job) / "control" / "port"


def join_dir(job: Path) -> Path:
    return _d(Path(job) / "control" / "join")


def requests_dir(job: Path) -> Path:
    return _d(Path(job) / "control" / "requests")


def log_dir(job: Path) -> Path:
    return _d(Path(job) / "logs")


def events_file(job: Path) -> Path:
    return Path(job) / "events.jsonl"


def status_file(job: Path) -> Path:
    return Path(job) / "status.json"


def final_dir(job: Path) -> Path:
    return Path(job) / "final"


def result_file(job: Path) -> Path:
    return Path(job) / "result.json"


def steps_file(job: Path) -> Path:
    return Path(job) / "steps.jsonl"
