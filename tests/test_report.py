"""`tm-slurm report` on a synthetic events.jsonl: the interruptions, downtime and GPU time saved,
the restart estimate's sources, and the timeline PNG."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tm_slurm import jobdir, report

T0 = 1_800_000_000.0
NODES = ["node1", "node2", "node3", "node4", "node5"]


def write_job(d: Path, *, finish: bool = True) -> Path:
    """A 4+1 job (DP=2 x PP=2) of 80 s: node3 drained at +30 s and moved to the standby node5;
    node6 joined as a new standby at +45 s; node4 failed at +60 s and was recovered on node6."""
    evs = []

    def e(dt, kind, node=None, **kw):
        evs.append({"ts": T0 + dt, "job": "70001", "gen": 0, "node": node, "rank": None,
                    "step": None, "kind": kind, **kw})

    for i, n in enumerate(NODES):
        e(0.0, "node_role", n, role="STANDBY" if n == "node5" else "ACTIVE", prev=None)
    e(0.1, "job_start", nodes=NODES, layout={"dp": 2, "pp": 2, "tp": 1, "ranks_per_node": 1})
    e(10.0, "job_state", state="RUNNING", prev="STARTING")
    e(29.6, "slurm_event", "node3", cause="drain", planned=True, reason="maint")
    e(30.0, "swap_planned", "node3", plan=1, joiner="node5", reason="slurm drain: maint")
    e(30.0, "node_role", "node3", role="LEAVING", prev="ACTIVE")
    e(30.0, "node_role", "node5", role="JOINING", prev="STANDBY")
    e(30.0, "job_state", state="SWAPPING", prev="RUNNING")
    e(30.2, "switch", "node3", plan=1, joiner="node5")
    e(30.2, "node_role", "node5", role="ACTIVE", prev="JOINING")
    e(30.2, "job_state", state="RUNNING", prev="SWAPPING")
    e(30.4, "node_role", "node3", role="RELEASED", prev="LEAVING")
    e(30.5, "node_released", "node3", result="released: job now on 4 nodes")
    e(32.0, "swap_complete", "node3", plan=1, reason="slurm drain: maint", stall_s=0.05,
      event_to_plan_s=0.4)
    e(45.0, "node_role", "node6", role="STANDBY", prev=None)
    e(60.0, "node_role", "node4", role="FAILED", prev="ACTIVE")
    e(60.0, "failure_detected", "node4", how="heartbeat_timeout", detect_s=2.1)
    e(60.0, "job_state", state="RECOVERING", prev="RUNNING")
    e(60.2, "node_role", "node6", role="ACTIVE", prev="STANDBY")
    e(60.3, "job_state", state="RUNNING", prev="RECOVERING")
    e(60.9, "recovery_complete", "node4", how="heartbeat_timeout", failed_nodes=["node4"],
      detect_s=2.1, stall_s=0.3, lost_steps=1, fallback=None)
    if finish:
        e(80.0, "job_state", state="FINISHED", prev="STOPPING")
        e(80.0, "job_end", state="FINISHED", exit_code=0)
    jobdir.events_file(d).parent.mkdir(parents=True, exist_ok=True)
    jobdir.events_file(d).write_text("".join(json.dumps(x) + "\n" for x in evs) + '{"ts": torn')
    return d


@pytest.fixture
def job(tmp_path):
    return write_job(tmp_path / "tm_slurm_jobs" / "70001")


def test_summary_numbers(job):
    s = report.summarize(job)
    assert (s.job, s.state, s.gpus, s.active, s.standbys) == ("70001", "FINISHED", 4, 4, 1)
    assert s.nodes == NODES + ["node6"]
    assert s.duration_s == pytest.approx(80.0)
    planned, unplanned = s.interruptions
    assert (planned.kind, planned.node, planned.cause) == ("planned", "node3", "slurm drain: maint")
    assert (planned.at_s, planned.detect_s, planned.stall_s, planned.lost_steps) == (30.0, 0.4, 0.05, 0)
    assert (unplanned.kind, unplanned.node, unplanned.cause) == ("unplanned", "node4", "heartbeat_timeout")
    assert (unplanned.at_s, unplanned.detect_s, unplanned.stall_s, unplanned.lost_steps) == (60.0, 2.1, 0.3, 1)
    assert s.downtime_s == pytest.approx(0.35)
    assert report.PAPER_RESTART_S == 388.2
    assert s.restart_estimate_s == {"planned": 388.2, "unplanned": 388.2}
    assert s.saved_gpu_s == pytest.approx(((388.2 - 0.05) + (388.2 - 0.3)) * 4, abs=0.1)
    assert s.standby_idle_gpu_s == pytest.approx(30.0 + 15.2, abs=0.1)   # node5 0-30 s, node6 45-60.2 s
    assert s.not_measured == 0


def test_restart_estimate_from_the_flag_and_from_a_bench_file(job, tmp_path):
    s = report.summarize(job, restart_estimate_s=100.0)
    assert s.saved_gpu_s == pytest.approx((99.95 + 99.7) * 4, abs=0.1)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"scenarios": {
        "planned": {"checkpoint-restart": {"downtime_s": {"median": 50.0}}, "tm_slurm": {"downtime_s": 0.1}},
        "unplanned": {"checkpoint-restart": {"downtime_s": 80.0}}}}))
    s = report.summarize(job, bench=bench)
    assert s.restart_estimate_s == {"planned": 50.0, "unplanned": 80.0}
    assert s.saved_gpu_s == pytest.approx((49.95 + 79.7) * 4, abs=0.1)
    assert "bench" in s.restart_source


def test_a_switch_without_a_measured_stall_is_listed_not_priced(tmp_path):
    d = tmp_path / "j"
    write_job(d, finish=False)
    lines = [ln for ln in jobdir.events_file(d).read_text().splitlines() if '"swap_complete"' not in ln]
    jobdir.events_file(d).write_text("\n".join(lines) + "\n")
    s = report.summarize(d)
    assert [i.kind for i in s.interruptions] == ["planned", "unplanned"]
    assert s.interruptions[0].stall_s is None and s.not_measured == 1
    assert s.state == "RUNNING"
    assert s.saved_gpu_s == pytest.approx((388.2 - 0.3) * 4, abs=0.1)


def test_cli_prints_the_summary_and_writes_the_png(job, capsys):
    ap = argparse.ArgumentParser()
    report.add_parser(ap.add_subparsers())
    args = ap.parse_args(["report", "--job", str(job)])
    assert args.fn(args) == 0
    out = capsys.readouterr().out
    assert "job 70001: FINISHED after 80.0 s" in out
    assert "4 GPUs (ranks); at the start 4 active + 1 standby nodes, 6 nodes in all" in out
    assert "planned    node3     slurm drain: maint" in out and "0.050 s" in out
    assert "unplanned  node4     heartbeat_timeout" in out and "2.10 s" in out and "0.300 s  1" in out
    assert "total downtime: 0.350 s" in out
    assert "GPU time saved vs restarting: 0.862 GPU-h (3104 GPU-s over 4 GPUs)" in out
    png = job / "timeline.png"
    assert f"timeline: {png}" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_cli_json_and_png_path(job, tmp_path, capsys):
    ap = argparse.ArgumentParser()
    report.add_parser(ap.add_subparsers())
    out_png = tmp_path / "pics" / "t.png"
    args = ap.parse_args(["report", "--job", str(job), "--png", str(out_png), "--json",
                          "--restart-estimate-s", "60"])
    assert args.fn(args) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["timeline"] == str(out_png) and out_png.stat().st_size > 0
    assert d["restart_estimate_s"] == {"planned": 60.0, "unplanned": 60.0}
    assert [i["kind"] for i in d["interruptions"]] == ["planned", "unplanned"]


def test_a_job_without_events_is_an_error(tmp_path, capsys):
    d = tmp_path / "empty"
    jobdir.control_dir(d)
    ap = argparse.ArgumentParser()
    report.add_parser(ap.add_subparsers())
    args = ap.parse_args(["report", "--job", str(d), "--no-png"])
    assert args.fn(args) == 2
    assert "no events in" in capsys.readouterr().err
