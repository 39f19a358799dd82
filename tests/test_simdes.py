"""The discrete-event projection (tm_slurm/simdes.py) and its CLI. Pure Python, no processes."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from tm_slurm import sim, simdes
from tests.test_sim import _cli

# the analytic model's assumptions: Poisson failures of one node, fixed waits, no repeats or hangs,
# a free checkpoint at the analytic interval, no overhead
NO_VARIABILITY = simdes.DESConfig(trace=None, gaps="exponential", waits="fixed", repeat_p=0.0, ckpt_write_s=0.0,
                                  ckpt_interval_s=600.0, seeds=8)


def _with_standbys(p: sim.Params, k: int) -> sim.Params:
    p.strategies["tm_slurm"].standby_nodes = k
    return p


def test_llama3_trace_counts():
    causes = simdes.LLAMA3_CAUSES
    assert sum(n for _, n, _ in causes) == 419 + 47
    assert sum(n for _, n, kind in causes if kind == "planned") == 47
    assert {kind for _, _, kind in causes} == {"planned", "unplanned", "hang", "switch"}
    # rate scaled by size: 4x the GPUs of the report, 4x its events
    classes = simdes.event_classes(sim.default_params(), simdes.DESConfig(), 65536)
    assert sum(r for _, _, r in classes) * 54 * 24 == pytest.approx(4 * 466)


def test_young_daly():
    assert simdes.young_daly(60, 3600) == pytest.approx(math.sqrt(2 * 60 * 3600))
    cfg = simdes.DESConfig(seeds=1, weeks=0.5)
    d = simdes.simulate(sim.default_params(), cfg, 65536)
    assert d["checkpoint_interval_s"] == pytest.approx(math.sqrt(2 * 60 * d["failure_mttf_s"]))
    # the llama3 failures at 64K GPUs: 419 x 4 in 54 days
    assert d["failure_mttf_s"] == pytest.approx(54 * 24 * 3600 / (419 * 4))


def test_same_seed_same_result_other_seed_differs():
    cfg = simdes.DESConfig(seeds=3, weeks=1)
    a = simdes.simulate(sim.default_params(), cfg, 16384)
    b = simdes.simulate(sim.default_params(), cfg, 16384)
    c = simdes.simulate(sim.default_params(), dataclasses.replace(cfg, seed=7), 16384)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert a["strategies"]["tm_slurm"]["waste_gpu_h_per_week"] != c["strategies"]["tm_slurm"]["waste_gpu_h_per_week"]


def test_agrees_with_the_analytic_model_without_variability():
    p = sim.default_params()
    d = simdes.simulate(p, NO_VARIABILITY, 8192)
    a = sim.project(p, 8192)
    for name in sim.STRATEGIES:
        assert d["strategies"][name]["ettr"] == pytest.approx(a["strategies"][name]["ettr"], abs=0.01)
        assert d["strategies"][name]["events_per_week"] == pytest.approx(
            a["strategies"][name]["events_per_week"]["total"], rel=0.1)
    assert d["reduction_vs_best"] == pytest.approx(a["reduction_vs_best"], abs=0.03)
    assert d["strategies"]["tm_slurm"]["standby_miss_rate"] == pytest.approx(
        a["strategies"]["tm_slurm"]["standby_miss_fraction"], abs=0.02)


def test_correlated_failures_and_standby_count_drive_misses():
    one_node = simdes.DESConfig(seeds=4, weeks=2, switch_nodes=(1, 1))
    racks = dataclasses.replace(one_node, switch_nodes=(4, 4))
    miss = lambda cfg, k: simdes.simulate(_with_standbys(sim.default_params(), k), cfg, 65536)[
        "strategies"]["tm_slurm"]["standby_miss_rate"]
    assert miss(racks, 2) > miss(one_node, 2)        # a switch needs several standbys at once
    assert miss(one_node, 0) == 1.0
    assert miss(one_node, 1) > miss(one_node, 2) > miss(one_node, 4)
    # the other strategies hold no pool
    d = simdes.simulate(sim.default_params(), one_node, 65536)
    assert all(d["strategies"][n]["standby_miss_rate"] is None for n in sim.STRATEGIES if n != "tm_slurm")


def test_hangs_cost_the_restart_strategies_their_watchdog():
    hangs = dataclasses.replace(NO_VARIABILITY, seeds=2)
    p = sim.default_params()
    p.hang_fraction = 1.0
    slow = simdes.simulate(p, hangs, 8192)["strategies"]
    quick = simdes.simulate(p, dataclasses.replace(hangs, hang_detect_restart_s=30.0), 8192)["strategies"]
    assert slow["checkpoint-restart"]["waste_gpu_h_per_week"] > quick["checkpoint-restart"]["waste_gpu_h_per_week"]
    assert slow["tm_slurm"]["waste_gpu_h_per_week"] == quick["tm_slurm"]["waste_gpu_h_per_week"]


def test_checkpoint_writes_and_overhead_are_charged():
    cfg = simdes.DESConfig(seeds=2, weeks=1)
    p = simdes.with_overhead(sim.default_params())
    assert p.runtime_overhead == simdes.ASSUMED_OVERHEAD and p.runtime_overhead_source == "assumed"
    d = simdes.simulate(p, cfg, 65536)["strategies"]
    assert d["checkpoint-restart"]["wasted_gpu_hours_per_week"]["checkpoint"] > 0
    assert d["tm_slurm"]["wasted_gpu_hours_per_week"]["checkpoint"] == 0
    assert d["tm_slurm"]["wasted_gpu_hours_per_week"]["overhead"] > 0
    assert d["elastic-restart"]["wasted_gpu_hours_per_week"]["overhead"] == 0
    # given ones win over the assumed value
    p = sim.default_params()
    p.runtime_overhead, p.runtime_overhead_source = 0.05, "override"
    assert simdes.with_overhead(p).runtime_overhead == 0.05


def test_trace_file(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("time_h,kind,nodes\n1,unplanned,1\n2,hang,1\n3,planned,1\n5,unplanned,3\n")
    cfg = simdes.DESConfig(trace=str(f), seeds=2, weeks=1)
    d = simdes.simulate(sim.default_params(), cfg, 8192)
    assert d["strategies"]["tm_slurm"]["events_per_week"] == 4
    j = tmp_path / "t.json"
    j.write_text(json.dumps({"events": [{"time_h": 1, "kind": "unplanned", "nodes": 2}]}))
    assert simdes.load_trace(j) == [(3600.0, "unplanned", 2)]
    f.write_text("time_h,kind,nodes\n1,unplanned,1\n2,meteor,1\n")
    with pytest.raises(ValueError, match="line 3"):
        simdes.load_trace(f)
    j.write_text(json.dumps([{"time_h": "soon", "kind": "hang"}]))
    with pytest.raises(ValueError, match="event 0"):
        simdes.load_trace(j)


def test_weibull_gaps_keep_the_mean_rate():
    cfg = simdes.DESConfig(seeds=6, weeks=2, gaps="weibull", weibull_shape=0.7, repeat_p=0.0)
    d = simdes.simulate(sim.default_params(), cfg, 65536)
    assert d["strategies"]["tm_slurm"]["events_per_week"] == pytest.approx(466 * 4 / 54 * 7, rel=0.15)


# ---------------------------------------------------------------- CLI

def test_cli_trace_json(capsys):
    rc, out, _ = _cli(["--gpus", "65536", "--trace", "llama3", "--seeds", "4", "--weeks", "1", "--json"], capsys)
    assert rc == 0
    d = json.loads(out)
    assert set(d["strategies"]) == set(sim.STRATEGIES)
    for s in d["strategies"].values():
        assert {"ettr", "waste_gpu_h_per_week", "standby_miss_rate", "ettr_ci", "waste_ci"} <= set(s)
        assert 0 < s["ettr"] < 1
    lo, hi = d["reduction_vs_best_ci"]
    assert lo <= d["reduction_vs_best"] <= hi and 0 < lo
    assert 0 < d["strategies"]["tm_slurm"]["standby_miss_rate"] < 1
    sources = {i["name"]: i["source"] for i in d["inputs"]}
    assert all({"name", "value", "unit", "source"} <= set(i) for i in d["inputs"])
    assert sources["runtime_overhead"] == "assumed" and sources["trace faulty GPU"] == "Llama 3 report"
    rc, out, _ = _cli(["--trace", "llama3", "--seeds", "2", "--weeks", "1", "--overhead", "0.05", "--json"], capsys)
    over = next(i for i in json.loads(out)["inputs"] if i["name"] == "runtime_overhead")
    assert over["value"] == 0.05 and over["source"] == "override"


def test_cli_rejects_bad_input(capsys, tmp_path):
    rc, _, err = _cli(["--trace", "llama2"], capsys)
    assert rc == 2 and "llama3" in err
    bad = tmp_path / "bad.csv"
    bad.write_text("time_h,kind,nodes\nx,unplanned,1\n")
    rc, _, err = _cli(["--trace", str(bad)], capsys)
    assert rc == 2 and "line 2" in err
    rc, _, err = _cli(["--gaps", "weibull", "--weibull-shape", "0"], capsys)
    assert rc == 2 and "--weibull-shape" in err


def test_cli_plan_standbys_with_trace(tmp_path, capsys):
    png = tmp_path / "sb.png"
    rc, out, _ = _cli(["--plan-standbys", "--gpus", "65536", "--trace", "llama3", "--seeds", "2", "--weeks", "1",
                       "--plot", str(png), "--json"], capsys)
    d = json.loads(out)
    assert rc == 0 and [c["standbys"] for c in d["curve"]] == list(range(9))
    assert d["model"].startswith("discrete-event")
    assert 1 <= d["standbys"] <= 8 and d["curve"][0]["standby_miss_rate"] == 1.0
    assert png.stat().st_size > 0


def test_cli_sensitivity(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "s.png"
    rc, out, _ = _cli(["--sensitivity", str(png), "--json"], capsys)
    d = json.loads(out)
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(d["curves"]) == {"rescheduling_s", "mttf_ref_h", "standbys"}
    mttf = [c["reduction_vs_best"] for c in d["curves"]["mttf_ref_h"]]
    assert mttf == sorted(mttf)                      # rarer failures: fewer find the standby in use
    # no standby: tm_slurm is its no-standby variant
    assert d["curves"]["standbys"][0]["reduction_vs_best"] == pytest.approx(0.0, abs=1e-9)
