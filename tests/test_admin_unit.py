"""Unit tests of the admin tools (no cluster): squeue parsing, which jobs a node event touches,
the requests notify-nodes drops, and evacuate's bookkeeping and report on a fake Slurm."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tm_slurm import admin, jobdir
from tm_slurm.admin import evacuate as ev
from tm_slurm.admin import jobs as admin_jobs
from tm_slurm.admin import notify as nt
from tm_slurm.admin.jobs import RunningJob
from tm_slurm.slurm import SlurmError
from tm_slurm.slurm.backend import NodeState

# ---------------------------------------------------------------- helpers

def tm_job(tmp_path: Path, job_id: str, nodes, roles: dict[str, str] | None = None,
           user: str = "alice") -> RunningJob:
    """A running tm_slurm job: job directory with its request inbox and a status.json."""
    d = tmp_path / "tm_slurm_jobs" / job_id
    jobdir.requests_dir(d)
    if roles is not None:
        jobdir.status_file(d).write_text(json.dumps(
            {"state": "RUNNING", "nodes": {n: {"role": r, "ready": True, "ranks": []} for n, r in roles.items()}}))
    jobdir.events_file(d).touch()
    return RunningJob(job_id, user, tuple(nodes), str(tmp_path))


def plain_job(tmp_path: Path, job_id: str, nodes, user: str = "bob") -> RunningJob:
    return RunningJob(job_id, user, tuple(nodes), str(tmp_path / "elsewhere"))


def requests_of(job: RunningJob) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(jobdir.requests_dir(job.job_dir).glob("*.json"))]


def emit(job: RunningJob, kind: str, node: str, ts: float, **kw) -> None:
    with open(jobdir.events_file(job.job_dir), "a") as f:
        f.write(json.dumps({"ts": ts, "job": job.job_id, "gen": 0, "node": node, "rank": None,
                            "step": None, "kind": kind, **kw}) + "\n")


class FakeSlurm:
    """The SlurmBackend calls evacuate makes; node states are set by the test."""

    def __init__(self, states: dict[str, str]):
        self.states = dict(states)
        self.drained: list[tuple[list[str], str]] = []

    def nodes(self, names):
        out = {}
        for n in names:
            if n in self.states:
                base, *flags = self.states[n].split("+")
                out[n] = NodeState(n, base, frozenset(flags))
        return out

    def drain(self, nodes, reason):
        self.drained.append((list(nodes), reason))
        for n in nodes:
            if "DRAIN" not in self.states[n]:
                self.states[n] += "+DRAIN"


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        self.t += dt


# ---------------------------------------------------------------- squeue and discovery

def test_parse_squeue_keeps_separators_in_the_workdir_and_expands_nodes():
    out = ("70012|alice|node[1-3,5]|/home/alice/run|with bar\n"
           "70013_4|bob|node4|/scratch/bob\n"
           "\n"
           "garbage line\n")
    jobs = admin_jobs.parse_squeue(out)
    assert jobs[0] == RunningJob("70012", "alice", ("node1", "node2", "node3", "node5"),
                                 "/home/alice/run|with bar")
    assert jobs[1].job_id == "70013_4" and jobs[1].nodes == ("node4",)
    assert len(jobs) == 2


def test_running_jobs_asks_squeue_for_running_jobs_on_the_nodes():
    seen = {}

    def run(argv, **kw):
        seen["argv"] = argv
        return subprocess.CompletedProcess(argv, 0, "1|u|n1|/w\n", "")

    assert admin_jobs.running_jobs(["node3", "node2"], run=run)[0].job_id == "1"
    assert "--states=RUNNING" in seen["argv"] and "--nodelist=node[2-3]" in seen["argv"]
    assert f"--format={admin_jobs.SQUEUE_FORMAT}" in seen["argv"]
    admin_jobs.running_jobs(None, run=run)
    assert not any(a.startswith("--nodelist") for a in seen["argv"])


def test_running_jobs_errors_say_what_failed():
    def missing(argv, **kw):
        raise FileNotFoundError(argv[0])

    with pytest.raises(SlurmError, match="Slurm CLI not found"):
        admin_jobs.running_jobs(["n1"], run=missing)

    def fails(argv, **kw):
        return subprocess.CompletedProcess(argv, 1, "", "squeue: error: Invalid node name specified")

    with pytest.raises(SlurmError, match="Invalid node name"):
        admin_jobs.running_jobs(["n1"], run=fails)


def test_a_job_dir_marks_a_tm_slurm_job(tmp_path):
    assert tm_job(tmp_path, "7", ["node1"]).job_dir == tmp_path / "tm_slurm_jobs" / "7"
    assert plain_job(tmp_path, "8", ["node1"]).job_dir is None
    assert RunningJob("9", "u", ("n",), "").job_dir is None


def test_affected_uses_the_allocation_and_the_jobs_own_view(tmp_path):
    # Slurm already took node3 out of job 7 (DOWN); the job still counts it, or has marked it FAILED
    live = tm_job(tmp_path, "7", ["node1", "node2"], {"node1": "ACTIVE", "node2": "ACTIVE", "node3": "LEAVING"})
    failed = tm_job(tmp_path, "8", ["node4"], {"node4": "ACTIVE", "node3": "FAILED"})
    other = plain_job(tmp_path, "9", ["node3", "node5"])
    far = tm_job(tmp_path, "10", ["node6"], {"node6": "ACTIVE"})
    got = {j.job_id: held for j, held in admin_jobs.affected([live, failed, other, far], ["node3"])}
    assert got == {"7": ["node3"], "9": ["node3"]}
    got = {j.job_id: held for j, held in admin_jobs.affected([live, failed, other, far], ["node3"],
                                                              admin_jobs.LIVE_ROLES | {"FAILED"})}
    assert got == {"7": ["node3"], "8": ["node3"], "9": ["node3"]}


# ---------------------------------------------------------------- notify-nodes

def test_notify_fail_asks_tm_slurm_jobs_to_drain(tmp_path):
    asked = []
    a = tm_job(tmp_path, "7", ["node1", "node2", "node3"], {"node1": "ACTIVE", "node2": "ACTIVE"})
    b = plain_job(tmp_path, "9", ["node2"])

    def jobs(nodes):
        asked.append(nodes)
        return [a, b]

    lines, rc = nt.notify("fail", ["node2", "node3"], "slurm node fail (strigger)", "strigger", jobs)
    assert rc == 0 and asked == [["node2", "node3"]]
    reqs = requests_of(a)
    assert [(r["verb"], r["node"], r["source"]) for r in reqs] == [("drain", "node2", "strigger"),
                                                                    ("drain", "node3", "strigger")]
    assert reqs[0]["reason"] == "slurm node fail (strigger)"
    assert any("job 7" in ln and "asked to drain" in ln for ln in lines)
    assert any("job 9" in ln and "not a tm_slurm job" in ln for ln in lines)


def test_notify_down_looks_at_every_job_and_asks_for_a_fail(tmp_path):
    asked = []
    a = tm_job(tmp_path, "7", ["node1"], {"node1": "ACTIVE", "node4": "FAILED"})

    def jobs(nodes):
        asked.append(nodes)
        return [a]

    _, rc = nt.notify("down", ["node4"], "r", "strigger", jobs)
    assert rc == 0
    assert asked == [None], "Slurm drops a DOWN node from the job: every running job is checked"
    assert [(r["verb"], r["node"]) for r in requests_of(a)] == [("fail", "node4")]


def test_notify_with_nothing_on_the_nodes(tmp_path):
    lines, rc = nt.notify("drained", ["node9"], "r", "strigger", lambda nodes: [])
    assert rc == 0 and lines == ["no running job on node9"]


def test_notify_cli(tmp_path, monkeypatch, capsys):
    a = tm_job(tmp_path, "7", ["node2"], {"node2": "ACTIVE"})
    monkeypatch.setattr(nt, "running_jobs", lambda nodes: [a])
    ap = argparse.ArgumentParser()
    admin.add_parsers(ap.add_subparsers())
    args = ap.parse_args(["notify-nodes", "--event", "fail", "--source", "strigger", "node[2-3]"])
    assert args.fn(args) == 0
    assert "fail node[2-3]: job 7 (alice) on node2: asked to drain" in capsys.readouterr().out
    assert requests_of(a)[0]["reason"] == "slurm node fail (strigger)"


# ---------------------------------------------------------------- evacuate

def evacuation(slurm, jobs, clock, nodes=("node3",), deadline=60.0):
    return ev.Evacuation(list(nodes), "maint", deadline, backend=slurm, list_jobs=lambda n: list(jobs),
                         clock=clock, sleep=clock.sleep)


def test_evacuate_drains_asks_and_sees_the_job_move_off(tmp_path):
    clock = Clock()
    job = tm_job(tmp_path, "7", ["node1", "node2", "node3", "node4", "node5"])
    emit(job, "node_released", "node3", clock.t - 100, result="released: job now on 4 nodes")  # an older run's
    slurm = FakeSlurm({n: "MIXED" for n in job.nodes})
    e = evacuation(slurm, [job], clock)
    e.start()
    assert slurm.drained == [(["node3"], "maint")]
    [req] = requests_of(job)
    assert (req["verb"], req["node"], req["reason"], req["source"]) == ("drain", "node3", "evacuate: maint", "evacuate")
    assert not e.poll()
    assert e.report()["jobs"][0]["nodes"]["node3"]["status"] == ev.PENDING
    emit(job, "swap_planned", "node3", clock.t + 0.1, joiner="node5")
    emit(job, "node_released", "node3", clock.t + 0.4, result="released: job now on 4 nodes")
    emit(job, "swap_complete", "node3", clock.t + 1.0, stall_s=0.061)
    slurm.states["node3"] = "IDLE+DRAIN"
    assert e.poll()
    rep = e.report()
    assert rep["ok"] and rep["note"] is None
    n3 = rep["jobs"][0]["nodes"]["node3"]
    assert n3["status"] == ev.MOVED_OFF and n3["after_s"] == 0.4 and n3["stall_s"] == 0.061
    assert rep["nodes"]["node3"] == {"state": "IDLE+DRAIN", "drained": True}
    text = ev.render(rep)
    assert "moved off node3 after 0.40 s (released: job now on 4 nodes), training stalled 0.061 s" in text
    assert "every tm_slurm job moved off and every node is DRAINED" in text


def test_evacuate_times_out_and_says_why_per_job(tmp_path):
    clock = Clock()
    stuck = tm_job(tmp_path, "7", ["node1", "node3"])
    silent = tm_job(tmp_path, "8", ["node4"])
    other = plain_job(tmp_path, "9", ["node3"])
    slurm = FakeSlurm({"node1": "MIXED", "node3": "MIXED", "node4": "ALLOCATED"})
    e = evacuation(slurm, [stuck, silent, other], clock, nodes=("node3", "node4"), deadline=10)
    emit(stuck, "drain_deferred", "node3", clock.t + 0.2, why="no READY standby")
    assert not e.run()
    assert 10 <= clock.t - 1000 < 11
    rep = e.report()
    assert not rep["ok"]
    by_job = {j["job_id"]: j for j in rep["jobs"]}
    assert by_job["7"]["nodes"]["node3"]["status"] == ev.NO_STANDBY
    assert by_job["8"]["nodes"]["node4"]["status"] == ev.PENDING
    assert by_job["9"]["tm_slurm"] is False and by_job["9"]["nodes"]["node3"]["status"] == ev.NOT_TM
    text = ev.render(rep)
    assert "job 9 (bob): still running on node3: not a tm_slurm job: the drain waits for it to end" in text
    assert "job 7 (alice, tm_slurm): still running on node3: no standby (no READY standby)" in text
    assert "job 8 (alice, tm_slurm): still running on node4: asked to move off (timed out)" in text
    assert "the drain stays in place" in text and "DRAINED when the jobs left on it end" in text


def test_evacuate_counts_a_job_that_left_or_ended(tmp_path):
    clock = Clock()
    left = tm_job(tmp_path, "7", ["node1", "node3"])
    ended = tm_job(tmp_path, "8", ["node3"])
    running = [left, ended]
    slurm = FakeSlurm({"node1": "MIXED", "node3": "MIXED"})
    e = ev.Evacuation(["node3"], "maint", 5, backend=slurm, list_jobs=lambda n: list(running),
                      clock=clock, sleep=clock.sleep)
    e.start()
    running[:] = [RunningJob("7", "alice", ("node1",), left.workdir)]   # shrunk; 8 is gone
    slurm.states["node3"] = "IDLE+DRAIN"
    assert e.poll()
    st = {j["job_id"]: j["nodes"]["node3"]["status"] for j in e.report()["jobs"]}
    assert st == {"7": ev.MOVED_OFF, "8": ev.JOB_ENDED}


def test_evacuate_the_batch_host_cannot_leave(tmp_path):
    clock = Clock()
    job = tm_job(tmp_path, "7", ["node1", "node2"])
    slurm = FakeSlurm({"node1": "MIXED", "node2": "MIXED"})
    e = evacuation(slurm, [job], clock, nodes=("node1",), deadline=1)
    emit(job, "node_released", "node1", clock.t + 0.3,
         result="kept: the batch host (the controller runs there) cannot leave the job")
    assert not e.run()
    n1 = e.report()["jobs"][0]["nodes"]["node1"]
    assert n1["status"] == ev.BATCH_HOST and "stays in the job until it ends" in n1["detail"]


def test_evacuate_refuses_unknown_nodes_before_draining_anything(tmp_path):
    slurm = FakeSlurm({"node1": "IDLE"})
    e = evacuation(slurm, [], Clock(), nodes=("node1", "node9"))
    with pytest.raises(SlurmError, match=r"unknown node\(s\) node9"):
        e.start()
    assert slurm.drained == []


def test_evacuate_cli_exit_codes_and_json(tmp_path, monkeypatch, capsys):
    slurm = FakeSlurm({"node3": "IDLE", "node4": "MIXED"})
    monkeypatch.setattr(ev, "backend_for", lambda kind: slurm)
    monkeypatch.setattr(ev, "running_jobs", lambda nodes: [])
    ap = argparse.ArgumentParser()
    admin.add_parsers(ap.add_subparsers())

    def run(*argv):
        args = ap.parse_args(["evacuate", *argv])
        return args.fn(args), capsys.readouterr()

    rc, out = run("node3", "--reason", "maint", "--deadline", "5", "--json")
    assert rc == 0 and json.loads(out.out)["nodes"]["node3"]["drained"] is True
    rc, out = run("node4", "--reason", "maint", "--deadline", "0")
    assert rc == 1 and "node4: MIXED+DRAIN (not drained yet)" in out.out
    rc, out = run("node7", "--reason", "maint", "--deadline", "0")
    assert rc == 2 and "unknown node(s) node7" in out.err


# ---------------------------------------------------------------- a user's hostile job directory

def test_root_reads_a_users_job_files_without_following_links_or_blocking(tmp_path):
    job = tm_job(tmp_path, "7", ["n1"], roles={"n1": "ACTIVE"})
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"nodes": {"n9": {"role": "ACTIVE"}}}))
    status = jobdir.status_file(job.job_dir)
    status.unlink()
    status.symlink_to(secret)                                  # a link to something else
    assert admin_jobs.job_nodes(job.job_dir) == set()
    status.unlink()
    os.mkfifo(status)                                          # a plain read would wait forever
    assert admin_jobs.job_nodes(job.job_dir) == set()
    status.unlink()
    status.write_text('{"nodes": [1]}')                        # JSON, not what the runtime writes
    assert admin_jobs.job_nodes(job.job_dir) == set()
    ev_file = jobdir.events_file(job.job_dir)
    ev_file.write_text('[1]\n"x"\n{"kind": "swap_done", "node": "n1"}\n' + "[" * 5000 + "\n")
    evs, off = ev.read_new_events(job.job_dir, 0)
    assert evs == [{"kind": "swap_done", "node": "n1"}] and off == ev_file.stat().st_size


def test_a_job_whose_inbox_is_a_link_is_not_written_into(tmp_path):
    job = tm_job(tmp_path, "8", ["n1"])
    inbox = jobdir.requests_dir(job.job_dir)
    elsewhere = tmp_path / "etc"
    elsewhere.mkdir()
    inbox.rmdir()
    inbox.symlink_to(elsewhere)
    assert job.job_dir is None                                 # not taken for a tm_slurm job
    with pytest.raises(OSError):
        admin_jobs.userfiles.write_request(tmp_path / "tm_slurm_jobs" / "8", "x.json", b"{}")
    assert list(elsewhere.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="root drops to the job directory's owner")
def test_root_writes_a_request_as_the_job_directorys_owner():
    base = Path(tempfile.mkdtemp(prefix="tm-admin-"))        # pytest's tmp is root's alone
    try:
        os.chmod(base, 0o755)
        job = tm_job(base, "9", ["n1"])
        os.chmod(base / "tm_slurm_jobs", 0o755)
        for p in (job.job_dir, job.job_dir / "control", jobdir.requests_dir(job.job_dir)):
            os.chown(p, 65534, 65534)
        (name,) = admin_jobs.ask(job, "drain", ["n1"], "maintenance", "evacuate")
        f = jobdir.requests_dir(job.job_dir) / name
        assert f.stat().st_uid == 65534 and json.loads(f.read_text())["node"] == "n1"
    finally:
        shutil.rmtree(base)
