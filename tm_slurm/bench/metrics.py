"""What a benchmark run is worth, from its steps log (`steps.jsonl`: step, commit wall time).

downtime: the time the interruption cost the job = (time from the last commit before the event
  to the commit of the step `window` steps further) minus (those steps at the run's steady
  pace). A stall, a restart, steps redone from a checkpoint, slow first steps after a cold
  start: all of it shows up, once, whatever the strategy.
lost steps: committed steps that had to be done again (the in-flight step of a failure is lost
  for every strategy and not counted).
"""
from __future__ import annotations

import os
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Step:
    step: int
    wall: float
    dur_s: float


def pace(steps: list[Step], last: int = 15) -> float:
    """Median step time over the run's last `last` steps: long after the interruption, on a
    machine no longer shared with a standby's warm-up (on a cluster it has its own)."""
    durs = [s.dur_s for s in steps[-last:]]
    if len(durs) < 3:
        raise ValueError("too few steps after the interruption to know the steady pace")
    return statistics.median(durs)


def downtime(steps: list[Step], t_event: float, window: int = 6,
             t_done: float | None = None) -> tuple[float, dict]:
    """`steps` in commit order, possibly across a restart (a step committed twice: redone).
    Measured from the last commit before the event to the commit `window` steps later (or
    `window` steps after `t_done`, when the interruption was over: a planned swap with a cold
    joiner trains on through a long phase 1 and stalls only at its end): long enough to hold
    any recovery, short enough that the noise of the pace weighs on few steps."""
    before = [s for s in steps if s.wall <= t_event]
    if not before:
        raise ValueError("the event happened before the first step")
    p = pace(steps)
    last = max(before, key=lambda s: (s.step, s.wall))
    after = [s for s in steps if s.wall > t_event]
    if not after:
        raise ValueError("no step committed after the event")
    start = last.step
    if t_done is not None:
        start = max([start] + [s.step for s in after if s.wall <= t_done])
    # the first step logged at or past the window (a log can miss steps: a process that left
    # took its last report along)
    target = min((s.step for s in after if s.step >= start + window), default=max(s.step for s in after))
    t_k = max(s.wall for s in after if s.step == target)
    dt = (t_k - last.wall) - (target - last.step) * p
    redone = max(0, last.step + 1 - min(s.step for s in after))
    return dt, {"steady_step_s": p, "event_step": last.step, "window_to_step": target,
                "lost_steps": redone}


def percentile(xs: list[float], q: float) -> float:
    """The value at quantile q (0..1) of xs: the nearest of its own values, no interpolation."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def process_cpu(pid: int | None = None) -> float:
    """CPU seconds this process (or `pid`, a process of the same user) has spent, user and
    system, all its threads."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy(window: float = 0.5) -> float:
    """The share of this machine's CPU time that was busy over `window` seconds (0..1, /proc/stat)."""
    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]          # all, idle + iowait
    t0, i0 = read()
    time.sleep(window)
    t1, i1 = read()
    return 1 - (i1 - i0) / max(t1 - t0, 1)


def wait_quiet(most: float = 0.25, patience: float = 20.0) -> float:
    """Before a timed run on a shared machine: wait, up to `patience` seconds, until others use at
    most `most` of its CPU; returns the last share seen (for the record, whether it waited long
    enough or not)."""
    end = time.monotonic() + patience
    while True:
        busy = machine_busy()
        if busy <= most or time.monotonic() > end:
            return busy


def tree_cpu(root: int) -> dict[int, tuple[list[str], float]]:
    """{pid: (its argv, its CPU seconds)} of `root` and every process under it (of this user):
    what a job's processes have spent, from /proc. A process that ends meanwhile is left out."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                kids.setdefault(int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            out[pid] = (argv, process_cpu(pid))
        except (OSError, IndexError, ValueError):
            pass
    return out


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
