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


class Lines:
    """An append-only JSON-lines file that never raises for the disk: a line that cannot be
    written (a full disk) is counted in `dropped`, and after a partial write the next line starts
    on a line of its own (readers skip the torn one)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.dropped = 0
        self._torn = False

    def write(self, rec: dict) -> bool:
        line = (b"\n" if self._torn else b"") + (json.dumps(rec, default=str) + "\n").encode()
        try:
            n = os.write(self._fd, line)
        except OSError:
            n = -1
        if n == len(line):
            self._torn = False
            return True
        self._torn = self._torn or n > 0
        self.dropped += 1
        return False

    def close(self) -> None:
        os.close(self._fd)


class EventLog:
    def __init__(self, path: str | Path, job: str, clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self.job = job
        self.gen = 0
        self._clock = clock
        self._lock = threading.Lock()
        self._lines = Lines(self.path)
        self._dropped_since: float | None = None
        self._dropped_kinds: dict[str, int] = {}    # bounded: one entry per kind of event
        self.emitted = 0            # records asked for: readers see whether something happened

    def emit(self, kind: str, *, node: str | None = None, rank: int | None = None,
             step: int | None = None, gen: int | None = None, **details: Any) -> dict:
        """Append one record. Never raises for the disk: the first record written after some
        were lost says how many, of which kinds, and since when (`events_dropped`)."""
        rec = {"ts": round(self._clock(), 6), "job": self.job, "gen": self.gen if gen is None else gen,
               "node": node, "rank": rank, "step": step, "kind": kind}
        rec.update(details)
        with self._lock:
            self.emitted += 1
            lost = self._lines.dropped
            if not self._lines.write(rec):
                self._dropped_since = self._dropped_since or rec["ts"]
                self._dropped_kinds[kind] = self._dropped_kinds.get(kind, 0) + 1
            elif lost and self._lines.write(
                    {"ts": rec["ts"], "job": self.job, "gen": rec["gen"], "node": None, "rank": None,
                     "step": None, "kind": "events_dropped", "count": lost, "since": self._dropped_since,
                     "kinds": self._dropped_kinds}):
                self._lines.dropped, self._dropped_since, self._dropped_kinds = 0, None, {}
        return rec

    @property
    def dropped(self) -> int:
        return self._lines.dropped

    def close(self) -> None:
        with self._lock:
            self._lines.close()


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
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except OSError:
        tmp.unlink(missing_ok=True)          # a full disk leaves no partial file behind
        raise
