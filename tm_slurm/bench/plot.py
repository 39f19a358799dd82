"""The benchmark's PNG: downtime per scenario and strategy (median, min-max), and the progress
of one run per strategy around the interruption (step vs time)."""
from __future__ import annotations

from pathlib import Path

from . import runs


def plot(out: dict, samples, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    scen = list(out["scenarios"])
    strategies = [s for s in runs.STRATEGIES if any(s in out["scenarios"][sc] for sc in scen)]
    fig, axes = plt.subplots(1, 1 + len(scen), figsize=(5 * (1 + len(scen)), 4.2))
    ax = axes[0]
    w = 0.8 / max(1, len(strategies))
    for i, st in enumerate(strategies):
        xs, ys, lo, hi = [], [], [], []
        for j, sc in enumerate(scen):
            r = out["scenarios"][sc].get(st)
            if r:
                xs.append(j + i * w)
                ys.append(max(r["downtime_s"], 1e-3))
                lo.append(max(r["downtime_s"] - r["min"], 0))
                hi.append(max(r["max"] - r["downtime_s"], 0))
        ax.bar(xs, ys, w, yerr=[lo, hi], label=st, capsize=3)
    ax.set_yscale("log")
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(scen))], scen)
    ax.set_ylabel("downtime per interruption, s (log)")
    ax.set_title("median, min-max")
    ax.legend(fontsize=8)
    for ax, sc in zip(axes[1:], scen):
        for st in strategies:
            s = next((x for x in samples if x.scenario == sc and x.strategy == st), None)
            if s is None:
                continue
            steps = runs._steps(Path(s.job_dir))
            t0 = steps[0].wall
            ax.plot([p.wall - t0 for p in steps], [p.step for p in steps], ".", ms=2, label=st)
        ax.set_title(f"{sc}: progress of one run")
        ax.set_xlabel("s since the first step")
        ax.set_ylabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_control_plane(results: list[dict], path: Path) -> Path:
    """`tm-slurm bench --control-plane`: each figure against the number of nodes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = [r["nodes"] for r in results]
    panels = [
        ("vote latency, ms", {"p50": "vote_p50_s", "p99": "vote_p99_s",
                              "floor p99 (bare exchange)": "floor_exchange_p99_s"}, 1e3),
        ("controller CPU per step, ms", {"total": "controller_cpu_per_step_s",
                                         "store server": "store_server_cpu_per_step_s",
                                         "floor (one bare message a node)": "floor_central_cpu_per_round_s"}, 1e3),
        ("store operations per step", {"ops": "store_ops_per_step"}, 1),
        ("plan and announce, ms", {"swap": "swap_plan_s", "recovery": "recovery_plan_s"}, 1e3),
        ("controller RSS, MB", {"start": "rss_start_mb", "end": "rss_end_mb"}, 1),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (title, series, k) in zip(axes, panels):
        for label, key in series.items():
            ax.plot(n, [r[key] * k for r in results], "o-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(x) for x in n])
        ax.set_xlabel(f"nodes (x{results[0]['ranks_per_node']} ranks)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
