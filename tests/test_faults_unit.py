"""Fault points (tm_slurm/faults.py): the parser, and that a bad TM_SLURM_FAULTS stops
`tm-slurm run` before anything starts."""
import os
import subprocess
import sys

import pytest

from tm_slurm import faults


def test_parse_defaults_to_kill_and_reads_every_mode():
    assert faults.parse("") == {}
    assert faults.parse(" transfer.mid@node2 , join.ready@node5=hang,standby.warm@node6=sleep2.5,"
                        "collective:12@node4=sleep600") == {
        ("transfer.mid", "node2"): ("kill", 0), ("join.ready", "node5"): ("hang", 0),
        ("standby.warm", "node6"): ("sleep2.5", 0), ("collective", "node4"): ("sleep600", 12)}


@pytest.mark.parametrize("text, says", [
    ("nowhere@node1", "unknown point 'nowhere'; valid: transfer.mid"),
    ("join.ready", "names no node"),
    ("join.ready@node1=explode", "unknown mode 'explode'"),
    ("join.ready@node1=sleep-1", "unknown mode"),
    ("join.ready@node1=sleepx", "unknown mode"),
    ("collective:x@node1=sleep1", "the step after ':' is a number"),
])
def test_parse_names_what_is_wrong_and_what_is_valid(text, says):
    with pytest.raises(ValueError) as e:
        faults.parse(text)
    assert says in str(e.value)


def test_an_unarmed_point_does_nothing(monkeypatch):
    faults._armed.cache_clear()
    monkeypatch.setenv(faults.ENV, "join.ready@node9=sleep0")
    try:
        faults.at("join.ready", "node1")          # another node
        faults.at("transfer.mid", "node9")        # another point
        faults.at("join.ready", "node9")          # fires once (sleep0) ...
        assert ("join.ready", "node9") in faults._FIRED
        faults.at("join.ready", "node9")          # ... and never again
    finally:
        faults._FIRED.clear()
        faults._armed.cache_clear()


def test_a_bad_fault_spec_stops_run_with_usage_exit(tmp_path):
    env = {**os.environ, faults.ENV: "join.ready@node1=explode"}
    p = subprocess.run([sys.executable, "-m", "tm_slurm", "run", "--local", "2+0", "--job-dir",
                        str(tmp_path / "job"), "--", sys.executable, "-c", "pass"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, p.stderr
    assert "unknown mode 'explode'" in p.stderr
    assert not (tmp_path / "job" / "events.jsonl").exists()
