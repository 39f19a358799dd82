"""Sandboxed warm-up and the general standby (issue: sandbox), with real processes."""
import json
from pathlib import Path

import pytest

from tm_slurm import jobdir

from ..jobs import run_job

pytestmark = pytest.mark.procs


def _status(job_dir: Path) -> dict:
    return json.loads(jobdir.status_file(job_dir).read_text())


def _pid(job_dir: Path, node: str) -> int:
    return _status(job_dir)["nodes"][node]["workers"][0]["pid"]


def _tcp_peers(pid: int) -> set[int]:
    """Remote ports of the process's established TCP connections."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            t = fd.readlink().as_posix()
        except OSError:
            continue
        if t.startswith("socket:["):
            inodes.add(t[8:-1])
    peers = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[9] in inodes and f[3] == "01":               # ESTABLISHED
                peers.add(int(f[2].rsplit(":", 1)[1], 16))
    return peers


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_sandbox_talks_to_no_active_node_and_actives_do_not_grow(tmp_path, reference):
    seen = {}

    def inspect_standby(job_dir):
        ev = next(e for e in map(json.loads, open(jobdir.events_file(job_dir))) if e["kind"] == "job_start")
        seen["store"] = ev["store"][1]
        seen["standby_peers"] = _tcp_peers(_pid(job_dir, "node5"))
        seen["rss_before"] = {n: _rss(_pid(job_dir, n)) for n in ("node1", "node3", "node4")}

    def after(job_dir):
        seen["rss_after"] = {n: _rss(_pid(job_dir, n)) for n in ("node1", "node3", "node4")}

    ran = run_job(tmp_path, "4+1", 110, [(15, inspect_standby, None), (16, "drain", "node2"),
                                        ("swap_complete", after, None)])
    assert ran.rc == 0 and ran.result["digests"] == reference(110)
    # a warmed standby holds exactly one connection: the controller's store, no active worker
    assert seen["standby_peers"] == {seen["store"]}, seen
    ready = [e for e in ran.kinds("node_ready") if e["node"] == "node5"][0]
    assert ready["warm"] and ready["sandbox"]["ops_served_locally"] > 0
    assert set(ready["sandbox"]["roles"]) == {"first", "last"}
    assert ready["sandbox"]["recorded_served"] > 0, "stand-ins recorded from a real step were used"
    for n, before in seen["rss_before"].items():
        assert abs(seen["rss_after"][n] - before) / before < 0.05, (n, before, seen["rss_after"][n])
    (joined,) = ran.kinds("rank_joined")
    # PP=2 rehearses first, then last, and parks in "last"; node2 holds a first stage, so its
    # model was built anew (in a warm process); reuse of the parked role is covered below
    assert joined["reused_sandbox"] is False


def test_general_standby_rehearses_every_role_and_is_promoted_into_each(tmp_path, reference):
    """PP=3, DP=1: three standbys, each rehearsing first, last and middle; three drains move the
    first, the middle and the last stage onto them, all bit-identical."""
    layout = ("--dp", "1", "--pp", "3")
    ran = run_job(tmp_path, "3+3", 100, [(10, "drain", "node1"), (11, "drain", "node2"), (12, "drain", "node3")],
                  layout=layout, script_args=["--layers", "6"])
    assert ran.rc == 0
    assert ran.result["digests"] == reference(100, layout, active=3, script_args=("--layers", "6"))
    for e in ran.kinds("node_ready"):
        if e["role"] == "STANDBY":
            assert list(e["sandbox"]["roles"]) == ["first", "last", "middle"]
    swaps = ran.interruption("planned")
    assert sorted(s["node"] for s in swaps) == ["node1", "node2", "node3"]
    joined = {e["rank"]: e for e in ran.kinds("rank_joined")}
    assert joined[1]["reused_sandbox"] is True                     # middle: the parked role
    assert joined[0]["reused_sandbox"] is False and joined[2]["reused_sandbox"] is False
