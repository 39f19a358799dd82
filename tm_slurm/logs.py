"""Diagnostics of the long-running processes, on stderr (their log files): stdlib logging, each
line naming the job, node and rank it comes from. The event log (events.py) stays the record of
what happened; these lines are for a person reading one process's log."""
from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(name)s job=%(job)s node=%(node)s rank=%(rank)s %(levelname)s: %(message)s"
CONTEXT = ("job", "node", "rank")


class _Context(logging.Filter):
    """A line logged without context still formats: the fields it lacks read '-'."""
    def filter(self, record: logging.LogRecord) -> bool:
        for k in CONTEXT:
            if getattr(record, k, None) is None:
                setattr(record, k, "-")
        return True


def setup(level: int = logging.INFO) -> None:
    """Once per process: tm_slurm's loggers write to stderr."""
    root = logging.getLogger("tm_slurm")
    if root.handlers:
        return
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter(FORMAT))
    h.addFilter(_Context())
    root.addHandler(h)
    root.setLevel(level)
    root.propagate = False


def get(name: str, *, job: str | None = None, node: str | None = None,
        rank: int | None = None) -> logging.LoggerAdapter:
    return logging.LoggerAdapter(logging.getLogger(f"tm_slurm.{name}"), {"job": job, "node": node, "rank": rank})
