"""`tm-slurm bench --slurmctld`: what one job costs slurmctld, from `sdiag`'s RPC statistics.

Run inside a Slurm where `sdiag -r` is allowed (root or SlurmUser: the minicluster, `tm-slurm
minicluster run -- tm-slurm bench --slurmctld`), from the repository root (it submits
`sbatch/train.sbatch`). For each case one job of 5 nodes runs; once it is steady (a tm_slurm job:
its standby warm), the statistics are reset and read again `window` seconds later. Cases: the
cluster with no job, a plain job (`srun sleep` on every node), and tm_slurm jobs at each poll
setting. Per case: the RPCs a minute by message type and slurmctld's time on them (sdiag's
total_time, microseconds), and what tm_slurm adds to the plain job, by type (the slurmds' own
registrations, a fixed background whose time swings with this machine's load, left out).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .. import jobdir
from ..config import Slurm
from ..demo import TINY_MODEL

NODES = 5
# sdiag's own requests, and the reset, are the measurement, not the job
OWN = {"REQUEST_STATS_INFO", "REQUEST_STATS_RESET"}
BACKGROUND = {"MESSAGE_NODE_REGISTRATION_STATUS"}
_RPC = re.compile(r"^\s*([A-Z_0-9]+)\s+\(\s*\d+\)\s+count:(\d+)\s+ave_time:\d+\s+total_time:(\d+)")


@dataclass(frozen=True)
class Case:
    name: str
    sets: tuple[str, ...] = ()      # --set for `tm-slurm run` (a tm job)
    kind: str = "tm"                # tm | plain | idle


def cases(intervals=(1, 5, 30)) -> list[Case]:
    """The no-backoff poll at each interval (what every version before the backoff did: nodes
    and reservations every poll), then the defaults."""
    out = [Case("no job", kind="idle"), Case("plain job", kind="plain")]
    for s in intervals:
        out.append(Case(f"tm_slurm, every {s} s", (f"slurm.poll_interval_s={s}", f"slurm.poll_max_interval_s={s}",
                                                   f"slurm.reservation_poll_s={s}")))
    d = Slurm()
    out.append(Case(f"tm_slurm, defaults ({d.poll_interval_s:g} s, backoff to {d.poll_max_interval_s:g} s, "
                    f"reservations {d.reservation_poll_s:g} s)"))
    return out


def parse_sdiag(text: str) -> dict[str, tuple[int, int]]:
    """`sdiag` -> {message type: (count, total microseconds)}, the job's requests only."""
    out: dict[str, tuple[int, int]] = {}
    part = text.split("by message type", 1)[-1].split("by user", 1)[0]
    for line in part.splitlines():
        m = _RPC.match(line)
        if m and m.group(1) not in OWN:
            out[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return out


def per_minute(rpcs: dict[str, tuple[int, int]], window_s: float) -> dict:
    f = 60.0 / window_s
    by = {k: {"rpcs": round(c * f, 1), "time_us": round(t * f)} for k, (c, t) in sorted(rpcs.items())}
    return {"rpcs_per_min": round(sum(v["rpcs"] for v in by.values()), 1),
            "time_us_per_min": sum(v["time_us"] for v in by.values()), "by_type": by}


def _sh(*argv: str, check: bool = True) -> str:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p.stdout


def _state(job: str) -> str:
    out = _sh("scontrol", "show", "job", "-o", job, check=False)
    m = re.search(r"JobState=(\S+)", out)
    return m.group(1) if m else "GONE"


def _wait(what: str, ok, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > end:
            raise RuntimeError(f"{what} not within {timeout} s")
        time.sleep(0.5)


def _submit(case: Case, repo: Path, out: Path) -> tuple[str, Path | None]:
    if case.kind == "plain":
        job = _sh("sbatch", "--parsable", f"--nodes={NODES}", "--ntasks-per-node=1", f"--output={out}/%j.out",
                  "--wrap", "srun sleep 3600").strip().split(";")[0]
        _wait(f"plain job {job} running", lambda: _state(job) == "RUNNING", 60)
        time.sleep(5)                               # its step launched on every node
        return job, None
    env = dict(os.environ, GPT_STEPS="1000000", GPT_ARGS=" ".join([*TINY_MODEL, "--sleep", "0.05"]),
               TM_SLURM_ARGS=" ".join(f"--set {s}" for s in case.sets))
    p = subprocess.run(["sbatch", "--parsable", f"--output={out}/%j.out", "sbatch/train.sbatch"], cwd=repo,
                       env=env, capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"sbatch failed: {p.stderr.strip()}")
    job = p.stdout.strip().split(";")[0]
    d = repo / "tm_slurm_jobs" / job

    def warm() -> bool:
        try:
            st = json.loads(jobdir.status_file(d).read_text())
        except (OSError, ValueError):
            return False
        return st.get("state") == "RUNNING" and all(n["ready"] for n in st["nodes"].values())
    _wait(f"tm_slurm job {job} running with a warm standby", warm, 180)
    time.sleep(10)                                  # past the first polls' changes
    return job, d


def _cancel(job: str) -> None:
    _sh("scancel", job, check=False)
    _wait(f"job {job} gone", lambda: _state(job) in ("GONE", "CANCELLED", "COMPLETED", "FAILED"), 120)


def measure(out: Path, window_s: float = 60.0, intervals=(1, 5, 30), repo: Path | None = None,
            say=print) -> dict:
    repo = repo or Path.cwd()
    if not (repo / "sbatch" / "train.sbatch").exists():
        raise RuntimeError(f"run from the repository root (no sbatch/train.sbatch in {repo})")
    out.mkdir(parents=True, exist_ok=True)
    nodes = len(_sh("sinfo", "-h", "-N", "-o", "%N").split())
    rows = []
    for case in cases(intervals):
        job, d = (None, None) if case.kind == "idle" else _submit(case, repo, out)
        try:
            _sh("sdiag", "-r")
            time.sleep(window_s)
            got = per_minute(parse_sdiag(_sh("sdiag")), window_s)
        finally:
            if job:
                _cancel(job)
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        rows.append({"case": case.name, "kind": case.kind, "sets": list(case.sets), **got})
        say(f"  {case.name:60s} {got['rpcs_per_min']:7.1f} RPCs/min {got['time_us_per_min'] / 1e3:8.2f} ms/min")
    plain = next(r for r in rows if r["kind"] == "plain")["by_type"]
    for r in rows:
        if r["kind"] == "tm":
            # by type, the slurmds' own registrations left out: their time swings with the load
            # of this machine and says nothing about the job
            added = {k: (v["rpcs"] - plain.get(k, {}).get("rpcs", 0), v["time_us"] - plain.get(k, {}).get("time_us", 0))
                     for k, v in r["by_type"].items() if k not in BACKGROUND}
            r["added_rpcs_per_min"] = round(sum(max(0.0, n) for n, _ in added.values()), 1)
            r["added_time_us_per_min"] = sum(max(0, t) for _, t in added.values())
    return {"cluster_nodes": nodes, "job_nodes": NODES, "window_s": window_s, "cases": rows}


def table(res: dict) -> str:
    lines = [f"slurmctld cost per minute, a job of {res['job_nodes']} nodes on a cluster of "
             f"{res['cluster_nodes']} ({res['window_s']:.0f} s windows, sdiag)",
             f"{'case':60s} {'RPCs/min':>9s} {'ms/min':>8s} {'added RPCs':>10s} {'added ms':>9s}  types"]
    for r in res["cases"]:
        add = (f"{r['added_rpcs_per_min']:10.1f} {r['added_time_us_per_min'] / 1e3:9.2f}"
               if "added_rpcs_per_min" in r else f"{'':10s} {'':9s}")
        types = ", ".join(f"{k} {v['rpcs']:g}" for k, v in r["by_type"].items())
        lines.append(f"{r['case']:60s} {r['rpcs_per_min']:9.1f} {r['time_us_per_min'] / 1e3:8.2f} {add}  {types}")
    return "\n".join(lines)
