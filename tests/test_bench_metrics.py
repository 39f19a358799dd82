"""The benchmark's accounting on synthetic step logs (no processes, no timing)."""
import pytest

from tm_slurm.bench import metrics as M
from tm_slurm.bench.cli import report
from tm_slurm.bench import runs
from tm_slurm.demo import EXAMPLES
from tm_slurm.bench.runs import Sample


def run(n, pace=0.1, gap_after=None, gap=0.0, redo_from=None, t0=100.0):
    """Steps 0..n-1 at `pace`; after step `gap_after` the job stops for `gap` seconds and, with
    `redo_from`, resumes from that step (a restart from a checkpoint)."""
    out, t, s = [], t0, 0
    while s < n:
        t += pace
        out.append(M.Step(s, t, pace))
        if s == gap_after:
            t += gap
            if redo_from is not None:
                s = redo_from - 1
            gap_after = None
        s += 1
    return out


def test_no_interruption_costs_nothing():
    steps = run(60)
    dt, d = M.downtime(steps, t_event=steps[20].wall + 0.05)
    assert dt == pytest.approx(0.0, abs=1e-9) and d["lost_steps"] == 0


def test_a_stall_is_counted_once():
    steps = run(60, gap_after=20, gap=0.7)
    dt, d = M.downtime(steps, t_event=steps[20].wall + 0.01)
    assert dt == pytest.approx(0.7) and d["lost_steps"] == 0


def test_a_restart_counts_the_gap_and_the_redone_steps():
    steps = run(80, gap_after=25, gap=5.0, redo_from=20)       # steps 20..25 done twice
    dt, d = M.downtime(steps, t_event=steps[25].wall + 0.01)
    assert d["lost_steps"] == 6
    assert dt == pytest.approx(5.0 + 6 * 0.1)


def test_pace_is_the_tail_of_the_run():
    steps = run(40, pace=0.2)[:20] + [M.Step(s, 104.0 + (s - 19) * 0.1, 0.1) for s in range(20, 60)]
    assert M.pace(steps) == pytest.approx(0.1)


def test_report_ratios_and_overhead():
    samples = [Sample("planned", "tm_slurm", 0.05, 0, 0.1, "", {}), Sample("planned", "tm_slurm", 0.07, 0, 0.1, "", {}),
               Sample("planned", "tm_slurm", 0.06, 0, 0.1, "", {}),
               Sample("planned", "checkpoint-restart", 12.0, 0, 0.1, "", {})]
    out = report(samples, ["planned"], ["tm_slurm", "checkpoint-restart"],
                 pairs=[(0.101, 0.1), (0.2, 0.1), (0.099, 0.1)])     # one disturbed pair
    r = out["scenarios"]["planned"]
    assert r["tm_slurm"] == {"downtime_s": 0.06, "min": 0.05, "max": 0.07, "n": 3, "lost_steps": 0,
                             "steady_step_s": 0.1, "ratio_vs_tm": 1.0}
    assert r["checkpoint-restart"]["ratio_vs_tm"] == 200.0
    assert out["steady_overhead"] == pytest.approx(0.01)
    assert out["steady_overhead_spread"] == [pytest.approx(-0.01), pytest.approx(1.0)]
    assert out["steady_overhead_n"] == 3


@pytest.mark.parametrize("example", sorted(EXAMPLES))
@pytest.mark.parametrize("strategy", runs.STRATEGIES)
@pytest.mark.parametrize("scenario", runs.SCENARIOS)
def test_every_strategy_runs_with_a_valid_config(strategy, scenario, example):
    from pathlib import Path

    from tm_slurm import config as C
    ex = EXAMPLES[example]
    cfg = C.load(Path(__file__).parent.parent / "sbatch" / "example.yaml",
                 dict(C.parse_override(s) for s in runs._sets(strategy, scenario, 30.0, ex)))
    if ex.api == "init":     # what tm_slurm.init() requires of a standby
        assert cfg.standby.sandbox and cfg.standby.sandbox_steps >= 2


def test_a_stall_long_after_the_event_counts_when_the_runtime_says_it_was_then():
    # a planned swap with a cold joiner: training goes on through phase 1, the switch stalls later
    steps = run(80, gap_after=40, gap=1.5)
    t_event = steps[20].wall + 0.01
    assert M.downtime(steps, t_event)[0] == pytest.approx(0.0)          # outside the window
    dt, d = M.downtime(steps, t_event, t_done=steps[41].wall + 0.01)
    assert dt == pytest.approx(1.5) and d["window_to_step"] == 47


def test_a_log_missing_steps_measures_to_the_next_step_it_has():
    # a process that left took its last report along: steps 21..30 are not in the log
    steps = [s for s in run(80, gap_after=20, gap=0.5) if not 21 <= s.step <= 30]
    dt, d = M.downtime(steps, t_event=steps[20].wall + 0.01)
    assert d["window_to_step"] == 31 and dt == pytest.approx(0.5)


def test_report_overhead_in_ms_of_means_and_cpu():
    details = [{"tm_mean_s": 0.0055, "plain_mean_s": 0.005, "cpu_ms_per_step": {"store": 0.4, "controller": 0.2}},
               {"tm_mean_s": 0.0051, "plain_mean_s": 0.005, "cpu_ms_per_step": {"store": 0.6}},
               {"tm_mean_s": None, "plain_mean_s": 0.005, "cpu_ms_per_step": {}}]
    out = report([], [], [], pairs=[(0.0042, 0.004), (0.0041, 0.004), (0.0050, 0.004)], details=details)
    assert out["steady_overhead_ms"] == pytest.approx(0.2)
    assert out["steady_overhead_ms_spread"] == [pytest.approx(0.1), pytest.approx(1.0)]
    assert out["steady_overhead_of_means"] == pytest.approx(0.06)
    assert out["steady_cpu_ms_per_step"] == {"controller": 0.2, "store": 0.5}
    from tm_slurm.bench.cli import table
    assert "ms a step" in table(out)


def test_the_job_processes_are_told_apart():
    from tm_slurm.bench.runs import _role
    py = "/venv/bin/python"
    assert _role([py, "-m", "tm_slurm", "run", "--local", "2+0", "--", py, "x/ddp_example.py"], 1, 1,
                 "ddp_example.py") == "launcher"
    assert _role([py, "-m", "tm_slurm", "run", "--local", "2+0", "--", py, "x/ddp_example.py"], 1, 2,
                 "ddp_example.py") == "controller"
    assert _role([py, "-m", "tm_slurm.control.pmi", py, "-m", "tm_slurm", "agent"], 1, 3, "ddp_example.py") == "pmi"
    assert _role([py, "-m", "tm_slurm", "agent", "--", py, "x/ddp_example.py"], 1, 4, "ddp_example.py") == "agent"
    assert _role([py, "-m", "tm_slurm.store.process", "127.0.0.1"], 1, 5, "ddp_example.py") == "store"
    assert _role([py, "x/ddp_example.py", "--steps", "5"], 1, 6, "ddp_example.py") == "worker"


def test_the_machine_busy_share_is_a_share():
    assert 0.0 <= M.machine_busy(0.05) <= 1.0
    assert 0.0 <= M.wait_quiet(most=1.0, patience=0.0) <= 1.0     # at once: any share will do
