"""`tm-slurm sim --trace/--gaps`: the discrete-event version of the scale projection (issue 16).

A seeded run draws W weeks of interruptions for a job of N GPUs (from the Llama 3 report's breakdown
by cause, from the analytic model's MTTF, or replayed from a trace file) and plays the same event
stream through every recovery strategy (common random numbers: the comparisons are paired per
seed). Over it: switch failures that take several nodes at once, nodes that fail again within a
day, hangs found only after a detection timeout, a standby pool of K nodes whose used members come
back after a drawn queue wait, drawn requeue waits, and checkpoints written at the Young/Daly
interval. Per-event downtimes and lost steps are the analytic model's (`sim._event_cost`), so the
two agree when the variability is switched off (tests/test_simdes.py).

Events are handled one after another: one that arrives while the job is down starts its own
recovery when the current one ends (it extends the outage).
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from .config import Timeouts
from .sim import HOURS_PER_WEEK, Params, StrategyInputs, _event_cost, default_params, mttf_h, pick_standbys

# ---------------------------------------------------------------- the Llama 3 trace
# "The Llama 3 Herd of Models" (2024), Sec. 3.3.4 and Table 5: 54 days of pre-training on 16,384
# H100 GPUs, 466 interruptions: 47 planned (automated maintenance such as firmware upgrades,
# operator-initiated configuration or dataset updates) and 419 unexpected, by root cause.
LLAMA3_DAYS, LLAMA3_GPUS = 54, 16384
# (cause, count, kind): "switch" takes several nodes at once; "hang" is found only by a timeout
# (the report: NCCL watchdog timeouts, and software bugs that stall collectives); the rest take
# one node down hard. "Host maintenance" is the report's *unplanned* host maintenance.
LLAMA3_CAUSES = (
    ("faulty GPU", 148, "unplanned"), ("GPU HBM3 memory", 72, "unplanned"), ("software bug", 54, "hang"),
    ("network switch/cable", 35, "switch"), ("host maintenance", 32, "unplanned"),
    ("GPU SRAM memory", 19, "unplanned"), ("GPU system processor", 17, "unplanned"), ("NIC", 7, "unplanned"),
    ("NCCL watchdog timeouts", 7, "hang"), ("silent data corruption", 6, "unplanned"),
    ("GPU thermal interface + sensor", 6, "unplanned"), ("SSD", 3, "unplanned"), ("power supply", 3, "unplanned"),
    ("server chassis", 2, "unplanned"), ("IO expansion board", 2, "unplanned"), ("dependency", 2, "unplanned"),
    ("CPU", 2, "unplanned"), ("system memory", 2, "unplanned"),
    ("planned maintenance", 47, "planned"),
)
TRACES = {"llama3": LLAMA3_CAUSES}
GAPS = ("exponential", "weibull")
KINDS = ("planned", "unplanned", "hang")
# The runtime's steady overhead when neither --overhead nor --from-bench gives one. Assumed: the +7.7 %
# bench measured on this 2-core machine shares its cores with the controller and agents, so it is not
# the figure at scale (README, "Steady-state overhead").
ASSUMED_OVERHEAD = 0.02


@dataclass(frozen=True)
class DESConfig:
    trace: str | None = "llama3"         # a TRACES name, a trace file, or None: the analytic model's MTTF
    gaps: str = "exponential"            # gaps between generated events, same mean rate either way
    weibull_shape: float = 0.7           # assumed; HPC node failures fit 0.7-0.8 (Schroeder & Gibson 2006)
    weeks: float = 4.0
    seeds: int = 20
    seed: int = 0
    ckpt_write_s: float = 60.0           # assumed: a blocking checkpoint write of the whole job
    ckpt_interval_s: float | None = None  # None: Young/Daly, sqrt(2 * write * MTTF of the job)
    switch_nodes: tuple[int, int] = (1, 4)  # assumed: a cable takes 1 node, a leaf switch its rack (4)
    repeat_p: float = 0.1                # assumed: share of failures followed by the same node again...
    repeat_window_h: float = 24.0        # ...within this (uniform); taken out of the trace's own rate
    waits: str = "exponential"           # queue and replenish waits: "exponential" (that mean) | "fixed"
    # Hang detection. tm_slurm: every collective's deadline (the runtime's hang backstop); restart
    # strategies: PyTorch's default NCCL watchdog timeout (10 min), assumed in use.
    hang_detect_tm_s: float = Timeouts().collective_timeout_s
    hang_detect_restart_s: float = 600.0


@dataclass(frozen=True)
class Event:
    t: float                  # seconds from the start
    kind: str                 # planned | unplanned | hang
    nodes: int                # nodes lost at once
    wait: float               # the queue wait, in units of its mean
    replenish: tuple[float, ...]  # per node: the standby's replacement wait, in units of its mean


# ---------------------------------------------------------------- event sources

def young_daly(write_s: float, mttf_s: float) -> float:
    """First-order optimal checkpoint interval (Young 1974, Daly 2006)."""
    return math.sqrt(2 * write_s * mttf_s)


def event_classes(params: Params, cfg: DESConfig, gpus: int) -> list[tuple[str, str, float]]:
    """(cause, kind, events per hour for this job) of a generated stream."""
    if cfg.trace is None:
        m = mttf_h(params, gpus)
        return [("unplanned", "unplanned", (1 - params.hang_fraction) / m), ("hang", "hang", params.hang_fraction / m),
                ("planned", "planned", 1 / m / params.unplanned_per_planned)]
    scale = gpus / LLAMA3_GPUS / (LLAMA3_DAYS * 24)
    return [(cause, kind, n * scale) for cause, n, kind in TRACES[cfg.trace]]


def load_trace(path: str | Path) -> list[tuple[float, str, int]]:
    """A trace file: JSON (a list, or {"events": [...]}, of {time_h, kind, nodes}) or CSV with
    those columns. Errors name the line (CSV) or the event's index (JSON)."""
    text = Path(path).read_text()
    if Path(path).suffix.lower() == ".json":
        doc = json.loads(text)
        rows = doc.get("events") if isinstance(doc, dict) else doc
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a list of events or {{\"events\": [...]}}")
        where = [f"{path}: event {i}" for i in range(len(rows))]
    else:
        rows = list(csv.DictReader(text.splitlines()))
        where = [f"{path}: line {i + 2}" for i in range(len(rows))]
    out = []
    for w, r in zip(where, rows):
        try:
            t, kind, nodes = float(r["time_h"]), str(r["kind"]).strip(), int(r.get("nodes") or 1)
        except (TypeError, KeyError, ValueError, AttributeError):
            raise ValueError(f"{w}: expected time_h (number), kind and nodes (integer), got {r!r}") from None
        if kind not in KINDS or nodes < 1 or not t >= 0:
            raise ValueError(f"{w}: kind must be one of {', '.join(KINDS)}, nodes >= 1, time_h >= 0; got {r!r}")
        out.append((t * 3600, kind, nodes))
    return sorted(out)


def _gap(rng: random.Random, mean: float, cfg: DESConfig) -> float:
    if cfg.gaps == "weibull":
        return rng.weibullvariate(mean / math.gamma(1 + 1 / cfg.weibull_shape), cfg.weibull_shape)
    return rng.expovariate(1 / mean)


def _event(rng: random.Random, cfg: DESConfig, t: float, kind: str, nodes: int) -> Event:
    draw = (lambda: rng.expovariate(1.0)) if cfg.waits == "exponential" else (lambda: 1.0)
    return Event(t, kind, nodes, draw(), tuple(draw() for _ in range(nodes)))


def generate(classes, cfg: DESConfig, horizon_s: float, rng: random.Random) -> list[Event]:
    """One seed's events. Repeats are part of the trace's failure count, so fresh failures arrive at
    rate / (1 + repeat_p) and the total stays the trace's."""
    fresh = [(kind, r / (1 + cfg.repeat_p) if kind != "planned" else r) for _, kind, r in classes]
    total = sum(r for _, r in fresh)
    out: list[Event] = []
    t = 0.0
    while total > 0:
        t += _gap(rng, 3600 / total, cfg)
        if t >= horizon_s:
            break
        kind = rng.choices([k for k, _ in fresh], [r for _, r in fresh])[0]
        nodes = rng.randint(*cfg.switch_nodes) if kind == "switch" else 1
        out.append(_event(rng, cfg, t, "unplanned" if kind == "switch" else kind, nodes))
        if kind != "planned" and rng.random() < cfg.repeat_p:
            again = t + rng.uniform(0, cfg.repeat_window_h * 3600)
            if again < horizon_s:
                out.append(_event(rng, cfg, again, "unplanned", 1))
    return sorted(out, key=lambda e: e.t)


def failure_mttf_s(classes, trace_events, horizon_s: float) -> float:
    """Mean time between the job's failures (planned events give notice: not counted)."""
    if trace_events is not None:
        n = sum(1 for t, kind, _ in trace_events if kind != "planned" and t < horizon_s)
        return horizon_s / n if n else math.inf
    rate = sum(r for _, kind, r in classes if kind != "planned")
    return 3600 / rate if rate > 0 else math.inf


def checkpoint_interval(params: Params, cfg: DESConfig, mttf_s: float) -> float:
    """Given (--ckpt-interval-min), else Young/Daly; with a free write or no failures, the
    analytic model's interval."""
    if cfg.ckpt_interval_s:
        return cfg.ckpt_interval_s
    if cfg.ckpt_write_s > 0 and math.isfinite(mttf_s):
        return young_daly(cfg.ckpt_write_s, mttf_s)
    return params.ckpt_interval_s


# ---------------------------------------------------------------- one strategy over one seed

def _costs(params: Params, cfg: DESConfig, name: str, st: StrategyInputs) -> dict[str, dict[str, float]]:
    detect = cfg.hang_detect_tm_s if name.startswith("tm_slurm") else cfg.hang_detect_restart_s
    p = dataclasses.replace(params, hang_detect_s=detect)
    return {sc: _event_cost(p, st, sc) for sc in KINDS}


def play(params: Params, cfg: DESConfig, name: str, events: list[Event], horizon_s: float,
         ckpt_interval_s: float) -> dict:
    """Wasted seconds (of the whole job) of one strategy over one event stream."""
    st = params.strategies[name]
    fallback = params.strategies["tm_slurm-no-standby"]
    own, cold = _costs(params, cfg, name, st), _costs(params, cfg, name, fallback)
    ckpt = "checkpoint" in st.state_from.values()
    write = cfg.ckpt_write_s if ckpt else 0.0
    cycle = ckpt_interval_s + write
    ready = [0.0] * (st.standby_nodes if name == "tm_slurm" else 0)   # when each standby is warm
    w = {"downtime": 0.0, "lost_work": 0.0, "checkpoint": 0.0}
    since_ckpt = down_until = trained = 0.0
    needs = misses = n_events = 0

    def train(until: float) -> None:
        nonlocal since_ckpt, trained
        dt = until - down_until
        trained += dt
        if ckpt:
            done, since_ckpt = divmod(since_ckpt + dt, cycle)
            w["checkpoint"] += done * write

    for ev in events:
        start = max(ev.t, down_until)
        if start >= horizon_s:
            break
        if ev.t > down_until:
            train(ev.t)
        n_events += 1
        cost, path = own[ev.kind], st
        if name == "tm_slurm" and ev.kind != "planned":
            needs += 1
            free = [i for i, r in enumerate(ready) if r <= start]
            if len(free) >= ev.nodes:
                for i, u in zip(free, ev.replenish):
                    ready[i] = start + u * params.standby_replenish_s
            else:                                       # too few warm standbys: the cold path
                misses += 1
                cost, path = cold[ev.kind], fallback
        if path.state_from[ev.kind] == "checkpoint":
            if ev.kind == "planned":
                w["checkpoint"] += write                # saved on notice: nothing redone
            elif params.count_lost_work:
                w["lost_work"] += since_ckpt            # everything since the last complete write
            since_ckpt = 0.0
        else:
            w["lost_work"] += cost["lost_work"]
        down = cost["downtime"] + (ev.wait * params.rescheduling_s if cost["rescheduling"] else 0.0)
        w["downtime"] += min(start + down, horizon_s) - start
        down_until = start + down
    if down_until < horizon_s:
        train(horizon_s)
    o = params.runtime_overhead if name.startswith("tm_slurm") else 0.0
    w["overhead"] = trained * o / (1 + o)
    return {"waste_s": w, "events": n_events, "needs": needs, "misses": misses, "standby_nodes": len(ready)}


def _summary(params: Params, r: dict, gpus: int, horizon_s: float, weeks: float) -> dict:
    standby_gpus = r["standby_nodes"] * params.gpus_per_node
    job = sum(r["waste_s"].values())
    parts = {k: gpus * v / 3600 / weeks for k, v in r["waste_s"].items()}
    parts["standby"] = standby_gpus * horizon_s / 3600 / weeks
    parts["total"] = sum(parts.values())
    return {"ettr": max(0.0, gpus * (horizon_s - job) / ((gpus + standby_gpus) * horizon_s)),
            "waste_gpu_h_per_week": parts["total"], "wasted_gpu_hours_per_week": parts,
            "events_per_week": r["events"] / weeks, "needs": r["needs"], "misses": r["misses"]}


# ---------------------------------------------------------------- seeds, confidence intervals

def _ci(xs: list[float]) -> list[float]:
    """Normal-approximation 95 % interval of the mean over seeds."""
    m = statistics.fmean(xs)
    h = 1.96 * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0
    return [m - h, m + h]


def simulate(params: Params, cfg: DESConfig, gpus: int, strategies=None) -> dict:
    """Every strategy over cfg.seeds seeds of the same event streams; means and 95 % intervals."""
    names = list(strategies or params.strategies)
    horizon = cfg.weeks * HOURS_PER_WEEK * 3600
    file_events = None if cfg.trace is None or cfg.trace in TRACES else load_trace(cfg.trace)
    classes = [] if file_events is not None else event_classes(params, cfg, gpus)
    mttf = failure_mttf_s(classes, file_events, horizon)
    interval = checkpoint_interval(params, cfg, mttf)
    runs = []
    for s in range(cfg.seed, cfg.seed + cfg.seeds):
        rng = random.Random(s)
        evs = ([_event(rng, cfg, t, k, n) for t, k, n in file_events] if file_events is not None
               else generate(classes, cfg, horizon, rng))
        runs.append({n: _summary(params, play(params, cfg, n, evs, horizon, interval), gpus, horizon, cfg.weeks)
                     for n in names})
    out: dict = {}
    for n in names:
        rows = [r[n] for r in runs]
        s = {k: statistics.fmean(x[k] for x in rows) for k in ("ettr", "waste_gpu_h_per_week", "events_per_week")}
        s.update(ettr_ci=_ci([x["ettr"] for x in rows]), waste_ci=_ci([x["waste_gpu_h_per_week"] for x in rows]),
                 wasted_gpu_hours_per_week={k: statistics.fmean(x["wasted_gpu_hours_per_week"][k] for x in rows)
                                            for k in rows[0]["wasted_gpu_hours_per_week"]})
        needs = sum(x["needs"] for x in rows)
        s["standby_miss_rate"] = sum(x["misses"] for x in rows) / needs if needs else None
        if needs:
            s["standby_miss_rate_ci"] = _ci([x["misses"] / x["needs"] if x["needs"] else 0.0 for x in rows])
            s["standby_misses_per_week"] = sum(x["misses"] for x in rows) / len(rows) / cfg.weeks
        out[n] = s
    doc = {"model": "discrete-event", "gpus": int(gpus), "weeks": cfg.weeks, "seeds": cfg.seeds, "seed": cfg.seed,
           "trace": cfg.trace, "gaps": None if file_events is not None else cfg.gaps,
           "checkpoint_interval_s": interval, "failure_mttf_s": mttf, "strategies": out}
    doc.update(_reduction(runs, names))
    return doc


def _reduction(runs: list[dict], names: list[str]) -> dict:
    """1 - waste(tm_slurm) / min(waste of the others), per seed (paired), and its interval."""
    others = [n for n in names if n != "tm_slurm"]
    if "tm_slurm" not in names or not others:
        return {}
    out = {}
    for key, pool in (("reduction_vs_best", others),
                      ("reduction_vs_best_baseline", [n for n in others if n != "tm_slurm-no-standby"])):
        if not pool:
            continue
        per = [1 - r["tm_slurm"]["waste_gpu_h_per_week"] / min(r[n]["waste_gpu_h_per_week"] for n in pool)
               for r in runs]
        out[key], out[key + "_ci"] = statistics.fmean(per), _ci(per)
    best = [min(others, key=lambda n: r[n]["waste_gpu_h_per_week"]) for r in runs]
    out["best_alternative"] = max(set(best), key=best.count)
    return out


def plan_standbys_des(params: Params, cfg: DESConfig, gpus: int, most: int = 8) -> dict:
    """sim.plan_standbys over the same event streams: tm_slurm's ETTR for 0..most standbys."""
    curve = []
    for k in range(most + 1):
        p = dataclasses.replace(params, strategies={**params.strategies, "tm_slurm": dataclasses.replace(
            params.strategies["tm_slurm"], standby_nodes=k)})
        d = simulate(p, cfg, gpus, strategies=["tm_slurm"])
        r = d["strategies"]["tm_slurm"]
        curve.append({"standbys": k, "ettr": r["ettr"], "waste_gpu_h_per_week": r["waste_gpu_h_per_week"],
                      "standby_miss_rate": r["standby_miss_rate"] or 0.0})
    plan = pick_standbys(gpus, curve, f"discrete-event ({cfg.trace or 'analytic MTTF'}, {cfg.seeds} seeds x "
                                      f"{cfg.weeks:g} weeks)")
    plan["failure_mttf_s"] = d["failure_mttf_s"]
    return plan


# ---------------------------------------------------------------- inputs, with their sources

def _src(value, default, label: str) -> str:
    return label if value == default else "override"


def inputs(params: Params, cfg: DESConfig, gpus: int, doc: dict) -> list[dict]:
    """Every number the run used: {name, value, unit, source[, note]}."""
    d, dc = default_params(), DESConfig()
    rows = []

    def add(name, value, unit, source, note=None):
        rows.append({"name": name, "value": value, "unit": unit, "source": source, **({"note": note} if note else {})})

    if cfg.trace in TRACES:
        add("trace scale", gpus / LLAMA3_GPUS, "x rate", "Llama 3 report",
            f"{LLAMA3_DAYS} days on {LLAMA3_GPUS} GPUs, rates scaled by GPUs / {LLAMA3_GPUS}")
        for cause, n, kind in TRACES[cfg.trace]:
            add(f"trace {cause}", n, f"events / {LLAMA3_DAYS} days", "Llama 3 report", f"modelled as {kind}")
    elif cfg.trace is None:
        add("mttf_ref_h", params.mttf_ref_h, "h at mttf_ref_gpus", _src(params.mttf_ref_h, d.mttf_ref_h,
            "Kokolis et al. 2024"))
        add("mttf_ref_gpus", params.mttf_ref_gpus, "GPUs", _src(params.mttf_ref_gpus, d.mttf_ref_gpus,
            "Kokolis et al. 2024"))
        add("unplanned_per_planned", params.unplanned_per_planned, "ratio",
            _src(params.unplanned_per_planned, d.unplanned_per_planned, "Llama 3 report"))
        add("hang_fraction", params.hang_fraction, "share", _src(params.hang_fraction, d.hang_fraction, "assumed"))
    else:
        add("trace file", str(cfg.trace), "path", "override")
    if cfg.trace is None or cfg.trace in TRACES:
        add("gaps", cfg.gaps, "distribution", _src(cfg.gaps, dc.gaps, "assumed"))
        if cfg.gaps == "weibull":
            add("weibull_shape", cfg.weibull_shape, "k", _src(cfg.weibull_shape, dc.weibull_shape, "assumed"),
                "HPC node failures fit k = 0.7-0.8 (Schroeder & Gibson 2006)")
        add("switch_nodes", list(cfg.switch_nodes), "nodes (uniform)", "assumed", "a cable: 1 node, a leaf switch: 4")
        add("repeat_p", cfg.repeat_p, "share of failures", "assumed", "the same node fails again...")
        add("repeat_window_h", cfg.repeat_window_h, "h (uniform)", "assumed", "...within this")
    for name, st in params.strategies.items():
        for sc in ("planned", "unplanned"):
            add(f"{name} downtime {sc}", st.downtime_s[sc], "s", _downtime_source(name, sc, st.source.get(sc)))
            if st.state_from[sc] != "checkpoint":
                add(f"{name} lost_steps {sc}", st.lost_steps[sc], "steps",
                    "bench" if st.source.get(sc) == "bench" else "assumed")
    add("step_s", params.step_s, "s", _src(params.step_s, d.step_s, "paper Sec. 4.1"), "44 s first iteration / 6")
    add("rescheduling_s", params.rescheduling_s, "s (mean queue wait)",
        _src(params.rescheduling_s, d.rescheduling_s, "paper Table 1"), f"drawn {cfg.waits}")
    add("standby_replenish_s", params.standby_replenish_s, "s (mean)",
        _src(params.standby_replenish_s, d.standby_replenish_s, "paper Table 1"),
        f"allocation + framework init, drawn {cfg.waits}")
    add("standby_nodes", params.strategies["tm_slurm"].standby_nodes, "nodes",
        _src(params.strategies["tm_slurm"].standby_nodes, 1, "assumed"))
    add("gpus_per_node", params.gpus_per_node, "GPUs", _src(params.gpus_per_node, d.gpus_per_node, "assumed"))
    add("ckpt_write_s", cfg.ckpt_write_s, "s", _src(cfg.ckpt_write_s, dc.ckpt_write_s, "assumed"))
    add("checkpoint interval", doc["checkpoint_interval_s"], "s", "override" if cfg.ckpt_interval_s else "Young/Daly",
        f"sqrt(2 x ckpt_write_s x failure MTTF {doc['failure_mttf_s']:.0f} s)")
    add("hang_detect tm_slurm", cfg.hang_detect_tm_s, "s", "tm_slurm config", "Timeouts.collective_timeout_s")
    add("hang_detect restart", cfg.hang_detect_restart_s, "s", "assumed", "PyTorch's default NCCL timeout")
    add("runtime_overhead", params.runtime_overhead, "fraction of a step",
        params.runtime_overhead_source)
    return rows


def _downtime_source(name: str, sc: str, source: str | None) -> str:
    if source != "paper":
        return source or "assumed"
    # TrainMover's own downtimes (and no-standby's planned swap) are Fig. 8's; the rest Table 1's
    return "paper Fig. 8" if name == "tm_slurm" or sc == "planned" and name.startswith("tm_slurm") else "paper Table 1"


def with_overhead(params: Params) -> Params:
    """The DES always charges the runtime's steady overhead: measured (--from-bench), given
    (--overhead), or else ASSUMED_OVERHEAD."""
    if params.runtime_overhead_source != "paper (not charged)":
        return params
    return dataclasses.replace(params, runtime_overhead=ASSUMED_OVERHEAD, runtime_overhead_source="assumed")
