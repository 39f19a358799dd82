"""`tm-slurm bench`: every strategy through the same interruptions, interleaved, repeated."""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from ..demo import COMPILE_STEPS, EXAMPLES
from . import metrics, peers, runs
from .frames import frame_costs
from .frames import table as frames_table
from .metrics import summary


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="tm_slurm vs checkpoint-restart and elastic restart, measured")
    b.add_argument("--quick", action="store_true", help="one repetition, planned and unplanned only")
    b.add_argument("--json", action="store_true")
    b.add_argument("--comm", choices=("gloo", "nccl", "nccl-like"), default="",
                   help="the runtime's comm.backend (default: auto); nccl-like: gloo with NCCL's delivery "
                   "of results and errors (the settle before each vote, the abort that releases survivors)")
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--scenarios", default=",".join(runs.SCENARIOS))
    b.add_argument("--strategies", help=f"default: all that can run the example ({','.join(runs.STRATEGIES)}); "
                   "torchft and nvrx need `pip install -e .[peers]` and run the ddp example only")
    b.add_argument("--steps", type=int, help="steps per run (default 100; 800 with --compile)")
    b.add_argument("--at-step", type=int, default=30,
                   help="the interruption comes at this step (or later: once every standby is warm)")
    b.add_argument("--hang-timeout", type=float, default=30.0,
                   help="collective timeout: how long a hang lasts for the restart strategies")
    b.add_argument("--sleep", type=float, default=0.05, help="seconds each step also waits, as a GPU step "
                   "leaves its host's CPU idle (0: the CPU-bound worst case, where the runtime's processes "
                   "compete with the step for this machine's cores)")
    b.add_argument("--compile", action="store_true", help="torch.compile the example (the joiner's "
                   "first step then shows what the sandbox warms)")
    b.add_argument("--example", choices=sorted(EXAMPLES), default="ddp",
                   help="the job measured: ddp (a stock DDP loop, the one every strategy can run), gpt (DP=2 x "
                   "PP=2, the low-level API), fsdp (a stock FSDP2 loop) or llama (a Llama-style decoder, HSDP 2 x 2)")
    b.add_argument("--pairs", type=int, default=3, help="steady-state overhead: back-to-back runs "
                   "with and without the runtime; the median of their ratios is reported, with the spread")
    b.add_argument("--steady", action="store_true", help="only: the --pairs steady-state runs, no "
                   "interruption (e.g. --steady --sleep 0 --pairs 7 --steps 600: the CPU-bound short step)")
    b.add_argument("--out", help="default: ./tm_slurm_jobs/bench-<time>")
    b.add_argument("--no-plot", action="store_true")
    b.add_argument("--scaling", action="store_true", help="also: swap cost vs world size")
    b.add_argument("--frames", action="store_true", help="only: what a control-plane frame costs "
                   "(seal + open, HMAC) against pickle, in microseconds")
    b.add_argument("--slurmctld", action="store_true", help="only: what a job costs slurmctld (sdiag's RPCs "
                   "a minute by type and their time), a plain job vs tm_slurm at each poll setting; needs a "
                   "Slurm where `sdiag -r` is allowed (the minicluster), run from the repository root")
    b.add_argument("--window", type=float, default=60.0, help="--slurmctld: seconds measured per case")
    b.add_argument("--control-plane", action="store_true", help="only: the real controller, store and vote "
                   "against --nodes emulated agents of --ranks-per-node ranks (what is emulated: README); vote "
                   "latency, controller CPU per step, store operations, swap and recovery planning, RSS")
    b.add_argument("--nodes", default="64,256,1024", help="--control-plane: node counts, comma-separated")
    b.add_argument("--ranks-per-node", type=int, default=8)
    b.add_argument("--step-time", type=float, default=1.0,
                   help="--control-plane: seconds of emulated compute between votes")
    b.add_argument("--heartbeat-interval", type=float, help="--control-plane: timeouts.heartbeat_interval_s "
                   "(default: the config's)")
    b.add_argument("--soak", type=int, metavar="STEPS", help="only: one run this long with a planned "
                   "swap every --soak-every steps; the controller's memory and store keys over time")
    b.add_argument("--soak-every", type=int, default=1000)
    b.add_argument("--analyze", metavar="DIR", help="recompute the table from the runs in an earlier "
                   "bench directory instead of running them (the overhead runs still run)")
    b.set_defaults(fn=main)


def main(args) -> int:
    if args.frames:
        costs = frame_costs()
        print(json.dumps(costs, indent=1) if args.json else frames_table(costs))
        return 0
    if args.slurmctld:
        from .slurmctld import measure, table as ctld_table
        root = _out_dir(args, "slurmctld")
        out = measure(root, args.window, say=lambda *a: print(*a, file=sys.stderr, flush=True))
        (root / "slurmctld.json").write_text(json.dumps(out, indent=1))
        print(json.dumps(out, indent=1) if args.json else ctld_table(out))
        return 0
    if args.control_plane:
        return _control_plane(args)
    if args.soak:
        from .soak import soak, table as soak_table
        root = _out_dir(args, "soak")
        out = soak(root, args.soak, args.soak_every)
        (root / "soak.json").write_text(json.dumps(out, indent=1))
        print(json.dumps(out, indent=1) if args.json else soak_table(out))
        return 0 if out["rc"] == 0 else 1
    scenarios = args.scenarios.split(",") if not args.quick else ["planned", "unplanned"]
    if args.steady:
        scenarios = []
    strategies = (args.strategies or ",".join(runs.STRATEGIES)).split(",")
    bad = [s for s in scenarios if s not in runs.SCENARIOS] + [s for s in strategies if s not in runs.STRATEGIES]
    if bad:
        print(f"tm-slurm bench: unknown {bad}; scenarios {runs.SCENARIOS}, strategies {runs.STRATEGIES}",
              file=sys.stderr)
        return 2
    ex = EXAMPLES[args.example]
    if args.compile and ex.name != "gpt":
        print(f"tm-slurm bench: --compile is an option of the gpt example, not of {ex.name}", file=sys.stderr)
        return 2
    say = (lambda *a: print(*a, file=sys.stderr, flush=True))
    for st in [s for s in strategies if s in peers.PEERS]:
        why = peers.unavailable(st, ex)
        if why and args.strategies:
            print(f"tm-slurm bench: {why}", file=sys.stderr)
            return 2
        if why:
            say(f"  {why}: left out")
            strategies.remove(st)
    reps = 1 if args.quick else args.reps
    steps = args.steps or (COMPILE_STEPS if args.compile else 150)
    # long enough after the interruption for a restarted process to come back (a torchft
    # replica rejoins only once its process has started: seconds here)
    steps, at = (150, 20) if args.quick else (steps, args.at_step)
    hang = min(args.hang_timeout, 10.0) if args.quick else args.hang_timeout
    extra = (["--sleep", str(args.sleep)] if args.sleep else []) + (["--compile"] if args.compile else [])
    root = _out_dir(args, "bench")
    root.mkdir(parents=True, exist_ok=True)
    samples: list[runs.Sample] = []
    t0 = time.monotonic()
    if args.analyze:
        samples = [runs.analyze(p.parent) for p in sorted(Path(args.analyze).glob("*/bench-sample.json"))]
        samples = [s for s in samples if s.scenario in scenarios and s.strategy in strategies]
    for rep in range(0 if args.analyze else reps):
        for sc in scenarios:
            # rotate the order each repetition, so slow drift of the machine hits all alike
            order = strategies[rep % len(strategies):] + strategies[:rep % len(strategies)]
            for st in order:
                s = runs.run(root, sc, st, steps, at, hang, extra, ex=ex, comm=args.comm)
                samples.append(s)
                say(f"  [{time.monotonic() - t0:6.0f}s] rep {rep + 1}/{reps} {sc:9s} {st:20s} "
                    f"downtime {s.downtime_s:7.3f}s  steps redone {s.lost_steps}")
    say(f"  steady-state overhead: {args.pairs} pairs of the same script with and without the runtime ...")
    pairs, details = [], []
    for i in range(args.pairs):
        # each pair back to back, the order alternating: a drift of the machine lands on both
        # sides, and the median of the pairs' ratios shrugs off one disturbed run
        plain = tm = 0.0
        before = {}
        for who in (("plain", "tm") if i % 2 == 0 else ("tm", "plain")):
            # on a shared machine another user's load slows the runtime's several processes
            # more than the plain ranks: start each run on a quiet machine, and say how quiet
            before[who] = round(metrics.wait_quiet(), 2)
            if who == "plain":
                plain, plain_info = runs.plain_steady(root, steps, extra, ex=ex)
            else:
                tm, tm_info = runs.runtime_steady(root, steps, extra, ex=ex, comm=args.comm)
        pairs.append((tm, plain))
        details.append({"tm_s": tm, "plain_s": plain, "tm_mean_s": tm_info.get("mean_step_s"),
                        "plain_mean_s": plain_info.get("mean_step_s"), "busy_before": before,
                        "cpu_ms_per_step": tm_info.get("cpu_ms_per_step")})
        say(f"  [{time.monotonic() - t0:6.0f}s] pair {i + 1}/{args.pairs}: tm_slurm {tm * 1e3:.2f} ms, "
            f"plain {plain * 1e3:.2f} ms a step (median; the machine busy before: {before}); the runtime's "
            f"processes, CPU ms a step: {tm_info.get('cpu_ms_per_step') or '-'}")
    out = report(samples, scenarios, strategies, pairs, details)
    out["steady_pairs"] = details
    out["frames"] = frame_costs()
    out["config"] = {"example": ex.name, "comm": args.comm or "auto", "layout": ex.layout, "reps": reps, "analyzed": args.analyze, "steps": steps,
                     "at_step": at, "hang_timeout_s": hang, "node": ex.drain,
                     "checkpoint_every": runs.CKPT_EVERY, "model": runs.MODEL, "out": str(root),
                     "wall_s": round(time.monotonic() - t0, 1)}
    (root / "bench.json").write_text(json.dumps(out, indent=1))
    if args.scaling:
        from .scaling import swap_scaling
        out["scaling"] = swap_scaling(root, quick=args.quick)
        (root / "bench.json").write_text(json.dumps(out, indent=1))
    if not args.no_plot and samples:
        from .plot import plot
        out["plot"] = str(plot(out, samples, root / "bench.png"))
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(table(out))
    return 0


def _out_dir(args, kind: str) -> Path:
    """--out, or ./tm_slurm_jobs/<kind>-<time>."""
    return Path(args.out or Path.cwd() / "tm_slurm_jobs" / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}")


def _control_plane(args) -> int:
    from .controlplane import measure, table as cp_table
    from .plot import plot_control_plane
    root = _out_dir(args, "control-plane")
    root.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True))
    sizes = [int(n) for n in args.nodes.split(",")]
    results = [measure(n, args.ranks_per_node, args.steps or 40, args.step_time, args.heartbeat_interval, say=say) for n in sizes]
    out = results[0] if len(results) == 1 else {"runs": results}
    if len(results) > 1 and not args.no_plot:
        out["plot"] = str(plot_control_plane(results, root / "control-plane.png"))
    (root / "control-plane.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1) if args.json else cp_table(results))
    return 0


def report(samples, scenarios, strategies, pairs: list[tuple[float, float]], details: list[dict] = ()) -> dict:
    """`pairs`: (tm_slurm, plain) median step times of back-to-back steady runs; `details`: more
    of each pair (mean step times, the runtime's CPU a step by kind of process)."""
    res: dict = {"scenarios": {}}
    for sc in scenarios:
        row = {}
        for st in strategies:
            xs = [s for s in samples if s.scenario == sc and s.strategy == st]
            if not xs:
                continue
            d = summary([s.downtime_s for s in xs])
            row[st] = {"downtime_s": round(d["median"], 4), "min": round(d["min"], 4), "max": round(d["max"], 4),
                       "n": d["n"], "lost_steps": statistics.median([s.lost_steps for s in xs]),
                       "steady_step_s": round(statistics.median([s.steady_step_s for s in xs]), 4)}
            firsts = [i["joiner_first_step_s"] for s in xs for i in s.detail.get("interruptions", [])
                      if i.get("joiner_first_step_s") is not None]
            if firsts:      # the swap strategies: how warm the joiner was (sandboxed or cold)
                row[st]["joiner_first_step_s"] = round(statistics.median(firsts), 4)
            if all("bit_identical" in s.detail for s in xs):      # the peers: checked against themselves
                row[st]["bit_identical"] = all(s.detail["bit_identical"] for s in xs)
            if all("steps_fewer_replicas" in s.detail for s in xs):
                # a peer that trains on with fewer replicas: the samples it did not train on, as
                # seconds of steady training
                lost = statistics.median(s.detail["samples_lost_steps"] * s.steady_step_s for s in xs)
                row[st].update(steps_fewer_replicas=statistics.median(s.detail["steps_fewer_replicas"] for s in xs),
                               samples_lost_s=round(lost, 4),
                               replica_rejoined=all(s.detail["replica_rejoined"] for s in xs))
        tm = row.get("tm_slurm", {}).get("downtime_s")
        for st, r in row.items():
            r["ratio_vs_tm"] = round(r["downtime_s"] / tm, 2) if tm and tm > 0 else None
        res["scenarios"][sc] = row
    over = [tm / plain - 1 for tm, plain in pairs]
    res["steady_overhead"] = round(statistics.median(over), 4)
    res["steady_overhead_spread"] = [round(min(over), 4), round(max(over), 4)]
    res["steady_overhead_n"] = len(over)
    res["steady_step_s"] = {"tm_slurm": round(statistics.median(t for t, _ in pairs), 5),
                            "plain": round(statistics.median(p for _, p in pairs), 5)}
    # the same in time a step: what the runtime adds does not scale with the step
    diff = [(tm - plain) * 1e3 for tm, plain in pairs]
    res["steady_overhead_ms"] = round(statistics.median(diff), 3)
    res["steady_overhead_ms_spread"] = [round(min(diff), 3), round(max(diff), 3)]
    means = [(d["tm_mean_s"], d["plain_mean_s"]) for d in details if d.get("tm_mean_s") and d.get("plain_mean_s")]
    if means:     # a step's time can be two-modal on a few cores: the mean weighs both modes
        res["steady_overhead_of_means"] = round(statistics.median(t / p - 1 for t, p in means), 4)
    cpus = [d["cpu_ms_per_step"] for d in details if d.get("cpu_ms_per_step")]
    if cpus:
        res["steady_cpu_ms_per_step"] = {k: round(statistics.median(c[k] for c in cpus if k in c), 3)
                                         for k in sorted({k for c in cpus for k in c})}
    return res


def table(out: dict) -> str:
    lines = [f"{'scenario':10s} {'strategy':20s} {'downtime s (median, min-max)':>30s} {'redone':>7s} {'x tm_slurm':>10s}"]
    for sc, row in out["scenarios"].items():
        for st, r in row.items():
            rng = f"{r['downtime_s']:.3f} ({r['min']:.3f}-{r['max']:.3f})"
            ratio = f"{r['ratio_vs_tm']:.1f}x" if r["ratio_vs_tm"] is not None else "-"
            lines.append(f"{sc:10s} {st:20s} {rng:>30s} {r['lost_steps']:>7} {ratio:>10s}")
    for sc, row in out["scenarios"].items():
        for st, r in row.items():
            if "joiner_first_step_s" in r:
                lines.append(f"{sc}: {st} joiner's first step {r['joiner_first_step_s']:.3f}s "
                             f"(steady {r['steady_step_s']:.3f}s)")
    for sc, row in out["scenarios"].items():
        for st, r in row.items():
            if "steps_fewer_replicas" in r:
                lines.append(f"{sc}: {st} trained {r['steps_fewer_replicas']:g} steps with fewer replicas "
                             f"(their lost samples: {r['samples_lost_s']:.3f}s of training); the restarted replica "
                             f"{'rejoined' if r['replica_rejoined'] else 'had not rejoined when the run ended'}")
            if "bit_identical" in r:
                lines.append(f"{sc}: {st}'s final state {'equal to' if r['bit_identical'] else 'NOT bit-identical to'} "
                             f"that of the same job undisturbed")
    if "frames" in out:
        lines.append(frames_table(out["frames"]))
    s = out["steady_step_s"]
    lines.append(f"steady step: tm_slurm {s['tm_slurm'] * 1e3:.2f} ms vs plain {s['plain'] * 1e3:.2f} ms: "
                 f"overhead {out['steady_overhead'] * 100:+.2f}% (median of {out['steady_overhead_n']} "
                 f"pairs, {out['steady_overhead_spread'][0] * 100:+.2f}% to {out['steady_overhead_spread'][1] * 100:+.2f}%), "
                 f"{out['steady_overhead_ms']:+.3f} ms a step ({out['steady_overhead_ms_spread'][0]:+.3f} to "
                 f"{out['steady_overhead_ms_spread'][1]:+.3f})")
    if "steady_overhead_of_means" in out:
        lines.append(f"  of the mean steps: {out['steady_overhead_of_means'] * 100:+.2f}% (median of the pairs)")
    if "steady_cpu_ms_per_step" in out:
        lines.append("  the job's processes under the runtime, CPU ms a step (median of the pairs): " +
                     ", ".join(f"{k} {v:.3f}" for k, v in out["steady_cpu_ms_per_step"].items()))
    if "plot" in out:
        lines.append(f"plot: {out['plot']}")
    return "\n".join(lines)
