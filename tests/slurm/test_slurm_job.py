"""The sbatch wrapper on the real mini cluster (issue: real Slurm). `sbatch sbatch/train.sbatch`
as users submit it (only the step count, the model size and two timeouts come in through the
script's environment knobs); admins' actions (drain, reboot, maintenance reservation) and real
node failures on a running job; the outcome is compared with a local run of the same steps.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tm_slurm import events as evlog
from tm_slurm import jobdir
from tm_slurm.slurm import hostlist

from ..jobs import ROBUST, TINY, kill_leftovers, leftovers

REPO = Path(__file__).resolve().parents[2]
STEPS = 150
CONTROLLER_TIMEOUT = 6.0


@pytest.fixture
def ref_digests(reference):
    return reference(STEPS)


class Job:
    def __init__(self, mc, job_id: str):
        self.mc, self.id = mc, job_id
        self.dir = REPO / "tm_slurm_jobs" / job_id

    def events(self) -> list[dict]:
        return list(evlog.read(jobdir.events_file(self.dir)))

    def seen(self, kind: str, **match) -> dict | None:
        return next((e for e in self.events() if e["kind"] == kind and
                     all(e.get(k) == v for k, v in match.items())), None)

    def wait_event(self, kind: str, timeout: float, **match) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            e = self.seen(kind, **match)
            if e:
                return e
            time.sleep(0.1)
        raise AssertionError(f"job {self.id}: no {kind} {match} within {timeout}s; see {self.dir}")

    def status(self) -> dict:
        try:
            return json.loads(jobdir.status_file(self.dir).read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def wait_warm(self, timeout: float = 120, run: int = 0) -> None:
        """`run`: of a requeued job, the how-manieth run (an earlier one's status.json stays)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            starts = [e["ts"] for e in self.events() if e["kind"] == "job_start"]
            st = self.status() if len(starts) > run else {}
            nodes = st.get("nodes", {})
            if st.get("state") == "RUNNING" and st["updated"] > starts[run] and nodes and all(
                    n["ready"] for n in nodes.values() if n["role"] in ("ACTIVE", "STANDBY")):
                return
            time.sleep(0.2)
        raise AssertionError(f"job {self.id} not running with warm standbys after {timeout}s; "
                             f"{self.slurm_view()}")

    def slurm_view(self) -> str:
        """What Slurm and the survivors of a lost controller say of the job, for a failure's message."""
        f = self.fields()
        lost = jobdir.control_dir(self.dir) / "lost"
        ends = {p.name: p.read_text().strip() for p in lost.glob("run*/end-*.txt")}
        return (f"Slurm: JobState={f.get('JobState')} Reason={f.get('Reason')} Restarts={f.get('Restarts')}; "
                f"the lost controller's survivors: {ends or 'nothing'}")

    def fields(self) -> dict[str, str]:
        """`scontrol show job -o`'s key=value fields (of a value with spaces, its first word)."""
        out = self.mc.scontrol("show", "job", "-o", self.id).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def slurm_state(self) -> str:
        return self.fields().get("JobState", "")

    def wait_slurm(self, states: tuple[str, ...], timeout: float) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            s = self.slurm_state()
            if s in states:
                return s
            time.sleep(0.3)
        raise AssertionError(f"job {self.id} still {self.slurm_state()} after {timeout}s (want {states})")

    def result(self) -> dict:
        return json.loads(jobdir.result_file(self.dir).read_text())


@pytest.fixture
def submit(healthy_cluster, tmp_path, request):
    made = []

    def go(*sbatch_args: str, steps: int = STEPS, extra_sets=(), gpt_extra=()) -> Job:
        sets = [*ROBUST, f"timeouts.controller_timeout_s={CONTROLLER_TIMEOUT}", *extra_sets]
        env = dict(healthy_cluster.env(), GPT_STEPS=str(steps), GPT_ARGS=" ".join([*TINY, *gpt_extra]),
                   TM_SLURM_ARGS=" ".join(f"--set {s}" for s in sets))
        p = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/%j.out", *sbatch_args,
                            "sbatch/train.sbatch"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=30)
        assert p.returncode == 0, p.stderr
        job = Job(healthy_cluster, p.stdout.strip().split(";")[0])
        made.append(job)
        return job

    yield go
    # ended, not only asked to end: a controller still stopping would write into its job
    # directory after the rmtree. Failed nodes are restored first: a cut-off or frozen node's
    # processes end only when its slurmd hears the job is gone
    healthy_cluster.heal()
    left = _job_processes_gone([job.dir for job in made])
    failed = getattr(request.node, "call_failed", False)
    for job in made:
        if not failed:                 # a failed test's job directory stays: its message names it
            shutil.rmtree(job.dir, ignore_errors=True)
        for f in REPO.glob(f"slurm_job_{job.id}_resize.*"):   # Slurm writes these on a shrink
            f.unlink()
    assert not left, f"processes left behind (now killed): {left}"


def _job_processes_gone(dirs: list[Path], timeout: float = 30) -> list[str]:
    """What of these jobs still runs `timeout` s after Slurm ended them (killed then)."""
    end = time.monotonic() + timeout
    while any(leftovers(d) for d in dirs) and time.monotonic() < end:
        time.sleep(0.5)
    return [p for d in dirs for p in kill_leftovers(d)]


def _finished(job: Job, ref: dict) -> None:
    job.wait_slurm(("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), 240)
    assert job.slurm_state() == "COMPLETED", job.dir
    assert job.result()["digests"] == ref


def _planned_and_released(job: Job, node: str, mc) -> dict:
    done = job.wait_event("swap_complete", 120, node=node)
    rel = job.wait_event("node_released", 30, node=node)
    assert rel["result"].startswith("released"), rel
    assert job.slurm_state() == "RUNNING"          # the job goes on without the node
    return done


def test_drain_moves_off_and_the_node_ends_drained(submit, minicluster, ref_digests):
    job = submit()
    job.wait_warm()
    t = time.time()
    minicluster.scontrol("update", "nodename=node3", "state=drain", "reason=tm-test firmware")
    done = _planned_and_released(job, "node3", minicluster)
    minicluster.wait_state("node3", lambda s: s.startswith("IDLE") and "DRAIN" in s, 30)
    ev = job.seen("slurm_event", node="node3")
    assert ev["cause"] == "drain" and ev["planned"]
    _finished(job, ref_digests)
    assert done["event_to_plan_s"] is not None and done["event_to_plan_s"] < 10
    print(f"\n[drain] Slurm drain -> seen {ev['seen_after_s']}s, -> plan {done['event_to_plan_s']}s, "
          f"-> swap done {rel_time(job, 'swap_complete', t):.2f}s; stall {done['stall_s']}s")


def rel_time(job: Job, kind: str, t0: float) -> float:
    return job.seen(kind)["ts"] - t0


def test_reboot_asap_is_a_planned_migration(submit, minicluster, ref_digests):
    job = submit()
    job.wait_warm()
    minicluster.scontrol("reboot", "ASAP", "nextstate=resume", "reason=tm-test kernel", "node2")
    _planned_and_released(job, "node2", minicluster)
    assert job.seen("slurm_event", node="node2")["cause"] == "reboot"
    # released, the node reboots (new boot time) and comes back by itself
    minicluster.wait_state("node2", lambda s: s == "IDLE", 60)
    _finished(job, ref_digests)


def test_maintenance_reservation_is_evacuated_before_it_starts(submit, minicluster, ref_digests):
    job = submit(extra_sets=["slurm.reservation_poll_s=2"])   # seen within the test's wait, not 60 s
    job.wait_warm()
    start = time.time() + 300
    minicluster.scontrol("create", "reservation", "reservationname=tmtest", "nodes=node4",
                         "starttime=now+300", "duration=10", "flags=maint,ignore_jobs", "users=root")
    try:
        _planned_and_released(job, "node4", minicluster)
        assert time.time() < start
        assert job.seen("slurm_event", node="node4")["cause"] == "maintenance"
        _finished(job, ref_digests)
    finally:
        minicluster.scontrol("delete", "reservationname=tmtest", check=False)


def test_node_crash_is_detected_before_slurm_and_recovered(submit, minicluster, ref_digests):
    job = submit()
    job.wait_warm()
    t = minicluster.fail("node4", "crash")
    (job.dir / "control" / "injected-node4.json").write_text(json.dumps({"t": t}))
    fail = job.wait_event("failure_detected", 60, node="node4")
    detect = fail["ts"] - t
    # given back to Slurm at once: a job ending now would not be held COMPLETING by the dead node
    rel = job.wait_event("node_released", 30, node="node4")
    held = hostlist.expand(job.fields()["NodeList"])
    minicluster.wait_state("node4", lambda s: "DOWN" in s, 60)
    down = time.time() - t
    assert detect < down - 5, f"detected after {detect:.1f}s, Slurm DOWN after {down:.1f}s"
    assert rel["result"].startswith("released") and rel["ts"] - t < down and "node4" not in held, (rel, held)
    rec = job.wait_event("recovery_complete", 60)
    _finished(job, ref_digests)
    print(f"\n[crash] detect {detect:.2f}s ({fail['how']}), given back to Slurm {rel['ts'] - t:.2f}s "
          f"({rel['release_s']}s of scontrol), Slurm DOWN after {down:.1f}s, "
          f"recovered: stall {rec['stall_s']}s, lost {rec['lost_steps']}")


def _batch_host(job: Job) -> str:
    return job.fields()["BatchHost"]


def _requeued(job: Job, restarts: int, timeout: float = 90) -> float:
    end = time.monotonic() + timeout
    while job.fields().get("Restarts") != str(restarts):
        assert time.monotonic() < end, f"job {job.id} was not requeued a {restarts}. time; {job.slurm_view()}"
        time.sleep(0.5)
    return time.time()


def _survivors(job: Job, run: int) -> list[str]:
    lost = jobdir.control_dir(job.dir) / "lost" / f"run{run}"
    return sorted(p.name[len("agent-"):-len(".done")] for p in lost.glob("agent-*.done"))


def test_batch_host_lost_twice_checkpoints_and_requeues_each_time(submit, minicluster, ref_digests):
    # slower steps (same numbers): the requeued run must still be training when its host is cut
    job = submit("--requeue", gpt_extra=("--sleep", "0.25"))
    job.wait_warm()
    first, st = _batch_host(job), job.status()
    t = minicluster.fail(first, "crash")                 # the controller's node dies
    headless = _requeued(job, 1) - t
    assert _survivors(job, 0) == sorted(n for n in st["nodes"] if n != first)
    run0 = jobdir.control_dir(job.dir) / "lost" / "run0"
    for _ in range(100):                  # the requeuing agent's note, written once scontrol returned
        ends = [p.read_text() for p in run0.glob("end-*.txt")]
        if ends:
            break
        time.sleep(0.1)
    assert len(ends) == 1 and ends[0].startswith(f"scontrol requeue {job.id} -> 0"), ends
    minicluster.restore(first, wait=True)
    job.wait_warm(run=1)
    # the second run's batch host loses its network but keeps running: its controller hears
    # none of its agents, knows it is the one cut off and stops its status.json, so the agents
    # do not take it for alive (each would fence itself): they checkpoint and requeue again
    second = _batch_host(job)
    t2 = minicluster.fail(second, "netcut")
    cut = job.wait_event("controller_cut_off", 30)
    assert len(cut["lost"]) >= 3, cut
    headless2 = _requeued(job, 2) - t2
    assert len(_survivors(job, 1)) >= 3 and second not in _survivors(job, 1)
    status = jobdir.status_file(job.dir)
    minicluster.restore(second, wait=True)
    held = _released_if_held(job)
    _finished(job, ref_digests)
    starts = [e for e in job.events() if e["kind"] == "job_start"]
    assert len(starts) == 3 and all(s["resume_from"] for s in starts[1:]), "each requeued run resumed"
    ends = [e for e in job.events() if e["kind"] == "job_end"]
    assert [e["state"] for e in ends][-1] == "FINISHED" and status.exists()
    print(f"\n[batch host] crash: requeued after {headless:.1f}s; netcut: requeued after "
          f"{headless2:.1f}s; resumed from {[Path(s['resume_from']).name for s in starts[1:]]}"
          f"{'; held by Slurm (Duplicate jobid), released as the README says' if held else ''}")


def _released_if_held(job: Job, timeout: float = 60) -> bool:
    """The cut-off batch host, back on the network, may still hold the old run when Slurm 22.05
    starts the requeued one there: its slurmd refuses it ("Duplicate jobid"), Slurm drains that
    node and holds the job (launch_failed_requeued_held). What README "Limits" tells the user to
    do: `scontrol release` it (it then runs on the other nodes). Whether it was held."""
    end, held = time.monotonic() + timeout, False
    while time.monotonic() < end:
        f = job.fields()
        if f.get("JobState") != "PENDING":
            break
        if f.get("Reason") == "launch_failed_requeued_held":
            job.mc.scontrol("release", job.id)
            held = True
        time.sleep(0.5)
    return held


def test_netcut_and_hang_of_active_nodes_are_recovered_without_requeue(submit, minicluster, ref_digests):
    # with NCCL's delivery of results and errors (comm.backend nccl-like: gloo underneath, the
    # reference's numbers): a survivor's collective with the cut or hung node ends only when the
    # runtime aborts it (the other Slurm jobs run plain gloo)
    job = submit("--nodes=6", extra_sets=["standby.count=2", "comm.backend=nccl-like"], gpt_extra=("--sleep", "0.25"))
    job.wait_warm()
    assert leftovers(job.dir), "the leak check sees the job's processes (it could not fail otherwise)"
    host = _batch_host(job)
    cut, hung = [n for n in ("node3", "node4", "node2") if n != host][:2]
    minicluster.fail(cut, "netcut")
    job.wait_event("failure_detected", 60, node=cut)
    job.wait_event("recovery_complete", 60)
    # the cut-off agent sees status.json still touched: it ends its own workers, not the job
    # (its output cannot cross the cut; the note it leaves in the shared job directory can)
    note = jobdir.control_dir(job.dir) / "lost" / "run0" / f"agent-{cut}.fenced"
    end = time.monotonic() + 30
    while not note.exists():
        assert time.monotonic() < end, f"{cut}'s agent did not fence itself; see {job.dir}"
        time.sleep(0.5)
    assert not _survivors(job, 0), "nobody took the controller for lost"
    minicluster.fail(hung, "hang")
    job.wait_event("failure_detected", 60, node=hung)
    _finished(job, ref_digests)
    assert job.fields()["Restarts"] == "0"
    recs = [i for i in job.result()["interruptions"] if i["kind"] == "unplanned"]
    assert sorted(r["node"] for r in recs) == sorted([cut, hung]) and all(r["fallback"] is None for r in recs)
    assert not job.seen("controller_cut_off")
    assert job.seen("comms_aborted")


def test_usr1_before_time_limit_checkpoints_and_requeues(submit, minicluster, ref_digests):
    job = submit("--requeue")
    job.wait_warm()
    t = time.time()
    # what --signal=B:USR1@T does at T before the limit, now instead of minutes from now
    minicluster.run(["scancel", "--batch", "--signal=USR1", job.id])
    job.wait_event("checkpoint_requested", 30)
    end = time.monotonic() + 60
    while job.fields().get("Restarts") != "1":
        assert time.monotonic() < end, "not requeued"
        time.sleep(0.3)
    _finished(job, ref_digests)
    ends = [e for e in job.events() if e["kind"] == "job_end"]
    assert ends[0]["state"] == "REQUEUED"
    starts = [e for e in job.events() if e["kind"] == "job_start"]
    assert len(starts) == 2 and starts[1]["resume_from"], "the requeued run resumed from its checkpoint"
    print(f"\n[USR1] requeued {time.time() - t:.1f}s after the signal (incl. restart)")
