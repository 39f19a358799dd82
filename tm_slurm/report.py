"""`tm-slurm report`: what happened to a job, from its events.jsonl.

Prints every interruption (kind, node, cause, detection, stall, lost steps), the total downtime
and the GPU time saved against restarting the job each time, and draws a timeline PNG: one lane
per node coloured by its role over time, markers for the interruptions, and the job's state.

GPU time saved = sum over interruptions of (restart estimate - our stall) x the job's GPUs (its
ranks). The restart estimate is, in this order: --restart-estimate-s; the checkpoint-restart
downtime a `tm-slurm bench --json` file measured for that kind of interruption (--bench); the
TrainMover paper's restart of an 8,192-GPU job (Table 1: 6.47 min = stop 0.52 + reschedule 1.50
+ checkpoint load 1.56 + NCCL 1.09 + warm-up 1.80). The standbys' idle GPU time, the price of
the saving (the time nodes spent as STANDBY), is printed next to it.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from . import events as evlog
from . import jobdir
from .findjob import find_job
from .sim import PAPER_FRAMEWORK_INIT_S, PAPER_RESCHED_MIN, PAPER_STOP_MIN

PAPER_RESTART_S = round((PAPER_STOP_MIN + PAPER_RESCHED_MIN) * 60 + PAPER_FRAMEWORK_INIT_S, 1)  # 388.2

ROLE_COLORS = {"ACTIVE": "#2ca02c", "STANDBY": "#1f77b4", "LEAVING": "#ff7f0e",
               "JOINING": "#9467bd", "FAILED": "#d62728", "RELEASED": "#d9d9d9"}
# the job band in lighter shades, so it does not read as a node lane
STATE_COLORS = {"STARTING": "#eeeeee", "RUNNING": "#98df8a", "SWAPPING": "#ffbb78",
                "RECOVERING": "#ff9896", "STOPPING": "#c49c94", "FINISHED": "#7f7f7f",
                "REQUEUED": "#f7b6d2", "FAILED": "#67000d"}
# kind -> (matplotlib marker, colour, legend label)
MARKERS = {"slurm_event": ("D", "#555555", "Slurm node event"),
           "failure_detected": ("X", "#d62728", "failure detected"),
           "swap_complete": ("v", "black", "planned migration done"),
           "recovery_complete": ("*", "black", "recovery done")}


@dataclass
class Interruption:
    kind: str                  # planned | unplanned | restart
    node: str | None
    cause: str
    at_s: float                # since the job's first event
    detect_s: float | None     # event -> plan (planned), failure -> detection (unplanned)
    stall_s: float | None      # how long training stood still (None: not measured)
    lost_steps: int
    fallback: str | None = None


@dataclass
class Summary:
    job: str
    job_dir: str
    state: str
    duration_s: float
    gpus: int
    nodes: list[str]           # every node the job had, in order of appearance
    active: int                # at the start
    standbys: int
    gpus_per_node: int
    interruptions: list[Interruption]
    downtime_s: float
    restart_estimate_s: dict[str, float]
    restart_source: str
    saved_gpu_s: float
    standby_idle_gpu_s: float  # GPU time the nodes spent as STANDBY: the price of the saving
    not_measured: int


def role_changes(evs: list[dict], t0: float) -> dict[str, list[tuple[float, str]]]:
    """node -> [(seconds since t0, role it took then)], from node_role events."""
    out: dict[str, list[tuple[float, str]]] = {}
    for e in evs:
        if e["kind"] == "node_role":
            out.setdefault(e["node"], []).append((e["ts"] - t0, e["role"]))
    return out


def interruptions(evs: list[dict], t0: float) -> list[Interruption]:
    planned = {e.get("plan"): e for e in evs if e["kind"] == "swap_planned"}
    done_plans = {e.get("plan") for e in evs if e["kind"] == "swap_complete"}
    restarts = [e for e in evs if e["kind"] == "restart_planned"]
    out = []
    for e in evs:
        k = e["kind"]
        if k == "swap_complete":
            p = planned.get(e.get("plan"), e)
            out.append(Interruption("planned", e["node"], e.get("reason") or "", p["ts"] - t0,
                                    e.get("event_to_plan_s"), e.get("stall_s"), 0))
        elif k == "switch" and e.get("plan") not in done_plans:
            # the job ended (or failed over) before the steps that measure the stall
            p = planned.get(e.get("plan"), e)
            out.append(Interruption("planned", e["node"], p.get("reason") or "", p["ts"] - t0,
                                    None, None, 0))
        elif k == "recovery_complete":
            nodes = e.get("failed_nodes") or [e["node"]]
            fail = next((f for f in reversed(evs) if f["kind"] == "failure_detected"
                         and f["node"] in nodes and f["ts"] <= e["ts"]), e)
            cause = e.get("how") or ""
            if len(nodes) > 1:
                cause += f" ({', '.join(nodes)})"
            out.append(Interruption("unplanned", e["node"], cause, fail["ts"] - t0, e.get("detect_s"),
                                    e.get("stall_s"), int(e.get("lost_steps") or 0), e.get("fallback")))
        elif k == "restart_complete":
            p = next((r for r in reversed(restarts) if r["ts"] <= e["ts"]), e)
            stall = e.get("stall_s")
            if stall is None and e.get("phases"):
                stall = round(sum(v for v in e["phases"].values() if isinstance(v, (int, float))), 4)
            out.append(Interruption("restart", e["node"], p.get("reason") or "", p["ts"] - t0, None,
                                    stall, int(e.get("lost_steps") or 0), "restart"))
    return sorted(out, key=lambda i: i.at_s)


def bench_restart(path: str | Path) -> dict[str, float]:
    """checkpoint-restart downtime per scenario from `tm-slurm bench --json` output."""
    doc = json.loads(Path(path).read_text())
    out = {}
    for scenario, per in (doc.get("scenarios") or {}).items():
        v = (per or {}).get("checkpoint-restart", {}).get("downtime_s")
        if isinstance(v, dict):
            v = v.get("median", v.get("p50"))
        if isinstance(v, (int, float)):
            out[scenario] = float(v)
    return out


def summarize(job_dir: Path, restart_estimate_s: float | None = None,
              bench: str | Path | None = None) -> Summary:
    evs = list(evlog.read(jobdir.events_file(job_dir)))
    if not evs:
        raise ValueError(f"no events in {jobdir.events_file(job_dir)}")
    t0, t1 = evs[0]["ts"], evs[-1]["ts"]
    starts = [e for e in evs if e["kind"] == "job_start"]
    layout = (starts[-1].get("layout") if starts else None) or {}
    gpus = int(layout.get("dp", 1)) * int(layout.get("pp", 1)) * int(layout.get("tp", 1))
    states = [e for e in evs if e["kind"] in ("job_end", "job_state")]
    roles = role_changes(evs, t0)
    t_start = (starts[0]["ts"] if starts else t0) - t0
    at_start = {n: ch[0][1] for n, ch in roles.items() if ch[0][0] <= t_start}
    per_node = int(layout.get("ranks_per_node", 1))
    standby_s = sum(w for ch in roles.values() for _, w, r in _spans(ch, t1 - t0) if r == "STANDBY")
    ints = interruptions(evs, t0)

    if restart_estimate_s is not None:
        est, source = {}, f"--restart-estimate-s {restart_estimate_s:g}"
    elif bench is not None:
        est = bench_restart(bench)
        source = (f"checkpoint-restart measured by tm-slurm bench ({bench}); the paper's "
                  f"{PAPER_RESTART_S:g} s where it measured none")
    else:
        est, source = {}, "TrainMover paper, Table 1: a restart at 8,192 GPUs takes 6.47 min"
    default = restart_estimate_s if restart_estimate_s is not None else PAPER_RESTART_S
    per_kind = {k: est.get(k, default) for k in ("planned", "unplanned")}
    measured = [i for i in ints if i.stall_s is not None and i.kind != "restart"]
    saved = sum(max(0.0, per_kind[i.kind] - i.stall_s) for i in measured) * gpus
    return Summary(
        job=str(evs[0].get("job")), job_dir=str(job_dir),
        state=states[-1]["state"] if states else "UNKNOWN", duration_s=t1 - t0, gpus=gpus,
        nodes=list(roles), active=sum(r == "ACTIVE" for r in at_start.values()),
        standbys=sum(r == "STANDBY" for r in at_start.values()), gpus_per_node=per_node, interruptions=ints,
        downtime_s=round(sum(i.stall_s or 0.0 for i in ints), 4), restart_estimate_s=per_kind,
        restart_source=source, saved_gpu_s=round(saved, 1),
        standby_idle_gpu_s=round(standby_s * per_node, 1),
        not_measured=sum(i.stall_s is None for i in ints))


def _s(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f} s"


def render(s: Summary, png: str | None) -> str:
    lines = [f"job {s.job}: {s.state} after {s.duration_s:.1f} s  ({s.job_dir})",
             f"  {s.gpus} GPUs (ranks); at the start {s.active} active + {s.standbys} standby nodes"
             + (f", {len(s.nodes)} nodes in all" if len(s.nodes) != s.active + s.standbys else "")]
    if s.interruptions:
        lines.append(f"interruptions ({len(s.interruptions)}):")
        lines.append(f"  {'at':>9}  {'kind':<9}  {'node':<8}  {'cause':<34}  {'detect':>9}  "
                     f"{'stall':>9}  lost")
        for i in s.interruptions:
            cause = i.cause + (f" [fallback: {i.fallback}]" if i.fallback and i.kind != "restart" else "")
            lines.append(f"  {f'+{i.at_s:.1f}s':>9}  {i.kind:<9}  {i.node or '-':<8}  {cause[:34]:<34}  "
                         f"{_s(i.detect_s, 2):>9}  {_s(i.stall_s):>9}  {i.lost_steps}")
    else:
        lines.append("interruptions: none")
    lines.append(f"total downtime: {s.downtime_s:.3f} s"
                 + (f" ({s.not_measured} not measured: the job ended within the measuring window)"
                    if s.not_measured else ""))
    est = s.restart_estimate_s
    lines.append(f"restart estimate: planned {est['planned']:.1f} s, unplanned {est['unplanned']:.1f} s "
                 f"({s.restart_source})")
    lines.append(f"GPU time saved vs restarting: {s.saved_gpu_s / 3600:.3f} GPU-h ({s.saved_gpu_s:.0f} "
                 f"GPU-s over {s.gpus} GPUs); standbys held idle: {s.standby_idle_gpu_s / 3600:.3f} GPU-h")
    if png:
        lines.append(f"timeline: {png}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the timeline picture

def _spans(changes: list[tuple[float, str]], t_end: float) -> list[tuple[float, float, str]]:
    return [(t, (changes[i + 1][0] if i + 1 < len(changes) else t_end) - t, v)
            for i, (t, v) in enumerate(changes)]


def plot(job_dir: Path, s: Summary, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    evs = list(evlog.read(jobdir.events_file(job_dir)))
    t0, t_end = evs[0]["ts"], evs[-1]["ts"]
    roles = role_changes(evs, t0)
    states: list[tuple[float, str]] = []
    for e in evs:
        if e["kind"] == "job_start":
            states.append((e["ts"] - t0, "STARTING"))
        elif e["kind"] == "job_state":
            states.append((e["ts"] - t0, e["state"]))
    end = t_end - t0
    lanes = list(reversed(list(roles)))                     # first node on top, under the job band
    y = {n: i for i, n in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * (len(lanes) + 1)))
    for n, ch in roles.items():
        ax.broken_barh([(a, w) for a, w, _ in _spans(ch, end)], (y[n] - 0.35, 0.7),
                       facecolors=[ROLE_COLORS.get(r, "#ffffff") for *_, r in _spans(ch, end)])
    top = len(lanes)
    ax.broken_barh([(a, w) for a, w, _ in _spans(states, end)], (top - 0.2, 0.6),
                   facecolors=[STATE_COLORS.get(v, "#ffffff") for *_, v in _spans(states, end)])
    for kind, (marker, color, _) in MARKERS.items():
        pts = [(e["ts"] - t0, y[e["node"]]) for e in evs if e["kind"] == kind and e.get("node") in y]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, color=color, s=70, zorder=3,
                       edgecolors="white", linewidths=0.6)
    ax.set_yticks(range(top + 1), lanes + ["job"])
    ax.set_ylim(-0.7, top + 0.7)
    ax.set_xlim(0, max(end, 1e-3))
    ax.set_xlabel("seconds since the job's first event")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"job {s.job}: {s.state}, {len(s.interruptions)} interruption(s), "
                 f"downtime {s.downtime_s:.2f} s", fontsize=10)
    shown_states = {v for _, v in states}
    handles = ([Patch(color=c, label=r.lower()) for r, c in ROLE_COLORS.items()]
               + [Patch(color=c, label=f"job {v.lower()}") for v, c in STATE_COLORS.items() if v in shown_states]
               + [Line2D([], [], marker=m, color=c, linestyle="", label=lab) for m, c, lab in MARKERS.values()])
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---------------------------------------------------------------- CLI

def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", help="a job's interruptions, downtime, GPU time saved, timeline PNG",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", help="job directory or id (default: the newest under ./tm_slurm_jobs)")
    p.add_argument("--png", help="where to write the timeline (default: <job dir>/timeline.png)")
    p.add_argument("--no-png", action="store_true", help="text summary only (no matplotlib needed)")
    p.add_argument("--restart-estimate-s", type=float, metavar="S",
                   help=f"downtime of one restart (default: {PAPER_RESTART_S:g} s, the paper's)")
    p.add_argument("--bench", metavar="FILE", help="take the restart estimate from `tm-slurm bench --json`")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(fn=main)
    return p


def main(args) -> int:
    job = find_job(args.job)
    try:
        s = summarize(job, args.restart_estimate_s, args.bench)
    except (ValueError, OSError) as e:
        print(f"tm-slurm report: {e}", file=sys.stderr)
        return 2
    png = None
    if not args.no_png:
        try:
            png = str(plot(job, s, Path(args.png) if args.png else job / "timeline.png"))
        except ImportError:
            print("tm-slurm report: matplotlib is not installed (pip install 'tm-slurm[plot]'); "
                  "no timeline drawn (--no-png skips it)", file=sys.stderr)
    if args.json:
        print(json.dumps(dict(asdict(s), timeline=png), indent=1))
    else:
        print(render(s, png))
    return 0
