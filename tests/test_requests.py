"""The request inbox reads hostile files (controller/requests.py): nothing in one ends, stalls or
floods the controller, and a refused file is moved aside with a reason."""
from __future__ import annotations

import json
import os

import pytest

from tm_slurm import jobdir
from tm_slurm.controller import requests as rq


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def inbox(tmp_path):
    clock = Clock()
    box = rq.Inbox(tmp_path / "job", {os.getuid()}, clock=clock)
    box.clock_ = clock
    return box


def _drop(box, name: str, body) -> None:
    p = box.dir / name
    p.write_bytes(body if isinstance(body, bytes) else json.dumps(body).encode())


def test_a_good_request_is_read_and_removed(inbox):
    rq.submit(inbox.dir.parents[1], "checkpoint", None, "before maintenance", exit=True)
    ok, refused = inbox.poll()
    assert refused == [] and [(r.verb, r.reason, r.extra) for r in ok] == [
        ("checkpoint", "before maintenance", {"exit": True})]
    assert os.listdir(inbox.dir) == []


BAD = {
    "byte.json": (b"\xff", "not JSON"),
    "deep.json": (b"[" * 4000, "not JSON"),            # RecursionError in the parser
    "list.json": ([1], "not a JSON object but list"),
    "t.json": ({"verb": "drain", "node": "node2", "t": "x"}, "'t' is str"),
    "node.json": ({"verb": "drain", "node": [1]}, "'node' is list"),
    "uid.json": ({"verb": "drain", "node": "node2", "uid": 0}, "unknown keys ['uid']; valid: verb"),
    "verb.json": ({"verb": "rm -rf"}, "unknown verb 'rm -rf'; valid: drain"),
    "nonode.json": ({"verb": "drain"}, "drain needs a node"),
    "bool.json": ({"verb": "drain", "node": "node2", "t": True}, "'t' is bool"),
    "nan.json": (b'{"verb": "stop", "t": NaN}', "not a finite number"),
    "big.json": (b" " * (rq.MAX_BYTES + 1), f"more than {rq.MAX_BYTES}"),
}


def test_every_bad_file_is_refused_with_its_reason_and_moved_aside(inbox, monkeypatch):
    monkeypatch.setattr(rq, "QUIET_S", 0.0)                          # every refusal gets its line
    for name, (body, _) in BAD.items():
        _drop(inbox, name, body)
    os.mkfifo(inbox.dir / "fifo.json")                              # would block a plain read
    target = inbox.dir.parents[1] / "elsewhere"
    target.write_text(json.dumps({"verb": "stop"}))
    os.symlink(target, inbox.dir / "link.json")                    # would be read through
    (inbox.dir / "dir.json").mkdir()
    ok, refused = inbox.poll()
    assert ok == []
    seen = {r.file: r.why for r in refused}
    for name, (_, why) in BAD.items():
        assert why in seen[name], (name, seen[name])
    assert "not a regular file" in seen["fifo.json"] and "not a regular file" in seen["dir.json"]
    assert "without following a link" in seen["link.json"]
    assert os.listdir(inbox.dir) == []
    assert len(os.listdir(inbox.aside)) == len(BAD) + 3 and target.exists()


def test_a_flood_is_bounded_per_tick_and_summed_up_per_uid(inbox):
    for i in range(100):
        _drop(inbox, f"{i:03d}.json", b"junk")
    ok, first = inbox.poll()
    assert ok == [] and len(first) == 1 and first[0].count == 1      # one line, then quiet
    assert len(os.listdir(inbox.dir)) == 100 - rq.PER_POLL
    while os.listdir(inbox.dir):
        assert inbox.poll()[1] == []
    inbox.clock_.t += rq.QUIET_S
    _, summary = inbox.poll()
    assert [(r.uid, r.count) for r in summary] == [(os.getuid(), 99)]
    assert len(os.listdir(inbox.aside)) == rq.KEEP_REFUSED


def test_a_file_of_another_user_is_refused_unread(tmp_path):
    box = rq.Inbox(tmp_path / "job", {os.getuid() + 1})
    rq.submit(tmp_path / "job", "stop")
    ok, refused = box.poll()
    assert ok == [] and "not the job owner" in refused[0].why and refused[0].uid == os.getuid()


def test_the_refused_directory_is_private(inbox):
    assert oct(os.stat(jobdir.refused_dir(inbox.dir.parents[1])).st_mode & 0o777) == "0o700"
