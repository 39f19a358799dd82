"""The minicluster itself: a real 5-node Slurm cluster whose nodes really fail.

    pytest tests/slurm/test_minicluster.py -m slurm -x -q      (as root)

Timings are printed (`-s` shows them). With the default SlurmdTimeout=10 and
MessageTimeout=5 a dead node is DOWN after about 16-21 s; the two tests that wait for
that are the bulk of this file's runtime.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import NODES

from tm_slurm.minicluster import MiniCluster, MiniClusterError
from tm_slurm.minicluster.cli import add_parser

ALL = [f"node{i}" for i in range(1, NODES + 1)]
DOWN_WITHIN = 45  # s; about twice what SlurmdTimeout=10 MessageTimeout=5 give


def _out(mc: MiniCluster, *argv: str, timeout: float = 60) -> str:
    """stdout of a Slurm client run from the host, the way project code runs them."""
    p = subprocess.run(argv, env=mc.env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(argv)}: rc={p.returncode} {p.stderr}"
    return p.stdout


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _inits(mc: MiniCluster) -> set[int]:
    """pids of the machines' PID 1 (nodeinit.py; not their `unshare` parents)"""
    return {p for p, c in mc.pids().items() if "nodeinit.py" in c and not c.startswith("unshare")}


def _wait(pred, timeout: float, interval: float = 0.2):
    end = time.monotonic() + timeout
    while not (v := pred()):
        assert time.monotonic() < end, f"timed out after {timeout} s"
        time.sleep(interval)
    return v


def _cli(*argv: str, **kw) -> subprocess.CompletedProcess:
    """`tm-slurm minicluster ARGV` once the main CLI has the verb, else the same verbs
    through `python -m tm_slurm.minicluster`."""
    from tm_slurm.cli import build_parser
    verbs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    entry = ["-m", "tm_slurm", "minicluster"] if "minicluster" in verbs.choices else ["-m", "tm_slurm.minicluster"]
    return subprocess.run([sys.executable, *entry, *argv], text=True, capture_output=True, timeout=60, **kw)


# ---------------------------------------------------------------- basics

def test_all_nodes_idle_after_up(healthy_cluster):
    assert healthy_cluster.status() == {n: "IDLE" for n in ALL}


def test_up_is_idempotent(healthy_cluster):
    inits = _inits(healthy_cluster)
    took = healthy_cluster.up(nodes=NODES)
    print(f"\n[timing] up on a healthy cluster (no-op): {took:.2f} s")
    assert _inits(healthy_cluster) == inits
    assert len(inits) == NODES + 1  # head + the nodes


def test_srun_runs_one_task_on_each_node(healthy_cluster):
    t = time.monotonic()
    out = _out(healthy_cluster, "srun", f"-N{NODES}", "hostname")
    print(f"\n[timing] srun -N{NODES} hostname from the host: {time.monotonic() - t:.2f} s")
    assert sorted(out.split()) == ALL


def test_jobs_see_the_venv_home_and_shared_filesystem(healthy_cluster, tmp_path):
    out = tmp_path / "job.out"
    code = "import os, socket, sys, tm_slurm; print(socket.gethostname(), sys.prefix, os.environ['HOME'])"
    _out(healthy_cluster, "sbatch", "--wait", "-N1", "-w", "node3", "-o", str(out),
         "--wrap", f"python -c {shlex.quote(code)}")
    host, prefix, home = out.read_text().split()
    assert (host, prefix) == ("node3", sys.prefix)
    assert home == os.environ.get("HOME", home) and Path(home).is_dir()


def test_exec_runs_on_the_node_in_its_own_namespaces(healthy_cluster):
    p = healthy_cluster.run_on("node2", ["sh", "-c", "hostname; echo $$"], capture_output=True, text=True)
    host, pid = p.stdout.split()
    assert host == "node2" and int(pid) < 1000  # a PID namespace of its own


def test_drain_is_visible_within_a_second_and_resume_undoes_it(healthy_cluster):
    mc = healthy_cluster
    t = time.monotonic()
    mc.scontrol("update", "nodename=node2", "state=drain", "reason=test-drain")
    mc.wait_state("node2", "DRAIN", timeout=1.0, interval=0.02)
    print(f"\n[timing] drain visible to scontrol after {time.monotonic() - t:.3f} s")
    assert _out(mc, "sinfo", "-h", "-n", "node2", "-o", "%T").strip() == "drained"
    mc.scontrol("update", "nodename=node2", "state=resume")
    mc.wait_state("node2", lambda s: s == "IDLE", timeout=5)


# ---------------------------------------------------------------- failures

def test_crash_makes_the_node_down_and_restore_boots_it_again(healthy_cluster):
    mc = healthy_cluster
    t_fail = mc.fail("node5", "crash")
    assert mc.run_on("node5", ["true"], capture_output=True).returncode != 0  # nothing left
    mc.wait_state("node5", lambda s: "NOT_RESPONDING" in s, timeout=DOWN_WITHIN, interval=0.2)
    t_nr = time.time() - t_fail
    mc.wait_state("node5", "DOWN", timeout=DOWN_WITHIN, interval=0.2)
    t_down = time.time() - t_fail
    print(f"\n[timing] crash -> NOT_RESPONDING {t_nr:.1f} s, -> DOWN {t_down:.1f} s")
    assert mc.status()["node4"] == "IDLE"  # the others are not affected

    t = time.monotonic()
    mc.restore("node5", wait=True)
    print(f"[timing] restore --wait -> {mc.node_state('node5')} after {time.monotonic() - t:.2f} s")
    mc.wait_state("node5", lambda s: s == "IDLE", timeout=5)
    uptime = float(mc.run_on("node5", ["cat", "/proc/uptime"], capture_output=True, text=True).stdout.split()[0])
    assert uptime < 60  # a freshly booted machine: new boot time from its time namespace


STEPS_JOB = """\
#!/bin/bash
# one long step per node next to the batch step
for n in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  srun -N1 -n1 -w "$n" --overlap sleep 300 &
done
wait
"""


def test_netcut_of_a_node_leaves_a_no_kill_job_running_on_the_others(healthy_cluster, tmp_path):
    mc = healthy_cluster
    script = tmp_path / "steps.sh"
    script.write_text(STEPS_JOB)
    job = _out(mc, "sbatch", "--parsable", "-N5", "--no-kill", "-t", "5",
               "-o", str(tmp_path / "job.out"), str(script)).strip().split(";")[0]

    def steps() -> dict[str, str]:  # node -> step id
        rows = _out(mc, "squeue", "-s", "-h", "-j", job, "-o", "%i %N").splitlines()
        return {n: i for i, n in (r.split() for r in rows) if not i.endswith(".batch")}

    _wait(lambda: len(steps()) == 5, timeout=30)
    t_fail = mc.fail("node3", "netcut")
    mc.wait_state("node3", "DOWN", timeout=DOWN_WITHIN, interval=0.2)
    print(f"\n[timing] netcut -> DOWN {time.time() - t_fail:.1f} s")

    assert _out(mc, "squeue", "-h", "-j", job, "-o", "%T %N").split() == ["RUNNING", "node[1-2,4-5]"]
    assert {"node1", "node2", "node4", "node5"} <= set(steps())  # their steps run on
    # srun's exit status hides the loss (0); its message does not
    _wait(lambda: "Node failure on node3" in (tmp_path / "job.out").read_text(), timeout=40)
    mc.restore("node3", wait=True)


@pytest.mark.parametrize("mode", ["kill", "slurmd", "hang", "netcut"])
def test_failed_node_restored_at_once_is_back_idle(healthy_cluster, mode):
    mc = healthy_cluster
    mc.fail("node4", mode)
    t = time.monotonic()
    mc.restore("node4", wait=True)
    mc.wait_state("node4", lambda s: s == "IDLE", timeout=15)
    print(f"\n[timing] {mode} + restore -> IDLE {time.monotonic() - t:.2f} s")
    assert _out(mc, "srun", "-N1", "-w", "node4", "hostname").strip() == "node4"


# ---------------------------------------------------------------- CLI

def test_cli_run_passes_output_input_and_exit_status_through(healthy_cluster):
    p = _cli("run", "--", "sinfo", "-h", "-N", "-o", "%N %T")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [w for n in ALL for w in (n, "idle")]
    p = _cli("run", "--", "sh", "-c", "read x; echo got $x; exit 7", input="hello\n")
    assert (p.returncode, p.stdout) == (7, "got hello\n")


def test_cli_verbs_follow_the_project_convention(healthy_cluster, capsys):
    ap = argparse.ArgumentParser(prog="tm-slurm")
    add_parser(ap.add_subparsers(dest="verb", required=True))

    args = ap.parse_args(["minicluster", "status", "--json"])
    assert args.fn(args) == 0
    assert json.loads(capsys.readouterr().out)["nodes"] == {n: "IDLE" for n in ALL}

    args = ap.parse_args(["minicluster", "env"])
    assert args.fn(args) == 0
    assert capsys.readouterr().out.strip() == (f"export SLURM_CONF={healthy_cluster.conf_path}; "
                                               f"export PATH={healthy_cluster.bin_dir}:$PATH")


def test_cli_exec_and_fail_restore(healthy_cluster):
    assert _cli("exec", "node1", "--", "hostname").stdout.strip() == "node1"
    p = _cli("fail", "node2", "--mode", "kill")
    assert p.returncode == 0 and abs(float(p.stdout) - time.time()) < 30
    assert _cli("restore", "node2", "--wait").returncode == 0
    assert "DOWN" not in healthy_cluster.node_state("node2")


def test_up_fails_clearly_when_slurm_is_missing(tmp_path, monkeypatch):
    bare = tmp_path / "bin"  # a PATH with a shell and nothing of Slurm
    bare.mkdir()
    for tool in ("bash", "dirname", "id", "date"):
        (bare / tool).symlink_to(subprocess.check_output(["sh", "-c", f"command -v {tool}"], text=True).strip())
    monkeypatch.setenv("PATH", str(bare))
    mc = MiniCluster(tmp_path / "mc", settings={"prefix": "tmsnope"})
    with pytest.raises(MiniClusterError, match="missing command 'slurmctld'"):
        mc.up(nodes=1)
    monkeypatch.undo()
    assert mc.namespaces() == [] and not mc.bin_dir.exists()


# ---------------------------------------------------------------- teardown (keep last)

def _job_id(mc: MiniCluster) -> int:
    """The id a new job gets (the job itself is cancelled at once)."""
    job = int(_out(mc, "sbatch", "--parsable", "-N1", "-o", "/dev/null", "--wrap", "true").split(";")[0])
    mc.cancel_jobs()
    return job


def test_down_leaves_no_namespace_and_no_process(healthy_cluster):
    mc = healthy_cluster
    before = _job_id(mc)
    pids = mc.pids()
    assert len(mc.namespaces()) == NODES + 1 and len(_inits(mc)) == NODES + 1
    took = mc.down()
    print(f"\n[timing] down: {took:.2f} s")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert [ln for ln in listed.splitlines() if ln.startswith(f"{mc.prefix}-")] == []
    assert {p: c for p, c in pids.items() if _cmdline(p) == c} == {}
    assert not mc.state_dir.exists() and not mc.bin_dir.exists()
    assert (mc.run_dir / "last-logs" / "slurmctld.log").exists()
    took = mc.up(nodes=NODES)  # from nothing; later tests of the session get their cluster back
    print(f"[timing] up from nothing: {took:.2f} s")
    # job ids go on: a new job never takes over an earlier job's tm_slurm_jobs/<id>
    after = _job_id(mc)
    assert after > before, (before, after)
