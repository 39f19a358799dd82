"""`tm-slurm sim`: the scale projection (a pure model, no processes).

How many GPU-hours a week a synchronous training job of N GPUs wastes on interruptions under each
recovery strategy, and the effective training time ratio (ETTR) that leaves, for 1K..128K GPUs; the
same kind of projection as the TrainMover paper's (arXiv 2412.12636, OSDI '26, Sec. 8.2, Fig. 9).

Accounting, per week (168 h):
  unplanned events  u = 168 h / MTTF(N),  MTTF(N) = MTTF_ref * N_ref / N        (failure rate ~ N)
  planned events    p = u / 8.9                                   (Llama 3: 47 planned, 419 unplanned)
  per event, per strategy and event kind:   downtime_s (+ rescheduling_s where the strategy must wait
                                            for a replacement node) + lost_s (work redone)
  wasted GPU-hours  = N * sum(events * seconds) / 3600  +  standby_nodes * gpus_per_node * 168
  ETTR              = (N * 168 - job waste) / ((N + standby GPUs) * 168)
  reduction_vs_best = 1 - waste(tm_slurm) / min(waste of every other strategy)

Every number is a parameter below with its source; `--paper` selects the paper's own accounting,
the default is ours (see docs/sim.md for the differences and what the figures mean).
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

STRATEGIES = ("tm_slurm", "tm_slurm-no-standby", "checkpoint-restart", "elastic-restart")
SCENARIOS = ("planned", "unplanned", "hang")
SIZES = tuple(1024 * 2 ** i for i in range(8))            # 1K, 2K, ... 128K GPUs
HOURS_PER_WEEK = 168.0

# ---------------------------------------------------------------- the paper's figures (PAPER.md)
# Restart of an 8,192-GPU production job, paper Table 1 (minutes): stop/cleanup 0.52, reschedule 1.50,
# checkpoint loading 1.56, NCCL instantiation 1.09, cold warm-up 1.80  -> 6.47 in total.
PAPER_STOP_MIN, PAPER_RESCHED_MIN = 0.52, 1.50
PAPER_CKPT_LOAD_MIN, PAPER_NCCL_MIN, PAPER_WARMUP_MIN = 1.56, 1.09, 1.80
PAPER_FRAMEWORK_INIT_S = (PAPER_CKPT_LOAD_MIN + PAPER_NCCL_MIN + PAPER_WARMUP_MIN) * 60   # 4.45 min
# The projection adds "2 min of rescheduling/infrastructure cost to every system" (~ stop 0.52 +
# reschedule 1.50 = 2.02 min of Table 1).
PAPER_RESCHEDULING_S = 120.0
# TrainMover downtime at 1,024 GPUs (paper Fig. 8; the projection uses the 1,024-GPU figures):
# planned 11.5 s (32 GPUs) .. 16.6 s (1024), unplanned with a general standby 19.6 .. 21.1 s.
PAPER_TM_PLANNED_S, PAPER_TM_UNPLANNED_S = 16.6, 21.1
# The paper's result at 64K GPUs: ~55% less wasted GPU time than the best alternative, i.e. saving
# ~1.4 M GPU-hours/week (abstract: "reduce wasted GPU hours by 55% compared to the best alternative,
# saving 1.4 million GPU-hours per week at the 64K-GPU scale").  The best alternative in Fig. 9 is
# TrainMover without a standby (two full-text summaries of the paper: "55% less than the no-standby
# version ... 88% less than Parcae").
PAPER_RESULT = {"gpus": 65536, "reduction_vs_best": 0.55, "saved_gpu_hours_per_week": 1.4e6,
                "best_alternative": "tm_slurm-no-standby"}
PAPER_TOLERANCE = {"reduction_abs": 0.05, "saved_rel": 0.15}
# Normal iteration time: the first iteration is ~6x a normal one, ~44 s (paper Sec. 4.1) -> ~7.3 s.
PAPER_STEP_S = 44.0 / 6


@dataclass
class StrategyInputs:
    """Per-event inputs of one strategy. downtime_s excludes rescheduling (added by the model)."""
    downtime_s: dict[str, float]                  # scenario -> seconds the whole job is idle
    lost_steps: dict[str, float]                  # scenario -> steps redone (state-from-replica paths)
    reschedules: dict[str, bool]                  # scenario -> waits for a replacement node allocation
    state_from: dict[str, str]                    # scenario -> "leaver" | "replica" | "checkpoint"
    standby_nodes: int = 0                        # warm general standbys held idle (counted as waste)
    # scenario -> paper | reconstruction (ours, from the paper's parts) | bench | override
    source: dict[str, str] = field(default_factory=dict)


@dataclass
class Params:
    mode: str = "default"
    # Failure rate ~ GPU count. Meta, "Revisiting Reliability in Large-Scale ML Research Clusters"
    # (Kokolis et al. 2024): an 8K-GPU job sees a failure every ~3 h (as the TrainMover projection
    # uses; 1K GPUs: 7.9 h in the same study).
    mttf_ref_h: float = 3.0
    mttf_ref_gpus: int = 8192
    # Unplanned per planned interruption. Llama 3 (54 days, 16K GPUs): 419 unplanned, 47 planned.
    unplanned_per_planned: float = 8.9
    # Fraction of unplanned events that are hangs (detected by a timeout; uses the "hang" scenario).
    # 0: the paper assumes instant fault localisation and we have no published split to use.
    hang_fraction: float = 0.0
    # Extra detection delay of a hang when no measured "hang" downtime is given.
    hang_detect_s: float = 0.0
    # Waiting for a replacement node: paper's 2 min (Table 1: stop 0.52 + reschedule 1.50 min).
    # Which strategy/event pays it is in StrategyInputs.reschedules: the paper charges every system's
    # unplanned events, TrainMover's included; ours does not charge tm_slurm's standby promotion (the
    # standby is already in the allocation), only its standby misses.
    rescheduling_s: float = PAPER_RESCHEDULING_S
    gpus_per_node: int = 8
    # Time to get a promoted standby replaced by a new warm one: allocation (rescheduling_s) plus
    # the framework init it then runs in the background (4.45 min, Table 1). A failure inside that
    # window finds no standby (Erlang-B over the standbys) and falls back to the no-standby path.
    # 0 = never miss (the paper: "concurrent failures are rare").
    standby_replenish_s: float = PAPER_RESCHEDULING_S + PAPER_FRAMEWORK_INIT_S
    # Lost work. Checkpoint strategies lose half a checkpoint interval on average per unplanned
    # event (assumption: 10 min interval, i.e. frequent async checkpoints); replica paths lose
    # lost_steps iterations of step_s each (~1 iteration: the step in flight).
    count_lost_work: bool = True
    ckpt_interval_s: float = 600.0
    step_s: float = PAPER_STEP_S
    # "linear": events/week = 168 h / MTTF regardless of downtime (the paper's and the model);
    # "renewal": failures only occur while training runs, so long recoveries mean fewer events.
    event_model: str = "linear"
    # The runtime's own steady-state cost (a step under tm_slurm / a plain step - 1), charged to
    # the tm_slurm strategies every hour they train. 0 = not charged (the paper's accounting);
    # --from-bench takes the measured `steady_overhead` (labelled "bench").
    runtime_overhead: float = 0.0
    runtime_overhead_source: str = "paper (not charged)"
    # reduction_vs_best compares with every other strategy, tm_slurm-no-standby included (the
    # paper's best alternative IS TrainMover without a standby); reduction_vs_best_baseline leaves
    # it out (best restart-style baseline).
    strategies: dict[str, StrategyInputs] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _scen(planned, unplanned, hang=None):
    return {"planned": planned, "unplanned": unplanned, "hang": unplanned if hang is None else hang}


def default_strategies(paper: bool) -> dict[str, StrategyInputs]:
    """Per-interruption inputs from the paper's measurements (see the constants above)."""
    init = PAPER_FRAMEWORK_INIT_S
    # tm_slurm-no-standby, unplanned: a cold joiner started after the failure still loads state and
    # warms up cold (Table 1: checkpoint loading 1.56 + cold warm-up 1.80 min = 201.6 s); the delta
    # communicator removes NCCL instantiation and stayers never stop (no cleanup). Our reconstruction
    # of the paper's no-standby figure (not printed in the sources we could read); planned events
    # give notice, so its joiner is prepared in the background like tm_slurm's.
    cold_joiner_s = (PAPER_CKPT_LOAD_MIN + PAPER_WARMUP_MIN) * 60
    tm_resched = paper          # the paper adds 2 min to every system for unplanned events
    src = _scen("paper", "paper", "paper")
    rebuilt = _scen("paper", "reconstruction", "reconstruction")
    return {
        "tm_slurm": StrategyInputs(
            downtime_s=_scen(PAPER_TM_PLANNED_S, PAPER_TM_UNPLANNED_S),
            lost_steps=_scen(0, 1), reschedules=_scen(False, tm_resched),
            state_from=_scen("leaver", "replica"), standby_nodes=1, source=dict(src)),
        "tm_slurm-no-standby": StrategyInputs(
            downtime_s=_scen(PAPER_TM_PLANNED_S, cold_joiner_s),
            lost_steps=_scen(0, 1), reschedules=_scen(False, True),
            state_from=_scen("leaver", "replica"), source=dict(rebuilt)),
        # Stop everything, requeue/reschedule, reload the last checkpoint: 4.45 min framework init
        # + 2 min rescheduling for every event (a planned one saves a checkpoint first: no lost work).
        "checkpoint-restart": StrategyInputs(
            downtime_s=_scen(init, init), lost_steps=_scen(0, 0), reschedules=_scen(True, True),
            state_from=_scen("checkpoint", "checkpoint"), source=dict(src)),
        # torchrun-style: workers restarted in place from the latest checkpoint (framework init on
        # every rank); no requeue, but an unplanned failure leaves a node gone, so the rendezvous
        # waits for a replacement (2 min) as in the paper's projection. Planned: the replacement is
        # allocated on notice and a checkpoint is saved first.
        "elastic-restart": StrategyInputs(
            downtime_s=_scen(init, init), lost_steps=_scen(0, 0), reschedules=_scen(False, True),
            state_from=_scen("checkpoint", "checkpoint"), source=dict(src)),
    }


def default_params() -> Params:
    p = Params(mode="default", strategies=default_strategies(paper=False))
    p.notes.append("downtimes: the paper's measurements; accounting: ours (tm_slurm's standby needs no "
                   "rescheduling, standby misses, lost work counted)")
    return p


def paper_params() -> Params:
    """The paper's own inputs and accounting (Sec. 8.2, Fig. 9)."""
    p = Params(mode="paper", standby_replenish_s=0.0, count_lost_work=False,
               strategies=default_strategies(paper=True))
    p.notes.append("paper mode: 2 min rescheduling for every system's unplanned events (tm_slurm too), "
                   "one idle standby counted as waste, no standby misses, downtime only (no lost work)")
    return p


# ---------------------------------------------------------------- inputs from `tm-slurm bench --json`

def _num(v):
    if isinstance(v, dict):
        v = v.get("median", v.get("p50"))
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def load_bench(params: Params, bench: dict | str | Path) -> Params:
    """Take measured downtimes/lost steps from a bench JSON; missing entries keep the paper default
    (and say so in params.notes)."""
    if not isinstance(bench, dict):
        bench = json.loads(Path(bench).read_text())
    p = copy.deepcopy(params)
    p.mode = p.mode + "+bench" if p.mode == "paper" else "bench"
    scen = bench.get("scenarios") or {}
    if not isinstance(scen, dict):
        scen = {}
    raw_step = bench.get("steady_step_s")
    # what bench writes: {"tm_slurm": s, "plain": s}, the step under the runtime and without it
    step = _num(raw_step.get("tm_slurm") if isinstance(raw_step, dict) and "tm_slurm" in raw_step else raw_step)
    if step:
        p.step_s = step
    else:
        p.notes.append(f"bench: no steady_step_s; lost steps priced at {p.step_s:.2f} s each")
    over = _num(bench.get("steady_overhead"))
    if over is not None:
        p.runtime_overhead, p.runtime_overhead_source = max(over, 0.0), "bench"
        p.notes.append(f"bench: the runtime's steady overhead ({over * 100:+.2f} %) charged to the tm_slurm "
                       "strategies every training hour")
    missing = []
    for name, st in p.strategies.items():
        for sc in SCENARIOS:
            e = (scen.get(sc) or {}).get(name)
            d = _num(e.get("downtime_s")) if isinstance(e, dict) else None
            if d is None:
                if sc != "hang" or p.hang_fraction > 0:
                    missing.append(f"{name}:{sc}")
                continue
            st.downtime_s[sc] = d
            st.source[sc] = "bench"
            # bench's downtime is measured from step commits, so it already holds the steps
            # redone; pricing its lost_steps again would count them twice
            st.lost_steps[sc] = 0
    p.notes.append("bench: downtimes measured from step commits include the steps redone (not priced again)")
    if missing:
        p.notes.append("bench: not measured, paper default used for " + ", ".join(missing))
    extra = sorted({s for sc in scen.values() if isinstance(sc, dict) for s in sc} - set(STRATEGIES))
    if extra:
        p.notes.append("bench: unknown strategies ignored: " + ", ".join(extra))
    p.notes.append("bench downtimes are taken to exclude waiting for a Slurm allocation; the model adds "
                   f"rescheduling_s={p.rescheduling_s:g} where a strategy needs a new node")
    return p


def apply_override(params: Params, spec: str, what: str = "downtime") -> None:
    """STRATEGY:SCENARIO=VALUE (scenario planned|unplanned|hang, or * for all)."""
    try:
        lhs, val = spec.split("=", 1)
        name, sc = lhs.split(":", 1)
        v = float(val)
    except ValueError:
        raise ValueError(f"expected STRATEGY:SCENARIO=NUMBER, got {spec!r}") from None
    if name not in params.strategies:
        raise ValueError(f"unknown strategy {name!r} (one of {', '.join(params.strategies)})")
    scs = SCENARIOS if sc == "*" else (sc,)
    for s in scs:
        if s not in SCENARIOS:
            raise ValueError(f"unknown scenario {s!r} (planned, unplanned, hang or *)")
        st = params.strategies[name]
        if what == "downtime":
            st.downtime_s[s] = v
            st.source[s] = "override"
        else:
            st.lost_steps[s] = v


# ---------------------------------------------------------------- the model

def mttf_h(params: Params, gpus: int) -> float:
    return params.mttf_ref_h * params.mttf_ref_gpus / gpus


def erlang_b(servers: int, load: float) -> float:
    """Probability that all `servers` standbys are being replenished when a failure arrives."""
    if servers <= 0:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return b


def _event_cost(params: Params, st: StrategyInputs, sc: str) -> dict[str, float]:
    """Seconds per event: downtime (idle, excl. rescheduling), rescheduling, lost work."""
    if sc == "hang" and st.source.get("hang") not in ("bench", "override"):
        down = st.downtime_s["unplanned"] + params.hang_detect_s
    else:
        down = st.downtime_s[sc]
    resched = params.rescheduling_s if st.reschedules[sc] else 0.0
    lost = 0.0
    if params.count_lost_work:
        if st.state_from[sc] == "checkpoint" and sc != "planned":     # planned: saved on notice
            lost = params.ckpt_interval_s / 2
        elif st.state_from[sc] != "checkpoint":
            lost = st.lost_steps[sc] * params.step_s
    return {"downtime": down, "rescheduling": resched, "lost_work": lost}


def project(params: Params, gpus: int) -> dict:
    """Wasted GPU-hours/week and ETTR per strategy for a job of `gpus` GPUs."""
    n = int(gpus)
    m = mttf_h(params, n)
    rate = {"unplanned": (1 - params.hang_fraction) / m, "hang": params.hang_fraction / m,
            "planned": 1 / m / params.unplanned_per_planned}                      # per training hour
    fallback = params.strategies.get("tm_slurm-no-standby")
    out: dict = {}
    for name, st in params.strategies.items():
        costs = {sc: _event_cost(params, st, sc) for sc in SCENARIOS}
        miss = 0.0
        if name == "tm_slurm":
            # standby misses: failures arriving while every standby is being replenished
            load = (rate["unplanned"] + rate["hang"]) * params.standby_replenish_s / 3600
            miss = erlang_b(st.standby_nodes, load)
            if miss > 0 and fallback is not None:
                for sc in ("unplanned", "hang"):
                    fb = _event_cost(params, fallback, sc)
                    costs[sc] = {k: (1 - miss) * costs[sc][k] + miss * fb[k] for k in costs[sc]}
        idle_per_h = sum(rate[sc] * (costs[sc]["downtime"] + costs[sc]["rescheduling"]) / 3600
                         for sc in SCENARIOS)
        scale = 1 / (1 + idle_per_h) if params.event_model == "renewal" else 1.0
        events = {sc: HOURS_PER_WEEK * rate[sc] * scale for sc in SCENARIOS}
        waste = {k: n * sum(events[sc] * costs[sc][k] for sc in SCENARIOS) / 3600
                 for k in ("downtime", "lost_work", "rescheduling")}
        # the runtime's steady cost: a share o/(1+o) of every training hour of the job
        o = params.runtime_overhead if name.startswith("tm_slurm") else 0.0
        train_h = HOURS_PER_WEEK - sum(events[sc] * (costs[sc]["downtime"] + costs[sc]["rescheduling"])
                                       for sc in SCENARIOS) / 3600
        waste["overhead"] = n * max(train_h, 0.0) * o / (1 + o)
        standby_gpus = st.standby_nodes * params.gpus_per_node
        waste["standby"] = standby_gpus * HOURS_PER_WEEK
        job_waste = waste["downtime"] + waste["lost_work"] + waste["rescheduling"] + waste["overhead"]
        waste["total"] = job_waste + waste["standby"]
        allocated = (n + standby_gpus) * HOURS_PER_WEEK
        useful = n * HOURS_PER_WEEK - job_waste
        out[name] = {
            "events_per_week": {**{sc: events[sc] for sc in SCENARIOS}, "total": sum(events.values())},
            "seconds_per_event": {sc: dict(costs[sc]) for sc in SCENARIOS},
            "wasted_gpu_hours_per_week": waste,
            "allocated_gpu_hours_per_week": allocated,
            "ettr": max(0.0, useful / allocated),
            "saturated": useful < 0,
            "standby_gpus": standby_gpus,
        }
        if name == "tm_slurm":
            out[name]["standby_miss_fraction"] = miss
    res = {"gpus": n, "mttf_h": m, "strategies": out}
    res.update(_reductions(out))
    return res


def _reductions(out: dict) -> dict:
    if "tm_slurm" not in out:
        return {"reduction_vs_best": None, "best_alternative": None}
    w = {k: v["wasted_gpu_hours_per_week"]["total"] for k, v in out.items()}
    tm = w["tm_slurm"]
    others = {k: x for k, x in w.items() if k != "tm_slurm"}
    r: dict = {"reduction_vs_best": None, "best_alternative": None, "saved_gpu_hours_per_week": None,
               "reduction_vs_best_baseline": None, "best_baseline": None}
    if others:
        best = min(others, key=others.get)
        r.update(reduction_vs_best=1 - tm / others[best] if others[best] > 0 else 0.0,
                 best_alternative=best, saved_gpu_hours_per_week=others[best] - tm)
    base = {k: x for k, x in others.items() if k != "tm_slurm-no-standby"}
    if base:
        bb = min(base, key=base.get)
        r.update(reduction_vs_best_baseline=1 - tm / base[bb] if base[bb] > 0 else 0.0, best_baseline=bb)
    for k, x in others.items():
        out[k]["tm_slurm_reduction"] = 1 - tm / x if x > 0 else 0.0
    return r


def plan_standbys(params: Params, gpus: int, most: int = 16) -> dict:
    """How many standby nodes a job of `gpus` GPUs should hold: the count that maximises its
    goodput (ETTR: useful GPU-hours over allocated ones, the standbys' idle hours included).
    Each added standby costs its idle node and lowers the share of failures that find none
    (Erlang-B over the pool, replaced after standby_replenish_s)."""
    curve = []
    for k in range(0, most + 1):
        p = copy.deepcopy(params)
        p.strategies["tm_slurm"].standby_nodes = k
        r = project(p, gpus)["strategies"]["tm_slurm"]
        curve.append({"standbys": k, "ettr": r["ettr"], "waste_gpu_h_per_week": r["wasted_gpu_hours_per_week"]["total"],
                      "standby_miss_rate": r["standby_miss_fraction"]})
    return pick_standbys(gpus, curve, "analytic (Erlang-B standby misses, linear event count)")


def pick_standbys(gpus: int, curve: list[dict], model: str) -> dict:
    """The standby count of `curve` with the highest ETTR; a tie goes to fewer nodes."""
    best = max(curve, key=lambda c: (round(c["ettr"], 9), -c["standbys"]))
    return {"gpus": int(gpus), "standbys": best["standbys"], "ettr": best["ettr"], "curve": curve, "model": model}


# What --sensitivity varies, one at a time around the given parameters.
SENSITIVITY = {
    "rescheduling_s": (0, 30, 60, 120, 240, 480, 900),
    "mttf_ref_h": (0.75, 1.5, 3, 6, 12, 24),
    "standbys": tuple(range(9)),
}


def sensitivity(params: Params, gpus: int) -> dict:
    """reduction_vs_best at `gpus` against the rescheduling cost, the MTTF (at mttf_ref_gpus) and
    tm_slurm's standby count, each varied alone (analytic model)."""
    out = {}
    for knob, values in SENSITIVITY.items():
        curve = []
        for v in values:
            p = copy.deepcopy(params)
            if knob == "standbys":
                p.strategies["tm_slurm"].standby_nodes = v
            else:
                setattr(p, knob, v)
            r = project(p, gpus)
            curve.append({knob: v, "reduction_vs_best": r["reduction_vs_best"], "best_alternative": r["best_alternative"]})
        out[knob] = curve
    return {"gpus": int(gpus), "curves": out}


def sweep(params: Params, sizes=SIZES) -> list[dict]:
    rows = []
    for n in sizes:
        r = project(params, n)
        rows.append({"gpus": n, "mttf_h": r["mttf_h"], "reduction_vs_best": r["reduction_vs_best"],
                     "best_alternative": r["best_alternative"],
                     "strategies": {k: {"wasted_gpu_hours_per_week": v["wasted_gpu_hours_per_week"]["total"],
                                        "ettr": v["ettr"], "saturated": v["saturated"],
                                        "events_per_week": v["events_per_week"]["total"]}
                                    for k, v in r["strategies"].items()}})
    return rows


# the headline against the one input the paper does not print: the no-standby unplanned downtime
# (ours 201.6 s; 130 s: the cold joiner's checkpoint load only; 267 s: a full framework init)
SENSITIVITY_NO_STANDBY_S = (130.0, 196.0, PAPER_CKPT_LOAD_MIN * 60 + PAPER_WARMUP_MIN * 60, 267.0)


def no_standby_sensitivity(params: Params) -> list[dict]:
    """reduction_vs_best at the paper's 64K GPUs for each no-standby unplanned downtime."""
    out = []
    for s in SENSITIVITY_NO_STANDBY_S:
        q = copy.deepcopy(params)
        if "tm_slurm-no-standby" not in q.strategies:
            return []
        q.strategies["tm_slurm-no-standby"].downtime_s.update(unplanned=s, hang=s)
        out.append({"no_standby_unplanned_s": s,
                    "reduction_vs_best": project(q, PAPER_RESULT["gpus"])["reduction_vs_best"]})
    return out


def paper_check(params: Params) -> dict:
    """Our figures at 64K GPUs against the paper's stated result."""
    r = project(params, PAPER_RESULT["gpus"])
    red, saved = r["reduction_vs_best"], r["saved_gpu_hours_per_week"]
    d_red = red - PAPER_RESULT["reduction_vs_best"]
    d_saved = saved / PAPER_RESULT["saved_gpu_hours_per_week"] - 1
    ok = abs(d_red) <= PAPER_TOLERANCE["reduction_abs"] and abs(d_saved) <= PAPER_TOLERANCE["saved_rel"]
    return {
        "gpus": PAPER_RESULT["gpus"],
        "paper": dict(PAPER_RESULT),
        "ours": {"reduction_vs_best": red, "saved_gpu_hours_per_week": saved,
                 "best_alternative": r["best_alternative"],
                 "waste_tm_slurm": r["strategies"]["tm_slurm"]["wasted_gpu_hours_per_week"]["total"],
                 "waste_best_alternative":
                     r["strategies"][r["best_alternative"]]["wasted_gpu_hours_per_week"]["total"]},
        "difference": {"reduction_points": d_red, "saved_relative": d_saved},
        "tolerance": dict(PAPER_TOLERANCE),
        "within_tolerance": ok,
        "inputs_are_the_papers": params.mode == "paper"
        and all(v == "paper" for s in params.strategies.values() for v in s.source.values()),
        "reconstructed_inputs": sorted(f"{name}:{sc}" for name, st in params.strategies.items()
                                       for sc, v in st.source.items() if v == "reconstruction"),
        "sensitivity": no_standby_sensitivity(params),
        "explanation": (
            "1.4 M GPU-hours/week is what TrainMover saves vs the best alternative (abstract), not the "
            "baseline's waste. The residual gap comes from the no-standby downtime, which our sources do "
            "not print: we reconstruct it as checkpoint loading + cold warm-up of Table 1 (201.6 s), so "
            "the inputs are not all the paper's; ~196 s would give exactly 55%, and the headline moves "
            "with it (see sensitivity, docs/sim.md)."),
    }


def params_dict(params: Params) -> dict:
    d = asdict(params)
    d.pop("strategies")
    d.pop("notes")
    return d


def inputs_dict(params: Params) -> dict:
    out = {k: asdict(v) for k, v in params.strategies.items()}
    out["runtime_overhead"] = {"value": params.runtime_overhead, "source": params.runtime_overhead_source}
    return out
