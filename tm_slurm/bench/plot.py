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
