"""`tm-slurm evacuate NODES --reason R --deadline S`: drain with evacuation.

Drains the nodes in Slurm, asks every tm_slurm job on them to move off at once (a request file
is seen within 50 ms; the job's own Slurm poll would take up to slurm.poll_interval_s), then
waits until each such job has given its nodes back and every node is DRAINED, or the deadline
passes. Either way the Slurm drain stays: after the deadline Slurm drains the node the usual way,
when the jobs left on it end.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import jobdir
from ..slurm import SlurmError, backend_for, hostlist
from . import userfiles
from .jobs import RunningJob, affected, ask, privilege_note, running_jobs

POLL_S = 0.25           # events and node states
SQUEUE_EVERY_S = 1.0    # the allocation check is the fallback to the events: one squeue a second
EVENTS_PER_POLL = 1 << 20

# per (job, node): where the move stands; the job is off the node only in a DONE one
MOVED_OFF = "moved_off"
JOB_ENDED = "job_ended"              # done as well: the node left with the job
PENDING = "pending"                  # asked, no answer yet
MOVING = "moving"                    # swap planned
NO_STANDBY = "no_standby"            # drain_deferred: waits for a READY standby
REJECTED = "rejected"
BATCH_HOST = "batch_host"            # ranks moved, but Slurm cannot take the batch host from a job
FAILED = "failed"
RELEASE_FAILED = "release_failed"
NOT_TM = "not_tm_slurm"
NOT_TM_DETAIL = "not a tm_slurm job: the drain waits for it to end"
DONE = frozenset({MOVED_OFF, JOB_ENDED})


@dataclass
class Move:
    status: str
    detail: str = ""
    at: float | None = None          # wall clock of the event that set the status


@dataclass
class Tracked:
    job: RunningJob
    moves: dict[str, Move]           # node -> where its move stands
    offset: int = 0                  # how far events.jsonl has been read
    stall_s: dict[str, float] = field(default_factory=dict)


def read_new_events(job_dir: Path, offset: int) -> tuple[list[dict], int]:
    """Complete lines of the job's events.jsonl after `offset`, at most EVENTS_PER_POLL bytes
    (a line being written is left for later; a line that is not an event object is skipped)."""
    try:
        data = userfiles.read(job_dir, jobdir.events_file(job_dir).name, EVENTS_PER_POLL, offset)
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    if end == 0 and len(data) == EVENTS_PER_POLL:
        end = len(data)             # one line longer than a poll's read: no event of ours, skip it
    out = []
    for line in data[:end].splitlines():
        try:
            e = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(e, dict):
            out.append(e)
    return out, offset + end


def apply_event(t: Tracked, e: dict, since: float) -> None:
    """Move a (job, node) along by one event of the job's log."""
    node = e.get("node")
    if node not in t.moves or e.get("ts", 0.0) < since:
        return
    m, kind, ts = t.moves[node], e.get("kind"), e.get("ts")
    if kind == "swap_complete" and e.get("stall_s") is not None:
        t.stall_s[node] = e["stall_s"]       # measured after the node was given back
    if m.status in DONE:
        return
    if kind == "node_released":
        result = str(e.get("result", ""))
        if result.startswith("released"):
            t.moves[node] = Move(MOVED_OFF, result, ts)
        elif result.startswith("kept"):
            t.moves[node] = Move(BATCH_HOST, "ranks moved off; the batch host stays in the job "
                                             "until it ends (Slurm cannot remove it from a job)", ts)
        else:
            t.moves[node] = Move(RELEASE_FAILED, result, ts)
    elif kind == "swap_planned":
        t.moves[node] = Move(MOVING, f"migration to {e.get('joiner')} in progress", ts)
    elif kind == "drain_deferred":
        t.moves[node] = Move(NO_STANDBY, f"no standby ({e.get('why', 'drain_deferred')}); the "
                                         "job moves off as soon as one is READY", ts)
    elif kind == "request_rejected":
        t.moves[node] = Move(REJECTED, f"request rejected: {e.get('why')}", ts)
    elif kind == "swap_cancelled" and m.status == MOVING:
        t.moves[node] = Move(PENDING, f"swap cancelled ({e.get('why')}); the job retries", ts)
    elif kind == "failure_detected":
        t.moves[node] = Move(FAILED, f"the node failed during the evacuation ({e.get('how')}); "
                                     "the job recovers on a standby", ts)


class Evacuation:
    """One evacuation, separated from the CLI so tests can drive it with fake Slurm."""

    def __init__(self, nodes: Sequence[str], reason: str, deadline_s: float, *, backend,
                 list_jobs: Callable[[Sequence[str] | None], list[RunningJob]] | None = None,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep):
        self.nodes = list(dict.fromkeys(nodes))
        self.reason, self.deadline_s = reason, deadline_s
        self.backend, self.list_jobs = backend, list_jobs or running_jobs
        self.clock, self.sleep = clock, sleep
        self.tracked: dict[str, Tracked] = {}
        self.others: dict[str, tuple[RunningJob, list[str]]] = {}
        self.states: dict = {}
        self.t0 = 0.0
        self.requests_failed: list[str] = []
        self._next_squeue = 0.0

    def start(self) -> None:
        known = self.backend.nodes(self.nodes)
        unknown = [n for n in self.nodes if n not in known]
        if unknown:
            raise SlurmError(f"unknown node(s) {hostlist.compress(unknown)}: Slurm does not know "
                             f"them (check `sinfo -N`)")
        self.t0 = self.clock()
        self.backend.drain(self.nodes, self.reason)
        for job, held in affected(self.list_jobs(self.nodes), self.nodes):
            if job.job_dir is None:
                self.others[job.job_id] = (job, held)
                continue
            t = Tracked(job, {n: Move(PENDING, "asked to move off") for n in held})
            try:
                ask(job, "drain", held, f"evacuate: {self.reason}", "evacuate")
            except OSError as e:          # the drain still reaches the job through Slurm
                self.requests_failed.append(f"job {job.job_id}: request not written ({e}); "
                                            "it reacts to the Slurm drain instead")
            self.tracked[job.job_id] = t

    def poll(self) -> bool:
        """Refresh everything once; True when all is done."""
        for t in self.tracked.values():
            evs, t.offset = read_new_events(t.job.job_dir, t.offset)
            for e in evs:
                apply_event(t, e, self.t0 - 0.5)
        pending = [t for t in self.tracked.values() if any(m.status not in DONE for m in t.moves.values())]
        if pending and self.clock() >= self._next_squeue:
            self._next_squeue = self.clock() + SQUEUE_EVERY_S
            # every running job, not only those on the nodes: one that left them is still running
            still = {j.job_id: j for j in self.list_jobs(None)}
            for t in pending:
                now_on = still.get(t.job.job_id)
                for n, m in t.moves.items():
                    if m.status in DONE:
                        continue
                    if now_on is None:
                        t.moves[n] = Move(JOB_ENDED, "the job ended", self.clock())
                    elif n not in now_on.nodes and m.status != BATCH_HOST:
                        t.moves[n] = Move(MOVED_OFF, "no longer in the job's allocation", self.clock())
        self.states = self.backend.nodes(self.nodes)
        return self.ok()

    def ok(self) -> bool:
        return (all(m.status in DONE for t in self.tracked.values() for m in t.moves.values())
                and all(s.drained for s in self.states.values()) and len(self.states) == len(self.nodes))

    def run(self) -> bool:
        self.start()
        end = self.t0 + self.deadline_s
        while not self.poll() and self.clock() < end:
            self.sleep(POLL_S)
        return self.ok()

    # ------------------------------------------------------------ the report
    def report(self) -> dict:
        elapsed = self.clock() - self.t0
        jobs = []
        for t in self.tracked.values():
            jobs.append({"job_id": t.job.job_id, "user": t.job.user, "tm_slurm": True,
                         "job_dir": str(t.job.job_dir),
                         "nodes": {n: {"status": m.status, "detail": m.detail,
                                       "after_s": round(m.at - self.t0, 3) if m.at else None,
                                       "stall_s": t.stall_s.get(n)}
                                   for n, m in t.moves.items()}})
        for job, held in self.others.values():
            jobs.append({"job_id": job.job_id, "user": job.user, "tm_slurm": False, "job_dir": None,
                         "nodes": {n: {"status": NOT_TM, "detail": NOT_TM_DETAIL, "after_s": None,
                                       "stall_s": None} for n in held}})
        nodes = {n: {"state": s.state_string if s else "UNKNOWN", "drained": bool(s and s.drained)}
                 for n in self.nodes for s in [self.states.get(n)]}
        ok = self.ok()
        note = None if ok else (
            f"deadline of {self.deadline_s:g} s passed: the drain stays in place, and Slurm makes "
            f"{hostlist.compress([n for n, v in nodes.items() if not v['drained']] or self.nodes)} "
            "DRAINED when the jobs left on it end")
        return {"ok": ok, "nodes_asked": hostlist.compress(self.nodes), "reason": self.reason,
                "deadline_s": self.deadline_s, "elapsed_s": round(elapsed, 3), "nodes": nodes,
                "jobs": jobs, "warnings": self.requests_failed, "note": note}


def render(rep: dict) -> str:
    tm = sum(j["tm_slurm"] for j in rep["jobs"])
    lines = [f"evacuate {rep['nodes_asked']} (reason: {rep['reason']}): drained in Slurm; "
             f"{len(rep['jobs'])} running job(s) on them, {tm} tm_slurm"]
    for j in rep["jobs"]:
        who = f"job {j['job_id']} ({j['user']}{', tm_slurm' if j['tm_slurm'] else ''})"
        for n, v in j["nodes"].items():
            if v["status"] == MOVED_OFF:
                what = f"moved off {n} after {v['after_s']:.2f} s ({v['detail']})"
                if v["stall_s"] is not None:
                    what += f", training stalled {v['stall_s']:.3f} s"
            elif v["status"] == JOB_ENDED:
                what = f"left {n}: {v['detail']}"
            elif v["status"] == NOT_TM:
                what = f"still running on {n}: {v['detail']}"
            else:
                what = f"still running on {n}: {v['detail'] or v['status']}"
                if v["status"] in (PENDING, MOVING):
                    what += " (timed out)"
            lines.append(f"  {who}: {what}")
    for w in rep["warnings"]:
        lines.append(f"  warning: {w}")
    for n, v in rep["nodes"].items():
        lines.append(f"  {n}: {v['state']} ({'DRAINED' if v['drained'] else 'not drained yet'})")
    if rep["ok"]:
        lines.append(f"done in {rep['elapsed_s']:.2f} s: every tm_slurm job moved off and every node "
                     "is DRAINED")
    else:
        lines.append(rep["note"])
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI

def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "evacuate", help="admin: drain nodes and wait until tm_slurm jobs have moved off them",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("nodes", help="a Slurm hostlist, e.g. node3 or gpu[010-013]")
    p.add_argument("--reason", required=True, help="the drain reason Slurm records")
    p.add_argument("--deadline", type=float, default=300.0, metavar="SECONDS",
                   help="how long to wait for the jobs to move off (default 300; 0: do not wait)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(fn=main)
    return p


def main(args) -> int:
    nodes = hostlist.expand(args.nodes)
    if not nodes:
        print(f"tm-slurm evacuate: no nodes in {args.nodes!r}", file=sys.stderr)
        return 2
    if args.deadline < 0:
        print("tm-slurm evacuate: --deadline must be >= 0", file=sys.stderr)
        return 2
    note = privilege_note()
    if note:
        print(f"tm-slurm evacuate: note: {note}", file=sys.stderr)
    ev = Evacuation(nodes, args.reason, args.deadline, backend=backend_for("auto"))
    try:
        ev.run()
    except SlurmError as e:
        hint = ""
        if "permission" in str(e).lower() or "invalid user" in str(e).lower():
            hint = " (draining needs root, SlurmUser or a Slurm operator/admin)"
        print(f"tm-slurm evacuate: {e}{hint}", file=sys.stderr)
        return 2
    rep = ev.report()
    print(json.dumps(rep, indent=1) if args.json else render(rep))
    return 0 if rep["ok"] else 1
