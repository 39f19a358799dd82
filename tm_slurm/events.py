"""The job's event log: `events.jsonl` in the job directory, one JSON object per line.

Every line carries ts (wall clock, comparable across nodes), job, gen, node, rank, step and kind;
the controller is its only writer, so lines are totally ordered.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator


class EventLog:
    def __init__(self, path: str | Path, job: str, clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self.job = job
        self.gen = 0
        self._clock = clock
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a", buffering=1)

    def emit(self, kind: str, *, node: str | None = None, rank: int | None = None,
             step: int | None = None, gen: int | None = None, **details: Any) -> dict:
        rec = {"ts": round(self._clock(), 6), "job": self.job, "gen": self.gen if gen is None else gen,
               "node": node, "rank": rank, "step": step, "kind": kind}
        rec.update(details)
        with self._lock:
            self._f.write(json.dumps(rec, default=str) + "\n")
        return rec

    def close(self) -> None:
        with self._lock:
            self._f.close()


def read(path: str | Path) -> Iterator[dict]:
    """Records of an events.jsonl; a torn last line (writer killed mid-write) is skipped."""
    p = Path(path)
    if not p.exists():
        return
    with open(p) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def fsync_write(path: str | Path, data: bytes) -> None:
    """Atomic replace: readers see the old or the new file, never a partial one. The file is the
    writer's alone (0600): job files are nobody else's to read (docs/design.md §9)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
