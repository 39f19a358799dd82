"""Named fault points: a test (or a site rehearsing its runbook) makes a node fail at a named point
of the protocol instead of racing the job for the moment.

`TM_SLURM_FAULTS="POINT[:STEP]@NODE[=MODE],..."` in the environment of `tm-slurm run` (the agents
and workers inherit it). When a process of NODE reaches POINT (at STEP or later, for a point that
knows its step), MODE happens for real:
  kill      the node's whole process group is SIGKILLed (a power loss in local mode; default)
  hang      the node's process group is SIGSTOPped (a hung kernel)
  sleepN    this process sleeps N seconds, once (a slow node)
Only the job's owner sets its environment; a malformed value stops `tm-slurm run` before anything
starts (`check`).
"""
from __future__ import annotations

import functools
import os
import signal
import time

ENV = "TM_SLURM_FAULTS"
POINTS = {
    "transfer.mid": "a state sender (planned leaver, recovery donor) with half its tensors sent",
    "phase1.build": "a stayer that has built its groups for a planned swap, before it reports ready",
    "join.built": "a planned joiner that has built its groups, before it reports ready",
    "join.ready": "a planned joiner, ready, waiting for the switch",
    "join.joined": "a joiner that has switched in and holds its state, before its first step",
    "recover.build": "a stayer that has built its part of a recovery plan, before it reports it",
    "standby.warm": "a standby that has warmed up, before it reports ready",
    "checkpoint.periodic": "a rank of replica 0 at a periodic checkpoint, before its shard is written",
    "collective": "a rank about to issue a collective of its step (sleepN there: a live process "
                  "hung before a collective, its heartbeats flowing)",
}


def parse(text: str) -> dict[tuple[str, str], tuple[str, int]]:
    """{(point, node): (mode, from step)}; ValueError names what is wrong and what is valid."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        where, _, mode = item.partition("=")
        point, _, node = where.partition("@")
        point, _, step = point.partition(":")
        mode = mode or "kill"
        if step and not step.isdigit():
            raise ValueError(f"{ENV}: {item!r}: the step after ':' is a number")
        if point not in POINTS:
            raise ValueError(f"{ENV}: unknown point {point!r}; valid: {', '.join(POINTS)}")
        if not node:
            raise ValueError(f"{ENV}: {item!r} names no node (POINT@NODE[=MODE])")
        if mode not in ("kill", "hang") and not (mode.startswith("sleep") and _seconds(mode) is not None):
            raise ValueError(f"{ENV}: unknown mode {mode!r} in {item!r}; valid: kill, hang, sleepN")
        out[(point, node)] = (mode, int(step or 0))
    return out


def _seconds(mode: str) -> float | None:
    try:
        s = float(mode.removeprefix("sleep"))
    except ValueError:
        return None
    return s if 0 <= s <= 3600 else None


def check() -> None:
    """For `tm-slurm run`, before anything starts."""
    parse(os.environ.get(ENV, ""))


@functools.cache
def _armed() -> dict[tuple[str, str], tuple[str, int]]:
    return parse(os.environ.get(ENV, ""))


_FIRED: set[tuple[str, str]] = set()


def armed() -> bool:
    return bool(_armed())


def at(point: str, node: str | None = None, step: int | None = None) -> None:
    """A fault point: nothing unless TM_SLURM_FAULTS arms it for this node (and this step)."""
    if not _armed():
        return
    key = (point, node or os.environ.get("TM_SLURM_NODE", ""))
    mode, first = _armed().get(key, (None, 0))
    if mode is None or key in _FIRED or (step or 0) < first:
        return
    _FIRED.add(key)
    print(f"tm_slurm fault point {point} on {key[1]}: {mode}", flush=True)
    if mode == "kill":
        os.killpg(os.getpgrp(), signal.SIGKILL)
    elif mode == "hang":
        os.killpg(os.getpgrp(), signal.SIGSTOP)
    else:
        time.sleep(_seconds(mode))
