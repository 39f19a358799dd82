"""Unplanned failures with real processes really killed (issue: unplanned failures).

Each test injects a failure at a step of the example job and asserts that the job ends
bit-identical to an undisturbed run (for checkpoint fallbacks: a run that replays from the
checkpoint, which with keyed data and RNG is the same thing), and that nothing is left behind.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tm_slurm import jobdir
from tm_slurm.config import Layout
from tm_slurm.demo import example_paths
from tm_slurm.launch.local import fail, inject
from tm_slurm.topology import Topology
from tm_slurm import checkpoints as ckpt

from ..jobs import ROBUST, UNPACED, no_leftovers, run_job, same_state

pytestmark = pytest.mark.procs
STEPS = 100


def _one_recovery(ran, node, *hows):
    (rec,) = ran.interruption("unplanned")
    assert rec["node"] == node and rec["how"] in hows, rec
    assert rec["lost_steps"] <= 1 and rec["stall_s"] is not None and rec["detect_s"] is not None
    assert rec["groups_kept"] >= 1
    return rec


def test_worker_killed_mid_step_last_stage(tmp_path, reference):
    ran = run_job(tmp_path, "4+1", STEPS, [(12, "exit", "node3")])     # rank 2: last stage, dp 0
    assert ran.rc == 0 and ran.result["digests"] == reference(STEPS)
    rec = _one_recovery(ran, "node3", "worker_exit")
    assert rec["fallback"] is None and rec["state_bytes"] > 0


def test_whole_node_killed_first_stage(tmp_path, reference):
    ran = run_job(tmp_path, "4+1", STEPS, [(12, "kill", "node2")])     # rank 1: first stage, dp 1
    assert ran.rc == 0 and ran.result["digests"] == reference(STEPS)
    # the agent's process ending, or the first message to it failing: whichever comes first
    _one_recovery(ran, "node2", "agent_exit", "link_broken")


def test_sigstop_hang_is_fenced_and_recovered(tmp_path, reference):
    ran = run_job(tmp_path, "4+1", STEPS, [(12, "hang", "node4")])
    assert ran.rc == 0 and ran.result["digests"] == reference(STEPS)
    rec = _one_recovery(ran, "node4", "heartbeat_timeout")
    assert rec["detect_s"] < 10


def test_no_replica_falls_back_to_the_last_checkpoint(tmp_path, reference):
    layout = ("--dp", "1", "--pp", "2")
    ran = run_job(tmp_path, "2+1", 60, [(25, "kill", "node1")], layout=layout)
    assert ran.rc == 0 and ran.result["digests"] == reference(60, layout, active=2)
    (rec,) = ran.interruption("unplanned")
    # resumed from a checkpoint (every 10 steps here); a kill right after one redoes just 1 step
    assert rec["fallback"] == "checkpoint" and rec["resume_step"] % 10 == 0 and rec["lost_steps"] >= 1


def _corrupt_newest_and_kill_node2(job_dir):
    # node2 (the only holder of stage 1) is frozen first, so no newer checkpoint can complete
    # between the corruption and its death: the one corrupted here is the newest valid one
    inject(job_dir, "node2", "hang")
    (step, d), _ = ckpt.latest_valid(job_dir / "checkpoints", Topology(Layout(dp=1, pp=2)))
    p = d / "pp1.tp0" / "__0_0.distcp"
    p.write_bytes(p.read_bytes()[:-16] + bytes(16))
    fail(job_dir, "node2", "kill")


def test_corrupt_last_checkpoint_uses_the_previous_one(tmp_path, reference):
    layout = ("--dp", "1", "--pp", "2")
    ran = run_job(tmp_path, "2+1", 60, [(25, _corrupt_newest_and_kill_node2, None)], layout=layout)
    assert ran.rc == 0 and ran.result["digests"] == reference(60, layout, active=2)
    rejected = ran.kinds("checkpoint_rejected")
    # the corrupted one, and any newer one node2 did not live to finish: all missing stage 1
    assert rejected and all("pp1.tp0" in r["why"] for r in rejected)
    (rec,) = ran.interruption("unplanned")
    assert rec["fallback"] == "checkpoint" and rec["resume_step"] < rejected[-1]["step"]


def test_no_standby_checkpoints_exits_requeueable_and_resumes(tmp_path, reference):
    ran = run_job(tmp_path, "4+0", STEPS, [(30, "kill", "node4")], sets=["standby.count=0"])
    assert ran.rc == 75, "a checkpoint-and-exit ends with EX_TEMPFAIL (requeue me)"
    (ex,) = ran.kinds("checkpoint_exit")
    assert ran.kinds("standbys_exhausted")[0]["action"] == "checkpoint_exit"
    d = ckpt.step_dir(ran.job_dir / "checkpoints", ex["step"])
    assert d.is_dir() and not ckpt.bad_shards(d, Topology(Layout(dp=2, pp=2)))
    # the requeued job: same job directory, --resume; nothing else changes
    script, cfg = example_paths()
    cmd = [sys.executable, "-m", "tm_slurm", "run", "--local", "4+0", "--config", str(cfg),
           "--job-dir", str(ran.job_dir), "--resume", "--set", "standby.count=0"]
    for s in ROBUST:
        cmd += ["--set", s]
    rc = subprocess.run(cmd + ["--", sys.executable, str(script), "--steps", str(STEPS), *UNPACED],
                        timeout=400, capture_output=True).returncode
    no_leftovers(ran.job_dir)
    assert rc == 0
    res = json.loads((ran.job_dir / "result.json").read_text())
    assert res["digests"] == reference(STEPS)


def test_no_standby_wait_policy_then_checkpoint(tmp_path):
    ran = run_job(tmp_path, "4+0", STEPS, [(20, "kill", "node1")],
                  sets=["standby.count=0", "standby.when_exhausted=wait", "standby.wait_s=6"])
    assert ran.rc == 75
    actions = [e["action"] for e in ran.kinds("standbys_exhausted")]
    assert actions[0] == "wait" and actions[-1] == "checkpoint_exit"
    assert ran.kinds("checkpoint_exit")


def test_no_standby_shrink_drops_the_replica_and_trains_on_at_half_size(tmp_path):
    """`when_exhausted: shrink`: replica 0 loses node1; replica 1 (node2, node4) goes on as the
    dp=1 job, node3 (node1's partner) becomes a standby. The result must equal a dp=1 job
    started from the shrink checkpoint: the shrunk job is exactly a fresh job of that size.
    node1 dies at its first periodic checkpoint (step 10) before writing its shard, while node3
    writes its own: the shrink's checkpoint is of that same step, so node3's shard is on disk
    already and is not written again (a rewrite removed it while the controller verified the
    checkpoint, which then never completed: CI, 2026-12-07)."""
    steps = 250                   # time enough for node3 to warm up as a standby after the shrink
    ran = run_job(tmp_path, "4+0", steps, sets=["standby.count=0", "standby.when_exhausted=shrink",
                                               "checkpoint.keep=100"], faults="checkpoint.periodic@node1")
    assert ran.rc == 0
    assert ran.kinds("standbys_exhausted")[0]["action"] == "shrink"
    (planned,) = ran.kinds("shrink_planned")
    assert (planned["dp_from"], planned["dp_to"], planned["freed"]) == (2, 1, ["node3"])
    assert planned["step"] == 10 and not ran.kinds("checkpoint_invalid")
    (rec,) = ran.interruption("unplanned")
    assert rec["strategy"] == "shrink" and rec["dp_to"] == 1 and rec["lost_steps"] <= 1
    slots = {e["node"]: e["slot"] for e in ran.kinds("node_slot")}
    assert slots == {"node2": 0, "node4": 1}
    roles = [(e["node"], e["role"]) for e in ran.kinds("node_role")]
    assert ("node3", "STANDBY") in roles and ("node1", "FAILED") in roles
    assert any(e["node"] == "node3" for e in ran.kinds("node_ready")), "node3 warmed up as a standby"

    d = ckpt.step_dir(ran.job_dir / "checkpoints", planned["step"])
    # the shrink checkpoint is the state an undisturbed job has at that step (what the smaller
    # job below starts from: a wrong one would make both agree and still be wrong)
    undisturbed = run_job(tmp_path / "undisturbed", "4+0", planned["step"], sets=["standby.count=0"], paced=False)
    assert undisturbed.rc == 0
    same_state(d, ckpt.step_dir(undisturbed.job_dir / "checkpoints", planned["step"]))
    script, cfg = example_paths()
    cmd = [sys.executable, "-m", "tm_slurm", "run", "--local", "2+0", "--config", str(cfg), "--dp", "1",
           "--pp", "2", "--job-dir", str(tmp_path / "ref"), "--resume", str(d), "--set", "standby.count=0"]
    for s in ROBUST:
        cmd += ["--set", s]
    rc = subprocess.run(cmd + ["--", sys.executable, str(script), "--steps", str(steps), *UNPACED],
                        timeout=400, capture_output=True).returncode
    no_leftovers(tmp_path / "ref")
    assert rc == 0
    ref = json.loads((tmp_path / "ref" / "result.json").read_text())
    assert ran.result["digests"] == ref["digests"]


def test_a_full_disk_mid_run_costs_checkpoints_not_the_job(tmp_path, reference):
    """The job directory on a real 32 MiB tmpfs, filled at step 15 and freed 4 s later: the job
    trains on (no node failure, no standby spent), the checkpoints in between fail without
    leaving partial shards, the lost events are counted, and the run ends bit-identical."""
    if os.geteuid() != 0:
        pytest.fail("mounts a tmpfs: run as root (./dev test does)")
    job = tmp_path / "job"
    job.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,mode=0700", "tmpfs", str(job)], check=True)
    filler, held = job / "filler", []

    def take_every_page():
        # the filler, then the slack of the event log's last page (blank lines, which readers skip)
        for path, chunk in ((filler, b"\0" * (1 << 16)), (jobdir.events_file(job), b"\n" * 512)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                while os.write(fd, chunk):
                    pass
            except OSError:
                pass
            finally:
                os.close(fd)

    def hold(until):
        # full for the whole 4 s, as a disk that something else keeps filling: the pages a failed
        # checkpoint frees are taken again within a millisecond, before the controller logs the
        # failure (taken once only, they held the next events and no event was lost)
        while time.monotonic() < until:
            take_every_page()
            time.sleep(0.001)
        filler.unlink()

    def fill(_job):
        take_every_page()
        held.append(threading.Thread(target=hold, args=(time.monotonic() + 4.0,)))
        held[0].start()

    try:
        ran = run_job(tmp_path, "4+1", STEPS, [(15, fill, "-")])
        topo = Topology(Layout(dp=2, pp=2))
        # a shard that is there is whole: a failed write left nothing of it
        half = [(d.name, s) for d in (ran.job_dir / "checkpoints").glob("step*")
                for s in ckpt.bad_shards(d, topo) if (d / s).exists()]
        valid = ckpt.latest_valid(ran.job_dir / "checkpoints", topo)[0]
    finally:
        for t in held:
            t.join()
        subprocess.run(["umount", "-l", str(job)], check=False)
    assert ran.rc == 0 and ran.result["digests"] == reference(STEPS)
    assert ran.result["interruptions"] == [] and not ran.kinds("failure_detected")
    (dropped,) = ran.kinds("events_dropped")
    assert dropped["count"] > 0
    # checkpoints were attempted while the disk was full, and failed (their events were among
    # the lost: the event log is on the same disk), so "no partial shard" is a claim about them
    failed = dropped["kinds"].get("checkpoint_failed", 0) + len(ran.kinds("checkpoint_failed"))
    assert failed > 0, dropped
    assert half == [] and valid is not None, (half, valid)
    # a failed step is never counted complete: the valid checkpoint stays the one before it
    assert not ({e["step"] for e in ran.kinds("checkpoint_failed")}
                & {e["step"] for e in ran.kinds("checkpoint_complete")})
    print(f"\n[full disk] {dropped['count']} events dropped; checkpoints complete at "
          f"{[e['step'] for e in ran.kinds('checkpoint_complete')]}")


@pytest.mark.parametrize("backend", ["nccl-like", "gloo"])
def test_fault_matrix_with_nccl_semantics(tmp_path, reference, backend):
    """One job, three unplanned failures: a worker killed mid-step (inside a collective: the
    steps are paced), a node SIGSTOPped, and a live process hung before a collective, its
    heartbeats flowing (fault point `collective`). On nccl-like a survivor's collective with a
    dead or absent peer never ends by itself: the runtime's abort releases it. The hung node is
    named by its peers' watchdogs (hang_timeout_s) and everyone who shares a group with it has
    aborted within a second of that; the job ends bit-identical."""
    sets = [f"comm.backend={backend}", "timeouts.hang_timeout_s=5"]
    ran = run_job(tmp_path, "4+3", STEPS, [(12, "exit", "node3"), (40, "hang", "node4")], sets=sets,
                  faults="collective:70@node1=sleep600")
    assert ran.rc == 0 and ran.result["digests"] == reference(STEPS)
    recs = ran.interruption("unplanned")
    assert [(r["node"], r["how"]) for r in recs] == [("node3", "worker_exit"), ("node4", "heartbeat_timeout"),
                                                     ("node1", "hung")], recs
    assert all(r["lost_steps"] <= 1 for r in recs), recs
    (hung,) = [e for e in ran.kinds("failure_detected") if e["how"] == "hung"]
    stalled = [e for e in ran.kinds("collective_stalled") if e["ts"] <= hung["ts"]]
    assert stalled and all(e["waited_s"] >= 5 and e["node"] != "node1" for e in stalled), stalled
    aborted = [e for e in ran.kinds("comms_aborted") if e["ts"] >= hung["ts"]]
    assert aborted and all(e["t"] - hung["ts"] < 1.0 for e in aborted), (hung, aborted)


def test_a_frozen_worker_is_caught_by_the_worker_heartbeat(tmp_path, reference):
    """The node's workers SIGSTOPped, its agent alive and beating: the agent's worker heartbeat
    timeout names them (`worker_silent`), the node is fenced and its ranks recovered."""
    ran = run_job(tmp_path, "4+1", STEPS, [(12, "hang-worker", "node3")])
    assert ran.rc == 0 and ran.result["digests"] == reference(STEPS)
    rec = _one_recovery(ran, "node3", "worker_silent")
    assert rec["detect_s"] < 4 + 2, rec         # worker_heartbeat_timeout_s (ROBUST: 4 s) and a beat


def _started(job, steps: int, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while True:
        try:
            if (json.loads(jobdir.status_file(job).read_text()).get("committed_step") or 0) >= steps:
                return
        except (OSError, ValueError):
            pass
        assert time.monotonic() < end, f"{job} did not reach step {steps}"
        time.sleep(0.1)


def test_signals_to_a_local_run_sigterm_then_a_double_ctrl_c(tmp_path):
    """SIGTERM to the controller's process group (a controller that runs in a step gets the
    time limit's SIGTERM itself): a checkpoint at the next boundary and the resumable end, 75.
    Then the terminal's Ctrl-C twice: the second stops at once, 75, nothing left behind."""
    script, cfg = example_paths()

    def start(job):
        cmd = [sys.executable, "-m", "tm_slurm", "run", "--local", "4+0", "--config", str(cfg),
               "--job-dir", str(job), "--set", "standby.count=0", *sum((["--set", s] for s in ROBUST), []),
               "--", sys.executable, str(script), "--steps", "100000", *UNPACED, "--sleep", "0.06"]
        return subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def events(job):
        return [json.loads(x) for x in jobdir.events_file(job).read_text().splitlines() if x.strip()]

    term = tmp_path / "term"
    p = start(term)
    try:
        _started(term, 5)
        os.killpg(p.pid, signal.SIGTERM)
        assert p.wait(timeout=60) == 75
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    no_leftovers(term)
    ev = events(term)
    assert [e["action"] for e in ev if e["kind"] == "signal"] == ["checkpoint_exit"]
    saved = [e for e in ev if e["kind"] == "checkpoint_saved" and e.get("reason") == "time limit (SIGTERM)"]
    assert saved, [e for e in ev if e["kind"].startswith("checkpoint")]
    assert [e["state"] for e in ev if e["kind"] == "job_end"] == ["REQUEUED"]

    twice = tmp_path / "twice"
    p = start(twice)
    try:
        _started(twice, 5)
        t0 = time.monotonic()
        os.killpg(p.pid, signal.SIGINT)
        time.sleep(0.05)
        os.killpg(p.pid, signal.SIGINT)
        rc = p.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    no_leftovers(twice)
    assert rc == 75
    ev = events(twice)
    assert [e["action"] for e in ev if e["kind"] == "signal"] == ["checkpoint_exit", "stop_now"]
    print(f"\n[signals] a double Ctrl-C ended the run in {took:.2f} s")
    assert took < 15, took
