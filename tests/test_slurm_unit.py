"""Unit tests of the Slurm boundary (no cluster needed).

Parsers run on golden output captured from a real Slurm 22.05.8 cluster (tests/data/slurm/,
regenerate with tests/data/slurm/capture.sh). The pyslurm backend is tested through its pure
mapping functions and a fake pyslurm module only.
"""
from __future__ import annotations

import enum
import json
import random
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tm_slurm.slurm import address, allocation, backend, choose, classify as cl, cli_backend as cb, hostlist
from tm_slurm.slurm import pyslurm_backend as pb
from tm_slurm.slurm.backend import JobInfo, NodeState, Reservation, SlurmError

DATA = Path(__file__).parent / "data" / "slurm"
GOLDEN_NOW = 1796221153.0       # when sinfo_drain_reboot.json etc. were captured (reason time)


def golden(name: str) -> str:
    return (DATA / name).read_text()


@pytest.fixture
def utc(monkeypatch):
    """The golden samples were captured on a UTC machine in Slurm's local-time format."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


# ============================================================================ hostlist

@pytest.mark.parametrize("text, names", [
    ("node[1-3,5],gpu[01-02],login",
     ["node1", "node2", "node3", "node5", "gpu01", "gpu02", "login"]),
    ("node[01-03]", ["node01", "node02", "node03"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
    ("node[009-011]", ["node009", "node010", "node011"]),
    ("node[8-011]", ["node8", "node9", "node10", "node11"]),       # width of the low bound
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),             # as scontrol show hostnames
    ("a[1,3-4]", ["a1", "a3", "a4"]),
    ("node1", ["node1"]),
    ("node[3,1-2,1]", ["node3", "node1", "node2", "node1"]),        # order and duplicates kept
    (" node1, node2 ", ["node1", "node2"]),
    ("node1 node2", ["node1", "node2"]),
    ("rack1-node[1-2],rack2-node1", ["rack1-node1", "rack1-node2", "rack2-node1"]),
    ("", []), ("(null)", []),
])
def test_expand(text, names):
    assert hostlist.expand(text) == names


def test_expand_iterable():
    assert hostlist.expand(["node[1-2]", "login"]) == ["node1", "node2", "login"]


@pytest.mark.parametrize("bad, what", [
    ("n[1-3]x", "after ']'"), ("node[3-1]", "descending"), ("node[a-b]", "bad range"),
    ("node[1-2", "unbalanced"), ("node[1-2]]", "unbalanced"), ("node[]", "empty"),
    ("node[[1-2]]", "nested"), ("node[1-]", "bad range"), ("node[1-99999999]", "larger"),
])
def test_expand_rejects(bad, what):
    with pytest.raises(ValueError, match=what):
        hostlist.expand(bad)


# exactly what `scontrol show hostlist` printed on Slurm 22.05.8 (see the real-cluster test)
SCONTROL_HOSTLIST = [
    ("node3,node1,node2", "node[3,1-2]"),
    ("node3,node1,node2,node1", "node[3,1-2,1]"),
    ("gpu01,node2,node1,gpu02,login", "gpu01,node[2,1],gpu02,login"),
    ("node9,node10,node11", "node[9-11]"),
    ("node09,node10,node8", "node[09-10,8]"),
    ("n1,n01,n001", "n[1,01,001]"),
    ("a1b3,a1b4,a2b3", "a1b[3-4],a2b3"),
    ("login,node1,alpha", "login,node1,alpha"),
    ("node1,node2,node3,node5", "node[1-3,5]"),
    ("x-1,x-2,x3", "x-[1-2],x3"),
    ("node007,node008,node010", "node[007-008,010]"),
    ("rack1-node1,rack1-node2,rack2-node1", "rack1-node[1-2],rack2-node1"),
    ("node1,node01", "node[1,01]"),
    ("node1,login,node2", "node1,login,node2"),
]


@pytest.mark.parametrize("names, expected", SCONTROL_HOSTLIST)
def test_compress_matches_scontrol(names, expected):
    assert hostlist.compress(names.split(",")) == expected


def test_compress_sorted():
    assert hostlist.compress(["node3", "node1", "node2", "node1"], sort=True) == "node[1-3]"
    assert hostlist.compress(["node10", "node9", "gpu2", "gpu1"], sort=True) == "gpu[1-2],node[9-10]"
    assert hostlist.compress([]) == ""


@pytest.mark.parametrize("bad", ["", "a,b", "n[1]", "a b"])
def test_compress_rejects(bad):
    with pytest.raises(ValueError):
        hostlist.compress([bad])


def _random_names(rng: random.Random) -> list[str]:
    prefixes = ["node", "gpu", "n", "rack1-node", "x-", "a1b"]
    names = []
    for _ in range(rng.randint(0, 40)):
        r = rng.random()
        if r < 0.1:
            names.append(rng.choice(["login", "head", "alpha"]))
            continue
        width = rng.choice([1, 1, 2, 3])
        num = rng.choice([rng.randint(0, 12), rng.randint(0, 120), rng.randint(95, 105)])
        names.append(f"{rng.choice(prefixes)}{num:0{width}d}")
        if rng.random() < 0.5:          # runs of consecutive numbers
            for k in range(1, rng.randint(1, 6)):
                names.append(f"{names[-1].rstrip('0123456789')}{num + k:0{width}d}")
    return names


def test_compress_expand_round_trip_property():
    rng = random.Random(1234)
    for _ in range(1000):
        names = _random_names(rng)
        text = hostlist.compress(names)
        assert hostlist.expand(text) == names, (names, text)
        s = hostlist.compress(names, sort=True)
        assert sorted(hostlist.expand(s)) == sorted(set(names)), (names, s)
        assert len(hostlist.expand(s)) == len(set(names))
        assert hostlist.compress(hostlist.expand(s), sort=True) == s     # canonical: a fixpoint


def test_expand_compress_round_trip_from_text():
    for text in ["node[1-3,5],gpu[01-02],login", "node[09-10,8]", "n[1,01,001]", "node[007-008,010]"]:
        assert hostlist.compress(hostlist.expand(text)) == text


# ============================================================================ small parsers

@pytest.mark.parametrize("text, secs", [
    ("UNLIMITED", None), ("INFINITE", None), ("N/A", None), ("Partition_Limit", None), ("", None),
    ("00:10:00", 600), ("1-00:00:00", 86400), ("2-03:04:05", 2 * 86400 + 3 * 3600 + 245),
    ("10:30", 630), ("45", 2700), ("1-2", 93600), ("1-02:30", 95400), ("120:00:00", 432000),
    (30, 1800),                                         # pyslurm/openapi minutes
])
def test_parse_duration(text, secs):
    assert cb.parse_duration(text) == secs


def test_parse_duration_rejects_garbage():
    with pytest.raises(ValueError):
        cb.parse_duration("soon")


def test_parse_time(utc):
    assert cb.parse_time("1796221453") == 1796221453.0
    assert cb.parse_time("2026-12-02T14:24:13") == 1796221453.0
    assert cb.parse_time(1796221453) == 1796221453.0
    assert cb.parse_time({"set": True, "infinite": False, "number": 5}) == 5.0
    for nothing in (None, 0, "0", "Unknown", "None", "N/A", "(null)", {"set": False, "number": 0},
                    "15:17:48"):                       # `relative` format: not guessed at
        assert cb.parse_time(nothing) is None


def test_parse_kv_line():
    kv = cb.parse_kv_line("NodeName=n1 OS=Linux 6.1 #1 SMP  RealMemory=1000 TRES=cpu=2,mem=1G "
                          "AllocNode:Sid=h:1 CPUs/Task=1 Reason=maint: a=b [root@2026-12-02T14:19:13]",
                          rest_of_line=("Reason",))
    assert kv["OS"] == "Linux 6.1 #1 SMP" and kv["RealMemory"] == "1000"
    assert kv["TRES"] == "cpu=2,mem=1G" and kv["AllocNode:Sid"] == "h:1" and kv["CPUs/Task"] == "1"
    assert kv["Reason"] == "maint: a=b [root@2026-12-02T14:19:13]"
    assert cb.parse_reason(kv["Reason"])[:2] == ("maint: a=b", "root")


def test_split_state():
    assert backend.split_state("MIXED+DRAIN+REBOOT_REQUESTED") == ("MIXED", {"DRAIN", "REBOOT_REQUESTED"})
    assert backend.split_state("idle") == ("IDLE", frozenset())
    assert backend.split_state("mixed*") == ("MIXED", {"NOT_RESPONDING"})
    assert backend.split_state("DOWN+NOT_RESPONDING") == ("DOWN", {"NOT_RESPONDING"})
    assert backend.split_state("DRAIN+IDLE") == ("IDLE", {"DRAIN"})
    assert backend.split_state("") == ("UNKNOWN", frozenset())


@pytest.mark.parametrize("state, draining, drained", [
    ("MIXED+DRAIN", True, False), ("ALLOCATED+DRAIN", True, False),
    ("MIXED+DRAIN+REBOOT_REQUESTED", True, False), ("IDLE+DRAIN+COMPLETING", True, False),
    ("IDLE+DRAIN", False, True), ("DOWN+DRAIN", False, True), ("MIXED", False, False),
    ("IDLE", False, False),
])
def test_node_state_draining(state, draining, drained):
    base, flags = backend.split_state(state)
    n = NodeState("n1", base, flags)
    assert (n.draining, n.drained, n.drain_requested) == (draining, drained, draining or drained)


# ============================================================================ golden samples

def test_sinfo_json_drain_and_reboot():
    nodes = cb.parse_sinfo_json(golden("sinfo_drain_reboot.json"))
    assert sorted(nodes) == ["node1", "node2", "node3", "node4", "node5"]
    n1, n3, n4, n5 = nodes["node1"], nodes["node3"], nodes["node4"], nodes["node5"]
    assert (n1.state, n1.flags, n1.reason, n1.reason_time, n1.reason_user) == ("IDLE", frozenset(), "", None, "")
    assert n1.boot_time and n1.boot_time > 1.7e9
    assert (n3.state, n3.flags) == ("MIXED", frozenset())
    assert (n4.state, n4.flags, n4.reason, n4.reason_user) == ("MIXED", {"DRAIN"}, "tm golden drain", "root")
    assert n4.reason_time == GOLDEN_NOW and n4.draining and not n4.drained
    assert (n5.state, n5.flags, n5.reason) == ("MIXED", {"DRAIN", "REBOOT_REQUESTED"}, "tm golden reboot")
    assert n5.state_string == "MIXED+DRAIN+REBOOT_REQUESTED"


def test_sinfo_json_filters_names():
    # Slurm 22.05 ignores `sinfo --json -n ...`: the filter is ours
    nodes = cb.parse_sinfo_json(golden("sinfo_drain_reboot.json"), ["node4", "node5", "nosuch"])
    assert sorted(nodes) == ["node4", "node5"]


def test_sinfo_json_idle_drain_fail_maintenance():
    nodes = cb.parse_sinfo_json(golden("sinfo_idle_drain_fail_maint.json"))
    assert (nodes["node2"].state, nodes["node2"].flags) == ("IDLE", {"DRAIN"})
    assert nodes["node2"].drained and not nodes["node2"].draining
    assert (nodes["node3"].state, nodes["node3"].flags) == ("MIXED", {"MAINTENANCE", "RESERVED"})
    assert (nodes["node5"].state, nodes["node5"].flags, nodes["node5"].reason) == \
        ("MIXED", {"FAIL"}, "tm golden fail")


def test_sinfo_json_newer_layouts():
    doc = {"nodes": [{"name": "n1", "state": ["IDLE", "DRAIN"], "reason": "x",
                      "reason_changed_at": {"set": True, "infinite": False, "number": 7},
                      "reason_set_by_user": "bob", "boot_time": {"set": True, "number": 9}}]}
    n = cb.parse_sinfo_json(json.dumps(doc))["n1"]
    assert (n.state, n.flags, n.reason_time, n.reason_user, n.boot_time) == ("IDLE", {"DRAIN"}, 7.0, "bob", 9.0)


def test_sinfo_json_garbage():
    with pytest.raises(SlurmError, match="not JSON"):
        cb.parse_sinfo_json("sinfo: error: oops")


@pytest.mark.parametrize("sinfo, scontrol", [
    ("sinfo_drain_reboot.json", "scontrol_node_drain_reboot.txt"),
    ("sinfo_idle_drain_fail_maint.json", "scontrol_node_idle_drain_fail_maint.txt"),
])
def test_scontrol_nodes_agree_with_sinfo_json(utc, sinfo, scontrol):
    a = cb.parse_sinfo_json(golden(sinfo))
    b = cb.parse_scontrol_nodes(golden(scontrol))
    assert sorted(a) == sorted(b)
    for name in a:
        x, y = a[name], b[name]
        assert (x.state, x.flags, x.reason, x.reason_user, x.reason_time) == \
            (y.state, y.flags, y.reason, y.reason_user, y.reason_time), name
        assert abs(x.boot_time - y.boot_time) <= 1.5        # slurmd's boot time jitters by 1 s


def test_reservations_golden(utc):
    none = cb.parse_scontrol_reservations(golden("scontrol_res_none.txt"))
    assert none == []
    std = cb.parse_scontrol_reservations(golden("scontrol_res_maint.txt"))
    epoch = cb.parse_scontrol_reservations(golden("scontrol_res_maint_epoch.txt"))
    assert std == epoch
    (r,) = epoch
    assert r == Reservation("tm_golden_maint", ("node5",), GOLDEN_NOW + 300, GOLDEN_NOW + 300 + 1800,
                            frozenset({"MAINT", "IGNORE_JOBS", "SPEC_NODES"}), "INACTIVE")
    assert r.maint and not r.active_at(GOLDEN_NOW) and r.active_at(GOLDEN_NOW + 301)
    two = cb.parse_scontrol_reservations(golden("scontrol_res_two_epoch.txt"))
    assert [(x.name, x.nodes, x.state) for x in two] == [
        ("tm_golden_maint", ("node5",), "INACTIVE"), ("tm_golden_active", ("node3",), "ACTIVE")]


def test_job_running_golden(utc):
    std = cb.parse_scontrol_job(golden("scontrol_job_running.txt"), "22")
    epoch = cb.parse_scontrol_job(golden("scontrol_job_running_epoch.txt"), "22")
    assert std == epoch
    assert std == JobInfo(job_id="22", state="RUNNING", nodes=("node3", "node4", "node5"), user="root",
                          workdir="/tmp", batch_host="node3", time_limit_s=600.0, restarts=0, reason="",
                          start_time=GOLDEN_NOW, end_time=GOLDEN_NOW + 600, requeue=True)


def test_job_pending_golden():
    j = cb.parse_scontrol_job(golden("scontrol_job_pending.txt"))
    assert (j.job_id, j.state, j.nodes, j.batch_host, j.reason, j.time_limit_s, j.start_time) == \
        ("23", "PENDING", (), "", "JobHeldUser", 300.0, None)


def test_job_picks_matching_line():
    text = "JobId=7 JobState=RUNNING NodeList=a1\nJobId=8 JobState=PENDING NodeList=(null)\n"
    assert cb.parse_scontrol_job(text, "8").state == "PENDING"
    assert cb.parse_scontrol_job("", "8") is None


# ============================================================================ CLI backend (fake runner)

class FakeRun:
    """Stands in for subprocess.run: answers by the command's first words, records the calls."""

    def __init__(self, answers=None, default=(0, "", "")):
        self.answers = answers or {}
        self.default = default
        self.calls = []

    def __call__(self, argv, **kw):
        self.calls.append((list(argv), kw))
        for prefix, ans in self.answers.items():
            if tuple(argv[:len(prefix)]) == prefix:
                if isinstance(ans, BaseException):
                    raise ans
                rc, out, err = ans
                return subprocess.CompletedProcess(argv, rc, out, err)
        rc, out, err = self.default
        return subprocess.CompletedProcess(argv, rc, out, err)


def test_cli_nodes_is_one_batched_query():
    run = FakeRun({("sinfo",): (0, golden("sinfo_drain_reboot.json"), "")})
    be = cb.CliBackend(run=run, env={"SLURM_CONF": "/x/slurm.conf"}, timeout=3)
    got = be.nodes(["node5", "node4", "node4", "nosuch"])
    assert sorted(got) == ["node4", "node5"]
    assert len(run.calls) == 1
    argv, kw = run.calls[0]
    assert argv == ["sinfo", "--json", "-n", "node[4-5],nosuch"]
    assert kw["timeout"] == 3 and kw["env"]["SLURM_CONF"] == "/x/slurm.conf"
    assert kw["env"]["SLURM_TIME_FORMAT"] == "%s" and "PATH" in kw["env"]
    assert be.nodes([]) == {} and len(run.calls) == 1


def test_cli_nodes_scontrol_mode(utc):
    run = FakeRun({("scontrol", "show", "node"): (1, golden("scontrol_node_drain_reboot.txt"),
                                                  "Node nosuch not found")})
    be = cb.CliBackend(run=run, node_query="scontrol")
    got = be.nodes(["node4", "nosuch"])
    assert list(got) == ["node4"] and got["node4"].flags == {"DRAIN"}
    assert run.calls[0][0] == ["scontrol", "show", "node", "-o", "node4,nosuch"]


def test_cli_errors_are_clear():
    be = cb.CliBackend(run=FakeRun(default=(1, "", "slurm_load_partitions: Unable to contact slurm controller")))
    with pytest.raises(SlurmError) as ei:
        be.reservations()
    msg = str(ei.value)
    assert "`scontrol show res -o` failed with exit code 1" in msg and "Unable to contact" in msg
    assert ei.value.returncode == 1 and ei.value.argv[0] == "scontrol"

    be = cb.CliBackend(run=FakeRun({("sinfo",): FileNotFoundError(2, "No such file")}))
    with pytest.raises(SlurmError, match=r"Slurm CLI not found \(is slurm-client installed / on PATH\?\)"):
        be.nodes(["n1"])

    be = cb.CliBackend(run=FakeRun({("scontrol",): subprocess.TimeoutExpired(["scontrol"], 10)}), timeout=10)
    with pytest.raises(SlurmError, match="timed out after 10 s"):
        be.job("5")


def test_cli_job_and_workdir():
    run = FakeRun({("scontrol", "show", "job", "-o", "22"): (0, golden("scontrol_job_running_epoch.txt"), ""),
                   ("scontrol", "show", "job"): (1, "", "slurm_load_jobs error: Invalid job id specified")})
    be = cb.CliBackend(run=run)
    assert be.job("22").nodes == ("node3", "node4", "node5")
    assert be.job_workdir("22") == "/tmp"
    assert be.job("999") is None and be.job_workdir("999") is None


def _release_backend(job_text="scontrol_job_running_epoch.txt"):
    run = FakeRun({("scontrol", "show", "job"): (0, golden(job_text), "")})
    return cb.CliBackend(run=run), run


def test_cli_release_nodes_command():
    be, run = _release_backend()
    be.release_nodes("22", ["node4", "node3"])
    assert run.calls[-1][0] == ["scontrol", "update", "JobId=22", "NodeList=node[3-4]"]


@pytest.mark.parametrize("keep, match", [
    ([], "keep is empty"), (["node4", "node5"], "batch host node3 must be kept"),
    (["node3", "node9"], "node9 not in the job's allocation node\\[3-5\\]"),
])
def test_cli_release_nodes_checks(keep, match):
    be, run = _release_backend()
    with pytest.raises(SlurmError, match=match):
        be.release_nodes("22", keep)
    assert not any(c[0][:2] == ["scontrol", "update"] for c in run.calls)


def test_cli_release_nodes_noop_and_pending():
    be, run = _release_backend()
    be.release_nodes("22", ["node5", "node3", "node4"])
    assert not any(c[0][:2] == ["scontrol", "update"] for c in run.calls)
    be, run = _release_backend("scontrol_job_pending.txt")
    with pytest.raises(SlurmError, match="PENDING, not RUNNING"):
        be.release_nodes("23", ["node1"])


def test_cli_actions_argv():
    run = FakeRun()
    be = cb.CliBackend(run=run)
    be.notify("7", "moving off node3")
    be.requeue("7")
    be.drain(["node2", "node1"], "tm-slurm: disk failing")
    be.resume(["node1"])
    be.drain([], "x")
    be.resume([])
    assert [c[0] for c in run.calls] == [
        ["scontrol", "notify", "7", "moving off node3"], ["scontrol", "requeue", "7"],
        ["scontrol", "update", "NodeName=node[1-2]", "State=DRAIN", "Reason=tm-slurm: disk failing"],
        ["scontrol", "update", "NodeName=node1", "State=RESUME"]]
    with pytest.raises(SlurmError, match="requires a reason"):
        be.drain(["node1"], " ")


def test_cli_action_error_hints():
    be = cb.CliBackend(run=FakeRun(default=(1, "", "Requested operation is presently disabled for job 15")))
    with pytest.raises(SlurmError, match="--requeue"):
        be.requeue("15")
    be = cb.CliBackend(run=FakeRun(default=(1, "", "slurm_update error: Invalid node state specified")))
    with pytest.raises(SlurmError, match="not drained"):
        be.resume(["node1"])


def test_resizes_once_from_the_config():
    """21.08-24.05 without slurmdbd refuse a resized job's every later update (backend.resizes_once)."""
    conf = cb.parse_scontrol_config(golden("scontrol_config.txt"))
    assert (conf["SLURM_VERSION"], conf["AccountingStorageType"]) == ("22.05.8", "accounting_storage/none")
    assert conf["MessageTimeout"] == "5 sec"
    run = FakeRun({("scontrol", "show", "config"): (0, golden("scontrol_config.txt"), "")})
    assert cb.CliBackend(run=run).resizes_once() and run.calls[0][0] == ["scontrol", "show", "config"]
    for version, storage, once in [("21.08.8", "accounting_storage/none", True),
                                   ("24.05.8", "accounting_storage/none", True),
                                   ("24.11.0", "accounting_storage/none", False),   # 98c2add5bc
                                   ("20.11.9", "accounting_storage/none", False),
                                   ("22.05.8", "accounting_storage/slurmdbd", False),
                                   ("", "accounting_storage/none", False)]:
        assert backend.resizes_once(version, storage) is once, (version, storage)


def test_cli_backend_satisfies_protocol():
    assert isinstance(cb.CliBackend(run=FakeRun()), backend.SlurmBackend)
    assert isinstance(pb.PyslurmBackend(module=object()), backend.SlurmBackend)


# ============================================================================ backend_for

def test_backend_for(monkeypatch):
    monkeypatch.setattr(choose, "_pyslurm_version", lambda: None)
    monkeypatch.setattr(choose, "slurm_version", lambda env=None, timeout=10.0: (22, 5))
    assert choose.backend_for("auto").name == "cli"
    assert choose.backend_for("cli").name == "cli"
    with pytest.raises(SlurmError, match="pyslurm is not importable"):
        choose.backend_for("pyslurm")
    monkeypatch.setattr(choose, "_pyslurm_version", lambda: (25, 11))
    assert choose.backend_for("auto").name == "cli"
    with pytest.raises(SlurmError, match=r"built for Slurm 25.11 but this cluster runs Slurm 22.05"):
        choose.backend_for("pyslurm")
    monkeypatch.setattr(choose, "_pyslurm_version", lambda: (22, 5))
    assert choose.backend_for("auto").name == "pyslurm"
    assert choose.backend_for("pyslurm").name == "pyslurm"
    with pytest.raises(ValueError, match="unknown Slurm backend"):
        choose.backend_for("rest")


def test_parse_version():
    assert choose.parse_version(golden("sinfo_version.txt")) == (22, 5)
    assert choose.parse_version("slurm 24.05.1") == (24, 5)
    assert choose.parse_version("25.11.0") == (25, 11)     # pyslurm __version__
    assert choose.parse_version("garbage") is None


# ============================================================================ pyslurm mapping (fakes)

class FakeResvFlags(enum.Flag):
    """Mimics pyslurm.ReservationFlags (an enum.Flag; member names as in pyslurm 25.x)."""
    MAINTENANCE = 1
    IGNORE_RUNNING_JOBS = 2
    SPECIFIC_NODES = 4
    FLEX = 8


def fake_node(**kw):
    base = dict(name="node4", state="MIXED+DRAIN", reason="tm golden drain", reason_user="root",
                reason_time=1796221153, boot_time=1796218333)
    base.update(kw)
    return SimpleNamespace(**base)


def fake_job(**kw):
    base = dict(id=22, state="RUNNING", state_reason="None", allocated_nodes="node[3-5]",
                user_name="root", working_directory="/tmp", batch_host="node3", time_limit=10,
                requeue_count=0, is_requeueable=True, start_time=1796221153, end_time=1796221753)
    base.update(kw)
    return SimpleNamespace(**base)


def test_node_from_pyslurm():
    n = pb.node_from_pyslurm(fake_node())
    assert n == NodeState("node4", "MIXED", frozenset({"DRAIN"}), "tm golden drain", 1796221153.0,
                          "root", 1796218333.0)
    # pyslurm 23.x: reason_time is a formatted string, the epoch is in reason_time_raw
    n = pb.node_from_pyslurm(fake_node(state="IDLE+DRAIN+REBOOT_REQUESTED", reason_time="2026-12-02T14:19:13",
                                       reason_time_raw=1796221153, reason=None, reason_user=None))
    assert (n.state, n.flags, n.reason, n.reason_user, n.reason_time) == \
        ("IDLE", {"DRAIN", "REBOOT_REQUESTED"}, "", "", 1796221153.0)
    n = pb.node_from_pyslurm(fake_node(state="DOWN+NOT_RESPONDING", reason_time=None, boot_time=0))
    assert (n.state, n.flags, n.reason_time, n.boot_time) == ("DOWN", {"NOT_RESPONDING"}, None, None)


def test_reservation_from_pyslurm():
    r = pb.reservation_from_pyslurm(SimpleNamespace(
        name="maint", nodes="node[4-5]", start_time=100, end_time=200, is_active=False,
        flags=FakeResvFlags.MAINTENANCE | FakeResvFlags.IGNORE_RUNNING_JOBS | FakeResvFlags.SPECIFIC_NODES))
    assert r == Reservation("maint", ("node4", "node5"), 100.0, 200.0,
                            frozenset({"MAINT", "IGNORE_JOBS", "SPEC_NODES"}), "INACTIVE")
    r = pb.reservation_from_pyslurm(SimpleNamespace(name="x", nodes=None, start_time=100, end_time=None,
                                                    flags=["FLEX"], is_active=True))
    assert (r.nodes, r.end, r.flags, r.state) == ((), float("inf"), {"FLEX"}, "ACTIVE")


def test_job_from_pyslurm():
    j = pb.job_from_pyslurm(fake_job())
    assert j == cb.parse_scontrol_job(golden("scontrol_job_running_epoch.txt"))
    j = pb.job_from_pyslurm(fake_job(state="PENDING", allocated_nodes=None, time_limit=None,
                                     batch_host=None, state_reason="JobHeldUser", requeue_count=None))
    assert (j.nodes, j.time_limit_s, j.batch_host, j.reason, j.restarts) == ((), None, "", "JobHeldUser", 0)


class FakeRPCError(Exception):
    def __init__(self, msg, errno=None):
        super().__init__(msg)
        self.errno = errno


class FakePyslurm:
    """Mimics the parts of the pyslurm 25.x module the backend uses, recording calls."""

    RPCError = FakeRPCError

    def __init__(self):
        self.calls = []
        fake = self

        class _Nodes:
            @staticmethod
            def load():
                return {"node4": fake_node(), "node5": fake_node(name="node5", state="MIXED"),
                        "node9": fake_node(name="node9", state="IDLE")}

        class _Reservations:
            @staticmethod
            def load():
                return {"m": SimpleNamespace(name="m", nodes="node5", start_time=10, end_time=20,
                                             flags=FakeResvFlags.MAINTENANCE, is_active=False)}

        class _Job:
            def __init__(self, job_id):
                self.job_id = job_id

            @staticmethod
            def load(job_id):
                if job_id != 22:
                    raise FakeRPCError("Invalid job id specified", errno=2017)
                return fake_job()

            def modify(self, changes):
                fake.calls.append(("modify", self.job_id, changes.kw))

            def notify(self, msg):
                fake.calls.append(("notify", self.job_id, msg))

            def requeue(self, hold=False):
                if self.job_id == 15:
                    raise FakeRPCError("Requested operation is presently disabled")
                fake.calls.append(("requeue", self.job_id))

        class _Node:
            def __init__(self, name=None, **kw):
                self.name, self.kw = name, kw

            def modify(self, changes):
                fake.calls.append(("node-modify", self.name, changes.kw))

        self.Nodes, self.Reservations, self.Job, self.Node = _Nodes, _Reservations, _Job, _Node
        self.JobSubmitDescription = lambda **kw: SimpleNamespace(kw=kw)


def test_pyslurm_backend_with_fake_module():
    ps = FakePyslurm()
    be = pb.PyslurmBackend(module=ps)
    assert sorted(be.nodes(["node4", "node5", "nosuch"])) == ["node4", "node5"]
    assert be.nodes([]) == {}
    (r,) = be.reservations()
    assert r.maint and r.nodes == ("node5",)
    assert be.job("22").batch_host == "node3" and be.job_workdir("22") == "/tmp"
    assert be.job("23") is None and be.job_workdir("23") is None
    be.release_nodes("22", ["node3", "node4"])
    be.notify("22", "hi")
    be.requeue("22")
    be.drain(["node4"], "broken fan")
    be.resume(["node4"])
    assert ps.calls == [("modify", 22, {"required_nodes": "node[3-4]"}), ("notify", 22, "hi"),
                        ("requeue", 22), ("node-modify", "node4", {"state": "DRAIN", "reason": "broken fan"}),
                        ("node-modify", "node4", {"state": "RESUME"})]
    with pytest.raises(SlurmError, match="batch host"):
        be.release_nodes("22", ["node4"])
    with pytest.raises(SlurmError, match="pyslurm Job\\(15\\).requeue\\(\\) failed"):
        be.requeue("15")
    with pytest.raises(SlurmError, match="numeric"):
        be.job("12_3")


def test_pyslurm_backend_without_pyslurm():
    be = pb.PyslurmBackend()
    try:
        import pyslurm  # noqa: F401
    except ImportError:
        with pytest.raises(SlurmError, match="cannot import pyslurm"):
            be.reservations()
    else:  # pragma: no cover - only where pyslurm exists
        pytest.skip("pyslurm is installed here")


# ============================================================================ allocation

def env_file(name: str) -> dict:
    return dict(line.split("=", 1) for line in golden(name).splitlines() if "=" in line)


def test_allocation_sbatch(monkeypatch):
    env = env_file("env_sbatch.txt")
    a = allocation.from_env(env)
    assert a == allocation.Allocation(job_id=env["SLURM_JOB_ID"], nodes=("node1", "node2"),
                                      user="root", submit_dir=env["SLURM_SUBMIT_DIR"],
                                      restart_count=0, time_limit_s=None, kind="batch", submit_host="vm")
    assert a.num_nodes == 2
    a = allocation.from_env(dict(env, SLURM_RESTART_COUNT="2", SLURM_JOB_START_TIME="100",
                                 SLURM_JOB_END_TIME="700"))
    assert (a.restart_count, a.time_limit_s) == (2, 600.0)


def test_allocation_salloc(monkeypatch):
    env = env_file("env_salloc.txt")
    assert "SLURMD_NODENAME" not in env and "SLURM_JOB_USER" not in env
    a = allocation.from_env(dict(env, USER="alice"))
    assert (a.kind, a.nodes, a.user, a.submit_host) == ("salloc", ("node1", "node2"), "alice", "vm")


def test_allocation_step_legacy_and_none():
    a = allocation.from_env({"SLURM_JOBID": "9", "SLURM_NODELIST": "gpu[01-02]", "SLURM_STEP_ID": "0",
                             "SLURMD_NODENAME": "gpu02", "SLURM_JOB_USER": "u", "SLURM_SUBMIT_DIR": "/w"})
    assert (a.job_id, a.nodes, a.kind) == ("9", ("gpu01", "gpu02"), "step")
    assert allocation.from_env({}) is None
    assert allocation.from_env({"SLURM_NODELIST": "n1"}) is None
    with pytest.raises(allocation.AllocationError, match="empty"):
        allocation.from_env({"SLURM_JOB_ID": "3"})
    with pytest.raises(allocation.AllocationError, match="descending"):
        allocation.from_env({"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "n[3-1]"})


# ============================================================================ classify

def golden_states(name="sinfo_drain_reboot.json"):
    return cb.parse_sinfo_json(golden(name))


def golden_resv():
    return cb.parse_scontrol_reservations(golden("scontrol_res_two_epoch.txt"))


def st(name, state, reason="", reason_time=None):
    base, flags = backend.split_state(state)
    return NodeState(name, base, flags, reason, reason_time)


def test_classify_golden_drain_and_reboot():
    evs = cl.classify(golden_states(), [], ["node3", "node4", "node5"], GOLDEN_NOW, 600)
    assert evs == [cl.NodeEvent("node4", "planned", "drain", "tm golden drain", GOLDEN_NOW),
                   cl.NodeEvent("node5", "planned", "reboot", "tm golden reboot", GOLDEN_NOW)]
    # nodes outside the job are not our business
    assert cl.classify(golden_states(), [], ["node1", "node2", "node3"], GOLDEN_NOW, 600) == []


def test_classify_golden_fail_maintenance_idle_drain():
    states = golden_states("sinfo_idle_drain_fail_maint.json")
    resv = golden_resv()
    evs = cl.classify(states, resv, ["node2", "node3", "node4", "node5"], GOLDEN_NOW + 2, 600)
    assert [(e.node, e.kind, e.cause) for e in evs] == [
        ("node2", "planned", "drain"), ("node3", "planned", "maintenance"), ("node5", "planned", "fail")]
    assert evs[1].since == resv[1].start and "tm_golden_active" in evs[1].reason


def test_classify_maint_reservation_horizon():
    states = {"node5": st("node5", "MIXED"), "node4": st("node4", "MIXED")}
    (r,) = cb.parse_scontrol_reservations(golden("scontrol_res_maint_epoch.txt"))    # starts +300 s
    evs = cl.classify(states, [r], ["node4", "node5"], GOLDEN_NOW, 600)
    assert evs == [cl.NodeEvent("node5", "planned", "maintenance",
                                "maintenance reservation tm_golden_maint starts in 300 s", r.start)]
    assert cl.classify(states, [r], ["node5"], GOLDEN_NOW, 299) == []          # beyond the horizon
    assert cl.classify(states, [r], ["node5"], GOLDEN_NOW, 300)[0].cause == "maintenance"
    assert cl.classify(states, [r], ["node5"], r.start + 10, 0)[0].reason.endswith("started")
    assert cl.classify(states, [r], ["node5"], r.end, 600) == []                # over
    plain = Reservation("plain", ("node5",), GOLDEN_NOW, GOLDEN_NOW + 10, frozenset({"IGNORE_JOBS"}))
    assert cl.classify(states, [plain], ["node5"], GOLDEN_NOW, 600) == []       # not MAINT


def test_classify_unplanned_wins():
    states = {"a": st("a", "DOWN+NOT_RESPONDING", "Not responding", 5.0),
              "b": st("b", "MIXED+NOT_RESPONDING"),
              "c": st("c", "DOWN+DRAIN+REBOOT_ISSUED", "reboot", 6.0),
              "d": st("d", "MIXED+DRAIN+NOT_RESPONDING", "maint"),
              "e": st("e", "DOWN")}
    maint = Reservation("m", ("a", "b", "c", "d", "e"), 0.0, 1e12, frozenset({"MAINT"}))
    evs = cl.classify(states, [maint], list("abcde"), 100.0, 600)
    assert [(e.node, e.kind, e.cause) for e in evs] == [
        ("a", "unplanned", "down"), ("b", "unplanned", "not_responding"), ("c", "unplanned", "down"),
        ("d", "unplanned", "not_responding"), ("e", "unplanned", "down")]
    assert evs[0].since == 5.0 and evs[0].reason == "Not responding"
    assert evs[4].reason == "node is DOWN"


def test_classify_planned_precedence_and_non_events():
    states = {"f": st("f", "MIXED+FAIL+DRAIN"), "r": st("r", "MIXED+DRAIN+REBOOT_REQUESTED"),
              "r2": st("r2", "MIXED+REBOOT_REQUESTED"), "p": st("p", "MIXED+POWER_DOWN"),
              "m": st("m", "MIXED+MAINTENANCE+RESERVED"), "x": st("x", "MIXED+RESERVED"),
              "y": st("y", "IDLE+PLANNED"), "z": st("z", "ALLOCATED+COMPLETING"), "i": st("i", "IDLE")}
    job = ["f", "r", "r2", "p", "m", "x", "y", "z", "i", "gone", "f"]
    evs = cl.classify(states, [], job, 0.0, 600)
    assert [(e.node, e.cause) for e in evs] == [("f", "fail"), ("r", "reboot"), ("r2", "reboot"),
                                                ("p", "drain"), ("m", "maintenance")]
    assert all(e.planned for e in evs)


def test_event_debouncer():
    d = cl.EventDebouncer(confirm_s=2.0)
    nr = cl.NodeEvent("n1", "unplanned", "not_responding", "", None)
    drain = cl.NodeEvent("n2", "planned", "drain", "", None)
    assert d.filter([nr, drain], 10.0) == [drain]
    assert d.filter([nr], 11.0) == []
    assert d.filter([nr], 12.0) == [nr]
    assert d.filter([], 12.5) == []            # the resume blip is over: forget it
    assert d.filter([nr], 13.0) == []
    down = cl.NodeEvent("n1", "unplanned", "down", "", None)
    assert d.filter([down], 13.1) == [down]


# ============================================================================ controller address

def route(name: str) -> address.Route:
    return address.parse_route(golden(name))


def test_parse_route_golden():
    assert route("ip_route_submit_to_node1.txt") == address.Route("10.198.0.11", "tmslurm-br", "10.198.0.1", False)
    assert route("ip_route_node1_to_node1.txt") == address.Route("10.198.0.11", "lo", "10.198.0.11", True)
    assert route("ip_route_node1_to_node2.txt") == address.Route("10.198.0.12", "eth0", "10.198.0.11", False)
    assert address.parse_route("") is None
    assert address.parse_route("unreachable 10.0.0.9") is None


def test_address_under_salloc_batch_and_a_step():
    # salloc on the submit host (and sbatch's batch host alike): the route to the first node
    s = address.choose("", "", [("node1", route("ip_route_submit_to_node1.txt"))])
    assert (s.address, s.how, s.node) == ("10.198.0.1", "route", "node1")
    # on node1 (`srun -w node1 tm-slurm run`, `srun --pty bash`): node1 is this host, node2 decides
    s = address.choose("", "", [("node1", route("ip_route_node1_to_node1.txt")),
                                ("node2", route("ip_route_node1_to_node2.txt"))])
    assert (s.address, s.how, s.node) == ("10.198.0.11", "route", "node2")
    assert "via eth0" in s.detail
    # a one-node allocation: only this host
    s = address.choose("", "", [("node1", route("ip_route_node1_to_node1.txt"))])
    assert (s.address, s.how, s.node) == ("10.198.0.11", "local", "node1")
    # a node without a route is skipped
    s = address.choose("", "", [("node9", None), ("node1", route("ip_route_submit_to_node1.txt"))])
    assert s.node == "node1"


def test_address_overrides_and_no_route():
    looked = []

    def lazy():
        for n in ("node1", "node2"):
            looked.append(n)
            yield n, route("ip_route_submit_to_node1.txt")
    s = address.choose("192.0.2.7", "10.0.0.1", lazy())
    assert (s.address, s.how, s.node, looked) == ("192.0.2.7", "--controller-address", "node1", ["node1"])
    s = address.choose("", "10.0.0.1", [("node1", None)])
    assert (s.address, s.how) == ("10.0.0.1", "comm.interface")
    with pytest.raises(address.AddressError, match="--controller-address"):
        address.choose("", "", [("node1", None), ("node2", None)])


def test_address_routes_use_slurms_node_addr():
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        out = golden("scontrol_node_idle_drain_fail_maint.txt").splitlines()[0] if argv[0] == "scontrol" \
            else golden("ip_route_submit_to_node1.txt")
        return subprocess.CompletedProcess(argv, 0, out, "")
    # the submit host need not resolve node names: Slurm's NodeAddr
    assert address.node_address("node1.invalid", run=run) == "10.199.0.11"
    assert calls[-1] == ["scontrol", "show", "node", "-o", "node1.invalid"]
    (node, r), = list(address.routes(["node1"], run=run, address_of=lambda n: "10.198.0.11"))
    assert (node, r.src) == ("node1", "10.198.0.1") and calls[-1][:4] == ["ip", "-o", "route", "get"]


def test_address_must_be_this_hosts():
    address.check_local("127.0.0.1")
    with pytest.raises(address.AddressError, match="cannot serve from 192.0.2.7"):
        address.check_local("192.0.2.7")
