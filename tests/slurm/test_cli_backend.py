"""CliBackend against a real Slurm cluster (22.05.8 in development). Every test is `slurm`.

    pytest tests/slurm/test_cli_backend.py -q -m slurm        (as root)

Uses node1..node5 and restores what it changes (jobs scancelled, drains resumed, reboots
cancelled, reservations deleted), each test on its own nodes. About 30 s in all.
"""
from __future__ import annotations

import getpass
import os
import shlex
import subprocess
import time

import pytest

from tm_slurm.config import Config
from tm_slurm.slurm import hostlist
from tm_slurm.slurm.backend import SlurmError
from tm_slurm.slurm.choose import backend_for, slurm_version
from tm_slurm.slurm.classify import EventDebouncer, classify
from tm_slurm.slurm.cli_backend import CliBackend
from tm_slurm.slurm.launcher import DB_INDEX_HOLD, SlurmLauncher

pytestmark = pytest.mark.slurm

ALL = [f"node{i}" for i in range(1, 6)]

@pytest.fixture
def slurm_env(minicluster) -> dict[str, str]:
    """Environment for Slurm clients to reach the project's mini cluster."""
    return dict(minicluster.env())


def sh(env, *argv, check=True, timeout=30) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in argv], env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert p.returncode == 0, f"{shlex.join(map(str, argv))}: rc={p.returncode} {p.stderr.strip()}"
    return p


def wait_for(pred, timeout: float, interval: float = 0.05, what: str = "condition"):
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


@pytest.fixture
def be(slurm_env):
    return CliBackend(env=slurm_env)


@pytest.fixture
def jobs(slurm_env):
    """submit(*sbatch args) -> job id; every job is scancelled at the end of the test."""
    ids: list[str] = []

    def submit(*args: str) -> str:
        p = sh(slurm_env, "sbatch", "--parsable", "-o", "/dev/null", *args)
        ids.append(p.stdout.strip().split(";")[0])
        return ids[-1]
    yield submit
    if ids:
        sh(slurm_env, "scancel", *ids, check=False)


def wait_running(be: CliBackend, job_id: str, timeout: float = 20):
    return wait_for(lambda: (j := be.job(job_id)) and j.state == "RUNNING" and j, timeout,
                    0.1, f"job {job_id} RUNNING (are node1..node5 free?)")


def resume_if_drained(be: CliBackend, nodes):
    st = be.nodes(nodes)
    bad = [n for n, s in st.items() if s.drain_requested or "FAIL" in s.flags]
    if bad:
        be.resume(bad)


# ============================================================================ tests

HOSTLISTS = ["node3,node1,node2,node1", "gpu01,node2,node1,gpu02,login", "node9,node10,node11",
             "node09,node10,node8", "n1,n01,n001", "a1b3,a1b4,a2b3", "x-1,x-2,x3",
             "node007,node008,node010", "rack1-node1,rack1-node2,rack2-node1", "node1,login,node2"]
EXPRS = ["node[1-3,5],gpu[01-02],login", "a[1-2]b[3-4]", "node[8-011]", "node[08-11]", "a[1,3-4]"]


def test_hostlist_agrees_with_scontrol(slurm_env):
    for names in HOSTLISTS:
        assert hostlist.compress(names.split(",")) == \
            sh(slurm_env, "scontrol", "show", "hostlist", names).stdout.strip(), names
    for expr in EXPRS:
        assert hostlist.expand(expr) == sh(slurm_env, "scontrol", "show", "hostnames", expr).stdout.split(), expr
    for bad in ["n[1-3]x", "node[3-1]", "node[a-b]"]:
        p = sh(slurm_env, "scontrol", "show", "hostnames", bad, check=False)
        assert "Invalid hostlist" in p.stdout + p.stderr, (bad, p)
        with pytest.raises(ValueError):
            hostlist.expand(bad)


def test_backend_for_auto_is_cli_here(slurm_env):
    assert slurm_version(slurm_env) is not None
    assert backend_for("auto", env=slurm_env).name == "cli"     # no matching pyslurm for 22.05


def test_batched_node_query_sees_drain_within_1s(slurm_env, be, jobs):
    calls = []

    def counting_run(argv, **kw):
        calls.append(list(argv))
        return subprocess.run(argv, **kw)
    cbe = CliBackend(env=slurm_env, run=counting_run)
    job = jobs("-N1", "-w", "node1", "-t", "2", "-J", "tm_test_drain", "--wrap", "sleep 60")
    wait_running(be, job)
    assert not cbe.nodes(ALL)["node1"].drain_requested
    n_before = len(calls)
    try:
        cbe.drain(["node1"], "tm-slurm test drain")
        t0 = time.monotonic()
        st = wait_for(lambda: (s := cbe.nodes(ALL)["node1"]).drain_requested and s, 5, 0.02, "DRAIN")
        seen_after = time.monotonic() - t0
        polls = len(calls) - n_before - 1
        assert seen_after < 1.0, f"drain seen after {seen_after:.2f} s"
        assert all(c[:2] == ["sinfo", "--json"] for c in calls[n_before + 1:])   # one query per poll
        assert (st.state, st.flags, st.reason, st.reason_user) == \
            ("MIXED", {"DRAIN"}, "tm-slurm test drain", getpass.getuser())
        assert st.draining and abs(st.reason_time - time.time()) < 10
        assert CliBackend(env=slurm_env, node_query="scontrol").nodes(["node1"])["node1"].flags == {"DRAIN"}
        evs = classify(cbe.nodes(ALL), [], ["node1"], time.time(), 600)
        assert [(e.node, e.kind, e.cause) for e in evs] == [("node1", "planned", "drain")]
        print(f"\ndrain visible after {seen_after * 1000:.0f} ms ({polls + 1} batched queries)")
    finally:
        be.resume(["node1"])
    # Slurm 22.05 flags a resumed node NOT_RESPONDING for a moment (even with a job on it):
    # the debouncer keeps that from looking like a node failure
    deb, seen_nr, end = EventDebouncer(2.0), False, time.monotonic() + 1.5
    while time.monotonic() < end:
        evs = classify(be.nodes(["node1"]), [], ["node1"], time.time(), 600)
        seen_nr |= any(e.cause == "not_responding" for e in evs)
        assert deb.filter(evs, time.monotonic()) == []
        time.sleep(0.05)
    final = wait_for(lambda: (s := be.nodes(["node1"])["node1"]).flags == frozenset() and s, 10, 0.1,
                     "node1 to be plain MIXED after RESUME")
    assert final.state == "MIXED" and final.reason == ""
    print(f"NOT_RESPONDING blip after RESUME observed: {seen_nr}")


def test_reboot_asap_shows_reboot_requested(slurm_env, be, jobs):
    job = jobs("-N1", "-w", "node2", "-t", "2", "-J", "tm_test_reboot", "--wrap", "sleep 60")
    wait_running(be, job)
    try:
        sh(slurm_env, "scontrol", "reboot", "ASAP", "nextstate=resume", "reason=tm-slurm test reboot", "node2")
        st = wait_for(lambda: "REBOOT_REQUESTED" in (s := be.nodes(["node2"])["node2"]).flags and s, 5,
                      0.05, "REBOOT_REQUESTED")
        assert (st.state, st.flags, st.reason) == ("MIXED", {"DRAIN", "REBOOT_REQUESTED"}, "tm-slurm test reboot")
        evs = classify(be.nodes(ALL), be.reservations(), be.job(job).nodes, time.time(), 600)
        assert [(e.node, e.kind, e.cause) for e in evs] == [("node2", "planned", "reboot")]
        assert be.job(job).state == "RUNNING"                       # the job is not affected
    finally:
        sh(slurm_env, "scontrol", "cancel_reboot", "node2", check=False)   # before the job ends!
    st = wait_for(lambda: "REBOOT_REQUESTED" not in (s := be.nodes(["node2"])["node2"]).flags and s, 5)
    # cancel_reboot also clears the DRAIN that `reboot ASAP` set (observed on 22.05.8)
    assert st.flags == frozenset() and st.state == "MIXED", st
    resume_if_drained(be, ["node2"])


def test_maint_reservation_is_planned_within_horizon(slurm_env, be, jobs):
    job = jobs("-N1", "-w", "node5", "-t", "3", "-J", "tm_test_maint", "--wrap", "sleep 60")
    info = wait_running(be, job)
    name = f"tm_test_maint_{os.getpid()}"
    t_create = time.time()
    sh(slurm_env, "scontrol", "create", "reservation", f"reservationname={name}", "nodes=node5",
       "flags=maint,ignore_jobs", "starttime=now+5minutes", "duration=10", "users=root")
    try:
        (r,) = [r for r in be.reservations() if r.name == name]
        assert r.nodes == ("node5",) and {"MAINT", "IGNORE_JOBS"} <= r.flags and r.state == "INACTIVE"
        assert abs(r.start - (t_create + 300)) < 5 and r.end - r.start == 600
        states = be.nodes(ALL)
        assert states["node5"].flags == frozenset()     # nothing shows on the node before the start
        now = time.time()
        evs = classify(states, be.reservations(), info.nodes, now, 600)
        assert [(e.node, e.kind, e.cause) for e in evs] == [("node5", "planned", "maintenance")]
        assert evs[0].since == r.start and name in evs[0].reason
        assert classify(states, be.reservations(), info.nodes, now, 60) == []   # beyond the horizon
        assert classify(states, be.reservations(), ["node4"], now, 600) == []   # not a job node
    finally:
        sh(slurm_env, "scontrol", "delete", f"reservation={name}", check=False)
    assert name not in [r.name for r in be.reservations()]


def test_job_parses_running_job(slurm_env, be, jobs, tmp_path):
    job = jobs("-N2", "-w", "node[3-4]", "-t", "2", "--requeue", "-D", str(tmp_path),
               "-J", "tm_test_job", "--wrap", "sleep 60")
    info = wait_running(be, job)
    assert (info.job_id, info.state, info.nodes, info.user, info.workdir, info.batch_host) == \
        (job, "RUNNING", ("node3", "node4"), getpass.getuser(), str(tmp_path), "node3")
    assert (info.time_limit_s, info.restarts, info.reason, info.requeue) == (120.0, 0, "", True)
    assert abs(info.start_time - time.time()) < 30 and info.end_time - info.start_time == 120
    assert be.job_workdir(job) == str(tmp_path)
    assert be.job("99999999") is None and be.job_workdir("99999999") is None


SHRINK_SCRIPT = """#!/bin/bash
# one long step per node, each reporting its srun's exit status
for n in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  ( srun -N1 -n1 -w "$n" --overlap bash -c "echo started > {d}/step.$n; sleep 60" ; echo $? > {d}/rc.$n ) &
done
wait
"""


def test_release_nodes_shrinks_running_job(slurm_env, be, jobs, tmp_path):
    script = tmp_path / "shrink.sh"
    script.write_text(SHRINK_SCRIPT.format(d=tmp_path))
    job = jobs("-N3", "-w", "node[3-5]", "--no-kill", "-t", "2", "-J", "tm_test_shrink", str(script))
    wait_running(be, job)
    wait_for(lambda: all((tmp_path / f"step.{n}").exists() for n in ("node3", "node4", "node5")), 15,
             0.1, "a step running on each node")
    try:
        be.drain(["node5"], "tm-slurm test release")             # a drain waiting for our job
        assert be.nodes(["node5"])["node5"].draining
        with pytest.raises(SlurmError, match="batch host node3 must be kept"):
            be.release_nodes(job, ["node4", "node5"])
        with pytest.raises(SlurmError, match="node1 not in the job's allocation"):
            be.release_nodes(job, ["node3", "node1"])
        # the shrink through the launcher, which then knows (scontrol show config) that this
        # Slurm (22.05 without slurmdbd) resizes a job once
        launcher = SlurmLauncher(tmp_path, Config(), job, b"k" * 32, backend=be)
        launcher.batch_host = "node3"
        t0 = time.monotonic()
        assert launcher.release("node5") == "released: job now on 2 nodes"
        took = time.monotonic() - t0
        info = be.job(job)
        assert (info.state, info.nodes) == ("RUNNING", ("node3", "node4"))
        # the released node's pending drain completes at once: MIXED+DRAIN -> IDLE+DRAIN
        st = wait_for(lambda: (s := be.nodes(["node5"])["node5"]).drained and s, 5, 0.05, "node5 drained")
        drained_after = time.monotonic() - t0
        assert st.state == "IDLE" and st.flags == {"DRAIN"}
        # its step was SIGKILLed (srun exit 137); the steps on the kept nodes still run
        rc5 = wait_for(lambda: (tmp_path / "rc.node5").exists() and (tmp_path / "rc.node5").read_text().strip(),
                       30, 0.1, "the released node's srun to exit")   # CI has seen > 10 s
        assert rc5 == "137"
        steps = sh(slurm_env, "squeue", "-h", "-s", "-j", job, "-o", "%i %N").stdout.split("\n")
        step_nodes = sorted(line.split()[1] for line in steps if line.strip() and ".batch" not in line)
        assert step_nodes == ["node3", "node4"], steps
        assert not (tmp_path / "rc.node3").exists() and not (tmp_path / "rc.node4").exists()
        be.release_nodes(job, ["node4", "node3"])                 # already that: no-op
        # the launcher does not ask again ...
        t1 = time.monotonic()
        assert launcher.release("node4").startswith(f"not released: Slurm will not shrink job {job} again")
        assert time.monotonic() - t1 < 1 and be.job(job).nodes == ("node3", "node4")
        # ... because slurmctld would hold the update 5 s and refuse it; with this cluster's
        # MessageTimeout (5 s) the client may give up first ("Unexpected message received")
        t1 = time.monotonic()
        with pytest.raises(SlurmError, match=f"{DB_INDEX_HOLD}|Unexpected message received"):
            be.release_nodes(job, ["node3"])
        refused_after = time.monotonic() - t1
        assert be.job(job).nodes == ("node3", "node4")
        print(f"\nrelease_nodes took {took * 1000:.0f} ms; node5 drained after {drained_after:.2f} s; "
              f"its srun exited {rc5}; a second shrink refused after {refused_after:.1f} s")
    finally:
        resume_if_drained(be, ["node5"])


def test_requeue_and_notify(slurm_env, be, jobs):
    job = jobs("-N1", "-w", "node2", "-t", "2", "--requeue", "-J", "tm_test_requeue", "--wrap", "sleep 60")
    norq = jobs("-N1", "-w", "node1", "-t", "2", "--no-requeue", "-J", "tm_test_norq", "--wrap", "sleep 60")
    wait_running(be, job)
    wait_running(be, norq)
    be.notify(job, "tm-slurm test notify")
    be.requeue(job)
    info = wait_for(lambda: (j := be.job(job)).restarts == 1 and j, 10, 0.1, "Restarts=1")
    assert info.state in ("COMPLETING", "PENDING", "REQUEUED", "RUNNING"), info.state
    with pytest.raises(SlurmError, match="--requeue"):
        be.requeue(norq)
    with pytest.raises(SlurmError, match="Invalid job id"):
        be.requeue("99999999")
