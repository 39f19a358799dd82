"""The site-admin tools on the real mini cluster: `tm-slurm evacuate` on a running job, the
strigger hook fired by slurmctld itself, a request from a user who may not make one, and the NHC
offline helper. Jobs are submitted the way users do (`sbatch sbatch/train.sbatch`)."""
from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tm_slurm import jobdir

from .test_slurm_job import STEPS, submit  # noqa: F401  (a fixture)

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "plugins"
SLOW_POLL_S = 60


@pytest.fixture(scope="module")
def tm_cli(tmp_path_factory) -> Path:
    """An executable `tm-slurm` with the admin verbs (trigger programs and the NHC hook need a
    path to run), built from their own add_parser functions only, so the test does not depend on
    how tm_slurm/cli.py wires them in."""
    p = tmp_path_factory.mktemp("bin") / "tm-slurm"
    p.write_text(f"""#!{sys.executable}
import argparse, sys
from tm_slurm import report
from tm_slurm.admin import add_parsers
ap = argparse.ArgumentParser(prog="tm-slurm")
sub = ap.add_subparsers(dest="verb", required=True)
add_parsers(sub)
report.add_parser(sub)
args = ap.parse_args()
sys.exit(args.fn(args) or 0)
""")
    p.chmod(0o755)
    return p


def test_evacuate_moves_the_job_off_and_the_node_ends_drained(submit, minicluster, tm_cli, reference):
    ref = reference(STEPS)
    job = submit()
    job.wait_warm()
    t = time.monotonic()
    p = subprocess.run([str(tm_cli), "evacuate", "node3", "--reason", "maint", "--deadline", "120", "--json"],
                       env=minicluster.env(), capture_output=True, text=True, timeout=150)
    took = time.monotonic() - t
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(p.stdout)
    assert rep["ok"] and rep["nodes"]["node3"] == {"state": "IDLE+DRAIN", "drained": True}
    [j] = rep["jobs"]
    assert j["job_id"] == job.id and j["tm_slurm"] and j["nodes"]["node3"]["status"] == "moved_off"
    state = minicluster.node_state("node3")
    assert state.startswith("IDLE") and "DRAIN" in state, state
    req = job.seen("request", node="node3")
    assert req["source"] == "evacuate" and req["uid"] == 0 and req["reason"] == "evacuate: maint"
    assert job.seen("swap_planned", node="node3")["reason"] == "evacuate: maint"
    assert job.slurm_state() == "RUNNING"
    job.wait_slurm(("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), 240)
    assert job.slurm_state() == "COMPLETED", job.dir
    assert job.result()["digests"] == ref
    done = job.seen("swap_complete", node="node3")
    r = subprocess.run([str(tm_cli), "report", "--job", str(job.dir)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"job {job.id}: FINISHED" in r.stdout and "planned    node3     evacuate: maint" in r.stdout, r.stdout
    assert (job.dir / "timeline.png").stat().st_size > 0
    print(f"\n[evacuate] node3 moved off {j['nodes']['node3']['after_s']} s after the drain, DRAINED "
          f"after {rep['elapsed_s']} s; the command took {took:.2f} s; request seen {req['age_s']} s "
          f"after it was written; stall {done['stall_s']} s")


def test_evacuate_reports_a_plain_job_and_leaves_the_drain_in_place(healthy_cluster, tm_cli, tmp_path):
    p = subprocess.run(["sbatch", "--parsable", "-w", "node4", "-t", "5", f"--output={tmp_path}/%j.out",
                        "--wrap", "sleep 120"], env=healthy_cluster.env(), capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    plain = p.stdout.strip().split(";")[0]
    healthy_cluster.wait_state("node4", lambda s: s.startswith(("MIXED", "ALLOCATED")), 30)
    p = subprocess.run([str(tm_cli), "evacuate", "node4", "--reason", "maint", "--deadline", "2"],
                       env=healthy_cluster.env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"job {plain} (root): still running on node4: not a tm_slurm job: the drain waits for it to end" in p.stdout
    assert "the drain stays in place" in p.stdout
    assert "DRAIN" in healthy_cluster.node_state("node4")
    healthy_cluster.run(["scancel", plain])
    healthy_cluster.wait_state("node4", lambda s: s.startswith("IDLE") and "DRAIN" in s, 30)


def _tm_triggers(mc) -> list[str]:
    out = mc.run(["strigger", "--get", "--noheader"], capture_output=True, text=True).stdout
    return [ln.split()[0] for ln in out.splitlines() if "tm-slurm-trigger" in ln]


def test_down_trigger_reaches_the_job_before_its_own_slurm_poll(submit, minicluster, tm_cli, tmp_path):
    """slurmctld runs the plugin (as root, on the controller host, with the node list) and the
    job logs its request long before its own Slurm poll, slowed to 60 s here, would come round.
    (The planned-migration counterpart, a --fail trigger on State=FAIL, never fires on Slurm
    22.05: slurmctld has no caller of trigger_node_failing. See plugins/README.md.)"""
    job = submit(steps=400, extra_sets=[f"slurm.poll_interval_s={SLOW_POLL_S}"])
    log = tmp_path / "trigger.log"
    env = dict(minicluster.env(), TM_SLURM=str(tm_cli), TM_SLURM_TRIGGER_LOG=str(log))
    p = subprocess.run([str(PLUGINS / "strigger" / "install.sh")], env=env, capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 0, p.stdout + p.stderr
    ids = _tm_triggers(minicluster)
    assert len(ids) == 2, p.stdout
    try:
        job.wait_warm()
        t = time.time()
        minicluster.scontrol("update", "nodename=node2", "state=down", "reason=tm-test down")
        req = job.wait_event("request", 45, node="node2", verb="fail")
        latency = req["ts"] - t
        assert req["source"] == "strigger" and req["uid"] == 0, req
        assert latency < SLOW_POLL_S, latency
        fail = job.seen("failure_detected", node="node2")
        rec = job.wait_event("recovery_complete", 60, node="node2")
        print(f"\n[trigger] Slurm DOWN -> the trigger's request in the job {latency:.1f} s (poll interval "
              f"{SLOW_POLL_S} s); the job itself had detected it after {fail['ts'] - t:.2f} s "
              f"({fail['how']}) and recovered with a stall of {rec['stall_s']} s\n{log.read_text()}")
    finally:
        for i in _tm_triggers(minicluster):
            minicluster.run(["strigger", "--clear", f"--id={i}"], capture_output=True)
    assert not _tm_triggers(minicluster)


def test_a_request_from_another_user_is_refused_and_logged(submit, minicluster):
    job = submit()
    job.wait_warm()
    inbox = jobdir.requests_dir(job.dir)
    nobody = ["runuser", "-u", "nobody", "--"]
    listing = subprocess.run([*nobody, "ls", str(job.dir)], capture_output=True, text=True)
    assert listing.returncode != 0 and "Permission denied" in listing.stderr   # the job dir is 0700
    body = json.dumps({"verb": "drain", "node": "node2", "reason": "not yours", "t": time.time()})
    p = subprocess.run([*nobody, "sh", "-c", 'printf %s "$1" > "$2"', "sh", body, str(inbox / "intruder.json")],
                       capture_output=True, text=True)
    assert p.returncode != 0 and "Permission denied" in p.stderr, p.stderr
    # a file of another owner that does land in the inbox (a site's too-wide ACL, say) is refused too
    tmp = inbox / ".intruder.tmp"
    tmp.write_text(body)
    os.chown(tmp, pwd.getpwnam("nobody").pw_uid, -1)
    os.replace(tmp, inbox / "intruder.json")
    refused = job.wait_event("request_refused", 10, file="intruder.json")
    assert refused["uid"] == pwd.getpwnam("nobody").pw_uid
    time.sleep(2)
    assert not job.seen("request", node="node2")
    assert not job.seen("swap_planned", node="node2")
    assert job.status()["nodes"]["node2"]["role"] == "ACTIVE"
    assert not (inbox / "intruder.json").exists()
    print(f"\n[refused] uid {refused['uid']}: {refused['why']}")


def test_nhc_hook_drains_through_evacuate_and_falls_back(healthy_cluster, tm_cli, tmp_path):
    hook = PLUGINS / "nhc" / "node-mark-offline-tm"
    log = tmp_path / "nhc.log"
    env = dict(healthy_cluster.env(), TM_SLURM=str(tm_cli), TM_SLURM_NHC_LOG=str(log))
    p = subprocess.run([str(hook), "node4", "check_fs_mount:  /scratch not mounted"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "evacuating node4" in p.stdout, p.stdout + p.stderr
    drained_after = healthy_cluster.wait_state("node4", "DRAIN", 15)
    end = time.monotonic() + 15
    while "every node is DRAINED" not in log.read_text():
        assert time.monotonic() < end, log.read_text()
        time.sleep(0.2)
    info = healthy_cluster.scontrol("show", "node", "node4").stdout
    assert "Reason=NHC: check_fs_mount:  /scratch not mounted" in info
    env["TM_SLURM"] = str(tmp_path / "no-such-tm-slurm")
    env["TM_SLURM_NHC_FALLBACK"] = str(tmp_path / "no-such-helper")
    p = subprocess.run([str(hook), "node5", "bad gpu"], env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "marking node5 offline the plain way" in p.stdout, p.stdout + p.stderr
    assert "Reason=NHC: bad gpu" in healthy_cluster.scontrol("show", "node", "node5").stdout
    print(f"\n[nhc] hook returned, node4 DRAIN {drained_after:.2f} s later")
