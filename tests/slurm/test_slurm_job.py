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

from ..jobs import ROBUST, TINY

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

    def wait_warm(self, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = self.status()
            nodes = st.get("nodes", {})
            if st.get("state") == "RUNNING" and nodes and all(
                    n["ready"] for n in nodes.values() if n["role"] in ("ACTIVE", "STANDBY")):
                return
            time.sleep(0.2)
        raise AssertionError(f"job {self.id} not running with warm standbys after {timeout}s")

    def slurm_state(self) -> str:
        out = self.mc.scontrol("show", "job", "-o", self.id).stdout
        return next(f.split("=", 1)[1] for f in out.split() if f.startswith("JobState="))

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
def submit(healthy_cluster, tmp_path):
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
    # directory after the rmtree
    healthy_cluster.cancel_jobs()
    for job in made:
        shutil.rmtree(job.dir, ignore_errors=True)


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
    job = submit()
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
    minicluster.wait_state("node4", lambda s: "DOWN" in s, 60)
    down = time.time() - t
    assert detect < down - 5, f"detected after {detect:.1f}s, Slurm DOWN after {down:.1f}s"
    rec = job.wait_event("recovery_complete", 60)
    _finished(job, ref_digests)
    print(f"\n[crash] detect {detect:.2f}s ({fail['how']}), Slurm DOWN after {down:.1f}s, "
          f"recovered: stall {rec['stall_s']}s, lost {rec['lost_steps']}")


def test_batch_host_loss_checkpoints_and_requeues(submit, minicluster, ref_digests):
    job = submit("--requeue")
    job.wait_warm()
    t = minicluster.fail("node1", "crash")           # the controller's node
    end = time.monotonic() + 90
    while time.monotonic() < end:
        info = minicluster.scontrol("show", "job", "-o", job.id).stdout
        if "Restarts=1" in info:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"job {job.id} was not requeued after the batch host died")
    headless = time.time() - t
    lost = jobdir.control_dir(job.dir) / "lost" / "run0"       # the first run's survivors
    assert sorted(p.name for p in lost.glob("agent-*.done")) == [f"agent-node{i}.done" for i in (2, 3, 4, 5)]
    minicluster.restore("node1", wait=True)
    _finished(job, ref_digests)
    starts = [e for e in job.events() if e["kind"] == "job_start"]
    assert len(starts) == 2 and starts[1]["resume_from"], "the requeued run resumed from the checkpoint"
    print(f"\n[batch host] requeued {headless:.1f}s after the batch host died; resumed from "
          f"{Path(starts[1]['resume_from']).name}")


def test_usr1_before_time_limit_checkpoints_and_requeues(submit, minicluster, ref_digests):
    job = submit("--requeue")
    job.wait_warm()
    t = time.time()
    # what --signal=B:USR1@T does at T before the limit, now instead of minutes from now
    minicluster.run(["scancel", "--batch", "--signal=USR1", job.id])
    job.wait_event("checkpoint_requested", 30)
    end = time.monotonic() + 60
    while "Restarts=1" not in minicluster.scontrol("show", "job", "-o", job.id).stdout:
        assert time.monotonic() < end, "not requeued"
        time.sleep(0.3)
    _finished(job, ref_digests)
    ends = [e for e in job.events() if e["kind"] == "job_end"]
    assert ends[0]["state"] == "REQUEUED"
    print(f"\n[USR1] requeued {time.time() - t:.1f}s after the signal (incl. restart)")
