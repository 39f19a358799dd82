import json

import pytest

from tm_slurm.events import EventLog, read
from tm_slurm.roles import JobState, JobStatus, NodeTable, Role, TransitionError


def test_node_transitions_are_checked_and_logged_once(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", "j1")
    nt = NodeTable(log)
    nt.add("a", Role.ACTIVE, slot=0)
    nt.add("s", Role.STANDBY)
    nt.set_role("a", Role.LEAVING, reason="drain")
    nt.set_role("s", Role.JOINING, slot=0)
    nt.set_role("s", Role.ACTIVE)
    nt.set_role("a", Role.RELEASED)
    with pytest.raises(TransitionError):
        nt.set_role("a", Role.ACTIVE)
    with pytest.raises(TransitionError):
        nt.add("a", Role.STANDBY)
    assert nt.nodes["s"].slot == 0 and nt.nodes["a"].slot is None
    recs = list(read(tmp_path / "events.jsonl"))
    assert [(r["node"], r.get("prev"), r["role"]) for r in recs] == [
        ("a", None, "ACTIVE"), ("s", None, "STANDBY"), ("a", "ACTIVE", "LEAVING"),
        ("s", "STANDBY", "JOINING"), ("s", "JOINING", "ACTIVE"), ("a", "LEAVING", "RELEASED")]
    for r in recs:
        assert {"ts", "job", "gen", "node", "rank", "step", "kind"} <= set(r) and r["job"] == "j1"


def test_job_states(tmp_path):
    js = JobStatus(EventLog(tmp_path / "e.jsonl", "j"))
    for s in (JobState.RUNNING, JobState.SWAPPING, JobState.RUNNING, JobState.RECOVERING,
              JobState.RUNNING, JobState.STOPPING, JobState.FINISHED):
        js.set(s)
    with pytest.raises(TransitionError):
        js.set(JobState.RUNNING)


def test_torn_last_line_is_skipped(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text(json.dumps({"kind": "a"}) + "\n" + '{"kind": "b", "ts": 1')
    assert [r["kind"] for r in read(p)] == ["a"]
