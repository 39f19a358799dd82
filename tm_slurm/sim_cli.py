"""`tm-slurm sim` on the command line: the terminal table, the PNG and the argument handling.
The model itself is `tm_slurm/sim.py`."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from . import simdes
from .sim import (SIZES, Params, apply_override, default_params, inputs_dict, load_bench, mttf_h, paper_check,
                  paper_params, params_dict, plan_standbys, project, sensitivity, sweep)

# ---------------------------------------------------------------- output

def _fmt_gh(x: float) -> str:
    if abs(x) >= 1e6:
        return f"{x / 1e6:.2f}M"
    if abs(x) >= 1e3:
        return f"{x / 1e3:.1f}K"
    return f"{x:.0f}"


def render_text(res: dict, rows: list[dict], params: Params, check: dict | None) -> str:
    L = []
    n = res["gpus"]
    L.append(f"tm-slurm sim [{params.mode}]  {n} GPUs, MTTF {res['mttf_h'] * 60:.1f} min "
             f"(= {params.mttf_ref_h:g} h x {params.mttf_ref_gpus}/{n}), planned:unplanned = "
             f"1:{params.unplanned_per_planned:g}, rescheduling {params.rescheduling_s:g} s, "
             f"events {params.event_model}")
    for note in params.notes:
        L.append(f"  note: {note}")
    L.append("")
    hdr = f"{'strategy':<22}{'events/wk':>10}{'downtime':>10}{'lost':>9}{'resched':>9}{'overhead':>9}{'standby':>9}" \
          f"{'total':>9}{'ETTR':>7}  per event planned/unplanned (s)"
    L.append("wasted GPU-hours/week")
    L.append(hdr)
    for k, v in res["strategies"].items():
        w = v["wasted_gpu_hours_per_week"]
        spe = v["seconds_per_event"]
        pe = "/".join(f"{sum(spe[sc].values()):.1f}" for sc in ("planned", "unplanned"))
        L.append(f"{k:<22}{v['events_per_week']['total']:>10.1f}{_fmt_gh(w['downtime']):>10}"
                 f"{_fmt_gh(w['lost_work']):>9}{_fmt_gh(w['rescheduling']):>9}{_fmt_gh(w['overhead']):>9}"
                 f"{_fmt_gh(w['standby']):>9}"
                 f"{_fmt_gh(w['total']):>9}{v['ettr']:>7.3f}  {pe}" + ("  SATURATED" if v["saturated"] else ""))
    if res.get("reduction_vs_best") is not None:
        L.append(f"\nreduction_vs_best: {res['reduction_vs_best']:.1%} less waste than {res['best_alternative']} "
                 f"(saves {_fmt_gh(res['saved_gpu_hours_per_week'])} GPU-hours/week)")
    if res.get("reduction_vs_best_baseline") is not None:
        L.append(f"vs best restart-style baseline ({res['best_baseline']}): {res['reduction_vs_best_baseline']:.1%}")
    tm = res["strategies"].get("tm_slurm", {})
    if tm.get("standby_miss_fraction"):
        L.append(f"tm_slurm standby misses: {tm['standby_miss_fraction']:.1%} of failures find no warm standby")
    if check:
        o, pp = check["ours"], check["paper"]
        L.append(f"\npaper check @ {check['gpus']} GPUs: ours {o['reduction_vs_best']:.1%} vs paper "
                 f"{pp['reduction_vs_best']:.0%} ({check['difference']['reduction_points'] * 100:+.1f} points); "
                 f"saved {_fmt_gh(o['saved_gpu_hours_per_week'])} vs paper {_fmt_gh(pp['saved_gpu_hours_per_week'])}"
                 f" ({check['difference']['saved_relative']:+.0%}); best alternative {o['best_alternative']} "
                 f"(paper: {pp['best_alternative']}); "
                 + ("within tolerance" if check["within_tolerance"] else "OUTSIDE tolerance"))
        L.append(f"  {check['explanation']}")
        if check["reconstructed_inputs"]:
            L.append(f"  reconstructed, not the paper's: {', '.join(check['reconstructed_inputs'])}; "
                     "the headline against the no-standby unplanned downtime: "
                     + ", ".join(f"{x['no_standby_unplanned_s']:g} s -> {x['reduction_vs_best']:.1%}"
                                 for x in check["sensitivity"]))
    names = list(res["strategies"])
    L.append("\nsweep: wasted GPU-hours/week (ETTR)")
    L.append(f"{'GPUs':>7}{'MTTF':>8}  " + "".join(f"{k:>24}" for k in names) + f"{'reduction':>11}")
    for r in rows:
        cells = "".join(f"{_fmt_gh(r['strategies'][k]['wasted_gpu_hours_per_week']) + ' (' + format(r['strategies'][k]['ettr'], '.3f') + ')' + ('!' if r['strategies'][k]['saturated'] else ''):>24}"
                        for k in names)
        red = r["reduction_vs_best"]
        L.append(f"{r['gpus']:>7}{r['mttf_h'] * 60:>6.0f}m  {cells}{(f'{red:.1%}' if red is not None else '-'):>11}")
    if any(s["saturated"] for r in rows for s in r["strategies"].values()):
        L.append("  ! saturated: per-week recovery time exceeds the week (linear model); try --events renewal")
    return "\n".join(L)


def plot(rows: list[dict], path: str | Path, title: str = "") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(rows[0]["strategies"])
    x = [r["gpus"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k in names:
        a.plot(x, [r["strategies"][k]["wasted_gpu_hours_per_week"] for r in rows], marker="o", label=k)
        b.plot(x, [r["strategies"][k]["ettr"] for r in rows], marker="o", label=k)
    for ax, yl in ((a, "wasted GPU-hours / week"), (b, "ETTR")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{g // 1024}K" for g in x])
        ax.set_xlabel("GPUs")
        ax.set_ylabel(yl)
        ax.grid(True, alpha=.3)
    a.set_yscale("log")
    b.set_ylim(0, 1.02)
    b.legend(fontsize=8)
    fig.suptitle(title or "tm-slurm sim")
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


# ---------------------------------------------------------------- CLI

def add_parser(subparsers) -> argparse.ArgumentParser:
    s = subparsers.add_parser("sim", help="scale projection: wasted GPU-hours/week and ETTR per strategy",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--gpus", type=int, default=65536, help="job size for the detailed figures (default 65536)")
    s.add_argument("--paper", action="store_true",
                   help="the paper's own inputs and accounting, checked against its 55%% at 64K GPUs")
    s.add_argument("--from-bench", metavar="FILE", help="downtimes from `tm-slurm bench --json` output")
    s.add_argument("--downtime", action="append", default=[], metavar="STRATEGY:SCENARIO=SECONDS",
                   help="override a per-event downtime (scenario planned|unplanned|hang|*); repeatable")
    s.add_argument("--lost-steps", action="append", default=[], metavar="STRATEGY:SCENARIO=N",
                   help="override the steps lost per event on a replica/leaver path; repeatable")
    s.add_argument("--mttf-h", type=float, help="MTTF at --mttf-ref-gpus (default 3 h, Meta's study)")
    s.add_argument("--mttf-ref-gpus", type=int, help="reference size for --mttf-h (default 8192)")
    s.add_argument("--unplanned-per-planned", type=float, help="default 8.9 (Llama 3: 419/47)")
    s.add_argument("--rescheduling-s", type=float, help="wait for a replacement node (default 120)")
    s.add_argument("--standbys", type=int, help="tm_slurm standby nodes (default 1)")
    s.add_argument("--gpus-per-node", type=int, help="default 8")
    s.add_argument("--replenish-s", type=float, help="time to replace a used standby (0: never miss)")
    s.add_argument("--ckpt-interval-min", type=float, help="checkpoint interval (default 10 min)")
    s.add_argument("--ckpt-interval-steps", type=float, help="checkpoint interval in steps (x --step-s)")
    s.add_argument("--step-s", type=float, help="iteration time at scale (default 7.33 s; bench: its own)")
    s.add_argument("--overhead", type=float, help="the runtime's steady overhead, charged to the tm_slurm "
                   "strategies (0.077 = +7.7 %%; default 0, --from-bench: measured)")
    s.add_argument("--hang-fraction", type=float, help="share of unplanned events that are hangs (default 0)")
    s.add_argument("--hang-detect-s", type=float, help="detection delay added to hangs without a measurement")
    s.add_argument("--lost-work", choices=("on", "off"), help="count redone work (default: on; --paper: off)")
    s.add_argument("--events", choices=("linear", "renewal"), help="event-count model (default linear)")
    s.add_argument("--sizes", help="comma-separated GPU counts for the sweep (default 1K..128K)")
    s.add_argument("--plan-standbys", action="store_true", help="only: the number of standby nodes that "
                   "maximises goodput at --gpus, and the curve (ETTR vs standbys; --plot writes it, default "
                   "standbys.png)")
    d = s.add_argument_group("discrete-event simulation (issue 16; either of --trace, --gaps runs it)")
    d.add_argument("--trace", metavar="NAME|FILE", help=f"interruptions from a trace: {', '.join(simdes.TRACES)} "
                   "(the Llama 3 report's 54 days on 16K GPUs by cause, rate scaled to --gpus) or a JSON/CSV file "
                   "of events {time_h, kind planned|unplanned|hang, nodes}")
    d.add_argument("--gaps", choices=simdes.GAPS, help="gaps between drawn events (same mean rate); without "
                   "--trace the rate is the analytic model's MTTF")
    d.add_argument("--weibull-shape", type=float, help="Weibull shape k for --gaps weibull (default 0.7)")
    d.add_argument("--weeks", type=float, help="simulated weeks per seed (default 4)")
    d.add_argument("--seeds", type=int, help="seeds, for the 95%% intervals (default 20; --plan-standbys: 5)")
    d.add_argument("--seed", type=int, help="first seed (default 0)")
    d.add_argument("--ckpt-write-s", type=float, help="checkpoint write cost, sets the Young/Daly interval "
                   "(default 60 s, assumed)")
    s.add_argument("--sensitivity", nargs="?", const="sensitivity.png", metavar="PATH.png",
                   help="only: reduction_vs_best against rescheduling cost, MTTF and standbys (analytic "
                   "model), drawn to PATH (default ./sensitivity.png)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--plot", nargs="?", const="sim.png", metavar="PATH.png",
                   help="write a PNG (default path: ./sim.png)")
    s.set_defaults(fn=main)
    return s


def build_params(args) -> Params:
    p = paper_params() if args.paper else default_params()
    for attr, key in (("mttf_h", "mttf_ref_h"), ("mttf_ref_gpus", "mttf_ref_gpus"),
                      ("unplanned_per_planned", "unplanned_per_planned"), ("rescheduling_s", "rescheduling_s"),
                      ("gpus_per_node", "gpus_per_node"), ("replenish_s", "standby_replenish_s"),
                      ("hang_fraction", "hang_fraction"), ("hang_detect_s", "hang_detect_s"),
                      ("events", "event_model")):
        v = getattr(args, attr, None)
        if v is not None:
            setattr(p, key, v)
    if getattr(args, "ckpt_interval_min", None) is not None:
        p.ckpt_interval_s = args.ckpt_interval_min * 60
    if getattr(args, "lost_work", None):
        p.count_lost_work = args.lost_work == "on"
    if getattr(args, "standbys", None) is not None:
        p.strategies["tm_slurm"].standby_nodes = args.standbys
    if getattr(args, "from_bench", None):
        p = load_bench(p, args.from_bench)
    if getattr(args, "step_s", None) is not None:
        p.step_s = args.step_s
    if getattr(args, "overhead", None) is not None:
        p.runtime_overhead, p.runtime_overhead_source = args.overhead, "override"
    if getattr(args, "ckpt_interval_steps", None) is not None:
        p.ckpt_interval_s = args.ckpt_interval_steps * p.step_s
    for spec in getattr(args, "downtime", None) or []:
        apply_override(p, spec, "downtime")
    for spec in getattr(args, "lost_steps", None) or []:
        apply_override(p, spec, "lost_steps")
    if not 0 <= p.hang_fraction <= 1:
        raise ValueError("--hang-fraction must be within 0..1")
    if p.mttf_ref_h <= 0 or p.mttf_ref_gpus <= 0 or p.unplanned_per_planned <= 0:
        raise ValueError("MTTF, its reference size and the unplanned:planned ratio must be positive")
    if args.gpus <= 0:
        raise ValueError("--gpus must be positive")
    return p


def run(args) -> tuple[dict, Params]:
    """Everything main prints, as a dict (the --json document), and the parameters used."""
    p = build_params(args)
    sizes = SIZES
    if getattr(args, "sizes", None):
        sizes = tuple(int(x) for x in args.sizes.split(",") if x.strip())
    res = project(p, args.gpus)
    doc = {"mode": p.mode, "gpus": res["gpus"]}
    doc.update((k, res[k]) for k in ("reduction_vs_best", "best_alternative", "saved_gpu_hours_per_week",
                                     "reduction_vs_best_baseline", "best_baseline", "mttf_h", "strategies"))
    if p.mode.startswith("paper"):
        doc["paper_check"] = paper_check(p)
    doc.update(sweep=sweep(p, sizes), params=params_dict(p), inputs=inputs_dict(p), notes=list(p.notes))
    return doc, p


def des_config(args) -> simdes.DESConfig:
    """The discrete-event run's settings; an unknown trace name or a bad number is a ValueError."""
    c = simdes.DESConfig(trace=None)
    trace = getattr(args, "trace", None)
    if trace is not None and trace not in simdes.TRACES and not Path(trace).is_file():
        raise ValueError(f"--trace {trace!r}: neither a trace name ({', '.join(simdes.TRACES)}) nor a file")
    kw = {"trace": trace}
    for attr in ("gaps", "weibull_shape", "weeks", "seed", "ckpt_write_s"):
        if getattr(args, attr, None) is not None:
            kw[attr] = getattr(args, attr)
    kw["seeds"] = args.seeds if args.seeds is not None else (5 if args.plan_standbys else c.seeds)
    if getattr(args, "ckpt_interval_min", None) is not None:
        kw["ckpt_interval_s"] = args.ckpt_interval_min * 60
    if getattr(args, "hang_detect_s", None) is not None:
        kw.update(hang_detect_tm_s=args.hang_detect_s, hang_detect_restart_s=args.hang_detect_s)
    c = dataclasses.replace(c, **kw)
    if c.weibull_shape <= 0 or c.weeks <= 0 or c.seeds < 1 or c.ckpt_write_s < 0:
        raise ValueError("--weibull-shape and --weeks must be positive, --seeds at least 1, --ckpt-write-s >= 0")
    return c


def run_des(args) -> tuple[dict, Params]:
    p = simdes.with_overhead(build_params(args))
    cfg = des_config(args)
    doc = simdes.simulate(p, cfg, args.gpus)
    doc.update(inputs=simdes.inputs(p, cfg, args.gpus, doc), notes=list(p.notes))
    return doc, p


def render_des(doc: dict) -> str:
    L = [f"tm-slurm sim [discrete-event]  {doc['gpus']} GPUs, trace {doc['trace'] or 'analytic MTTF'}"
         f"{', gaps ' + doc['gaps'] if doc['gaps'] else ''}, {doc['weeks']:g} weeks x {doc['seeds']} seeds; "
         f"checkpoint every {doc['checkpoint_interval_s']:.0f} s", "",
         f"{'strategy':<22}{'events/wk':>10}  {'waste GPU-h/wk [95% CI]':<28}{'ETTR [95% CI]':<23}misses"]
    for k, v in doc["strategies"].items():
        w, e = v["waste_ci"], v["ettr_ci"]
        miss = "-" if v["standby_miss_rate"] is None else f"{v['standby_miss_rate']:.1%}"
        waste = f"{_fmt_gh(v['waste_gpu_h_per_week'])} [{_fmt_gh(w[0])}, {_fmt_gh(w[1])}]"
        L.append(f"{k:<22}{v['events_per_week']:>10.1f}  {waste:<28}{v['ettr']:.3f} [{e[0]:.3f}, {e[1]:.3f}]   {miss}")
    if doc.get("reduction_vs_best") is not None:
        lo, hi = doc["reduction_vs_best_ci"]
        L.append(f"\nreduction_vs_best: {doc['reduction_vs_best']:.1%} [{lo:.1%}, {hi:.1%}] "
                 f"(best alternative: {doc['best_alternative']})")
    L.append("\ninputs:")
    L.extend(f"  {i['name']} = {_rounded(i['value'])} {i['unit']} ({i['source']})" for i in doc["inputs"])
    return "\n".join(L)


def _show_sensitivity(args) -> int:
    doc = sensitivity(build_params(args), args.gpus)
    doc["plot"] = str(plot_sensitivity(doc, args.sensitivity))
    if args.json:
        print(json.dumps(_rounded(doc), indent=2))
        return 0
    for knob, curve in doc["curves"].items():
        print(f"{knob:>15}: " + "  ".join(f"{c[knob]:g}->{c['reduction_vs_best']:.1%}" for c in curve))
    print(f"plot: {doc['plot']}")
    return 0


def plot_sensitivity(doc: dict, path: str | Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = {"rescheduling_s": "rescheduling cost (s)", "mttf_ref_h": "MTTF at the reference size (h)",
              "standbys": "tm_slurm standby nodes"}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8), sharey=True)
    for ax, (knob, curve) in zip(axes, doc["curves"].items()):
        ax.plot([c[knob] for c in curve], [c["reduction_vs_best"] for c in curve], "o-")
        ax.set_xlabel(labels.get(knob, knob))
        ax.axhline(0, color="gray", lw=.8)
        ax.grid(True, alpha=.3)
    axes[1].set_xscale("log", base=2)
    axes[0].set_ylabel("reduction_vs_best")
    fig.suptitle(f"{doc['gpus']} GPUs: tm_slurm's waste vs the best other strategy (analytic)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _show_plan(args, doc: dict, p: Params) -> int:
    doc["plot"] = str(plot_standbys(doc, args.plot or "standbys.png"))
    if args.json:
        print(json.dumps(_rounded(doc), indent=2))
        return 0
    mttf_min = doc["failure_mttf_s"] / 60 if "failure_mttf_s" in doc else mttf_h(p, args.gpus) * 60
    print(f"tm-slurm sim --plan-standbys [{doc['model']}]: {doc['gpus']} GPUs, MTTF {mttf_min:.1f} min, "
          f"a used standby replaced in {p.standby_replenish_s:g} s")
    print(f"{'standbys':>8} {'ETTR':>7} {'waste GPU-h/wk':>15} {'misses':>7}")
    for c in doc["curve"]:
        mark = "  <- best" if c["standbys"] == doc["standbys"] else ""
        print(f"{c['standbys']:>8} {c['ettr']:>7.4f} {c['waste_gpu_h_per_week']:>15,.0f} {c['standby_miss_rate']:>7.1%}{mark}")
    print(f"plot: {doc['plot']}")
    return 0


def plot_standbys(doc: dict, path: str | Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ks = [c["standbys"] for c in doc["curve"]]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(ks, [c["ettr"] for c in doc["curve"]], "o-")
    ax.axvline(doc["standbys"], ls="--", color="gray")
    ax.set_xlabel("standby nodes")
    ax.set_ylabel("goodput (ETTR)")
    ax.set_title(f"{doc['gpus']} GPUs: best {doc['standbys']} standbys", fontsize=10)
    ax2 = ax.twinx()
    ax2.plot(ks, [c["standby_miss_rate"] for c in doc["curve"]], "s:", color="tab:red", ms=3)
    ax2.set_ylabel("failures finding no standby", color="tab:red")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def main(args) -> int:
    planning = getattr(args, "plan_standbys", False)
    des = getattr(args, "trace", None) is not None or getattr(args, "gaps", None) is not None
    try:
        if getattr(args, "sensitivity", None):
            return _show_sensitivity(args)
        if planning and des:
            p, cfg = simdes.with_overhead(build_params(args)), des_config(args)
            doc = simdes.plan_standbys_des(p, cfg, args.gpus)
        elif planning:
            p = build_params(args)
            doc = plan_standbys(p, args.gpus)
        elif des:
            doc, p = run_des(args)
        else:
            doc, p = run(args)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        print(f"tm-slurm sim: {e}", file=sys.stderr)
        return 2
    if planning:
        return _show_plan(args, doc, p)
    if des:
        print(json.dumps(_rounded(doc), indent=2) if args.json else render_des(doc))
        return 0
    if getattr(args, "plot", None):
        path = plot(doc["sweep"], args.plot, title=f"tm-slurm sim [{doc['mode']}]")
        doc["plot"] = str(path)
    if args.json:
        print(json.dumps(_rounded(doc), indent=2))
    else:
        print(render_text(doc, doc["sweep"], p, doc.get("paper_check")))
        if doc.get("plot"):
            print(f"\nplot: {doc['plot']}")
    return 0


def _rounded(o):
    """Readable JSON: fractions to 5 decimals, GPU-hours to 0.1 (NaN/inf -> null)."""
    if isinstance(o, float):
        if math.isnan(o) or math.isinf(o):
            return None
        return round(o, 5) if abs(o) < 100 else round(o, 1)
    if isinstance(o, dict):
        return {k: _rounded(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_rounded(v) for v in o]
    return o
