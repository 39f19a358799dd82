"""The job's store (tm_slurm/store/): torch's Store semantics, and nothing for whoever lacks the
key. A real server process and real sockets; the caps on a server in this process."""
from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tm_slurm.store import server as S
from tm_slurm.store import wire
from tm_slurm.store.client import StoreClient

from .jobs import rss_mb
from .stores import KEY


def _ops(s) -> list:
    """The same calls on TCPStore and on ours give the same answers."""
    out = [s.compare_set("k", "", "a"), s.compare_set("k", "", "b"), s.compare_set("k", "a", "c"),
           s.compare_set("absent", "x", "y"), s.check(["absent"]), s.add("n", 3), s.add("n", -1), s.get("n")]
    s.set("v", b"\x00\xff")
    s.append("ap", b"ab")
    s.append("ap", b"cd")
    out += [s.get("v"), s.get("ap"), s.multi_get(["k", "v"]), s.check(["k", "v"]), s.delete_key("k"),
            s.delete_key("k"), s.check(["k"])]
    with pytest.raises(dist.DistStoreError):
        s.wait(["never"], timedelta(seconds=0.3))
    return out


def test_it_answers_as_torchs_tcpstore_does(served):
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    ours = served.client()
    assert _ops(ours) == _ops(tcp)
    assert ours.peek("v") == b"\x00\xff" and ours.peek("nothing") is None
    assert ours.pieces("ap", 2) == [b"ab", b"cd"] and ours.pieces("nothing", 4) == []
    with pytest.raises(ValueError):
        ours.pieces("ap", 3)


def test_a_wait_parks_its_connection_not_the_server(served):
    waiter, other = served.client(), served.client()
    got = {}
    t = threading.Thread(target=lambda: got.update(v=waiter.wait_get("later", 10.0)))
    t.start()
    t0 = time.monotonic()
    for i in range(200):
        other.add("busy", 1)                       # answered while the other connection waits
    busy_s = time.monotonic() - t0
    other.set("later", "here")
    t.join(10)
    assert got == {"v": b"here"} and busy_s < 5


def test_a_client_without_the_key_gets_nothing_and_a_clear_error(served):
    served.client().set("secret/thing", "x")
    with pytest.raises(dist.DistStoreError, match="cannot reach the job's store"):
        StoreClient("127.0.0.1", served.port, b"w" * 32, 1.0)
    # raw bytes: the greeting, then nothing more for a wrong proof, whatever follows it
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as s:
        hello = _read(s, wire.HELLO)
        assert hello.startswith(wire.MAGIC)
        s.sendall(os.urandom(wire.PROOF) + wire.pack(wire.GET, b"secret/thing", b"-1") * 10)
        assert _read_all(s) == b""                    # closed, unanswered
    # a client that holds the key but not this server's: it is told that, not served
    with S.Server(b"o" * 32, "127.0.0.1") as other:
        done = threading.Event()
        t = threading.Thread(target=other.serve_until, args=(done.is_set,), daemon=True)
        t.start()
        with pytest.raises(dist.DistStoreError, match="cannot reach"):
            StoreClient("127.0.0.1", other.port, KEY, 0.5)
        done.set()
        t.join(5)


def test_strangers_connections_are_dropped_and_cannot_crowd_out_the_job(served):
    """Thousands of idle connections, and some that send a few bytes: each is dropped within
    about AUTH_S, the oldest go first when too many wait, and a real client still gets in at
    once and is answered at once."""
    job = served.client()
    idle = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(2000)]
    chatty = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(50)]
    for s in chatty:
        s.sendall(b"hi")
    t0 = time.monotonic()
    late = StoreClient("127.0.0.1", served.port, KEY, 10.0)
    late.set("a", "1")
    assert job.get("a") == b"1"
    assert time.monotonic() - t0 < 5
    time.sleep(S.AUTH_S + 1.0)
    open_ = sum(_still_open(s) for s in idle + chatty)
    assert open_ == 0, f"{open_} strangers' connections still open after {S.AUTH_S + 1:.0f} s"
    for s in idle + chatty:
        s.close()
    assert rss_mb(served.spawned.proc.pid) < 100
    late.close()


def test_values_and_the_whole_store_are_capped(monkeypatch):
    monkeypatch.setattr(S, "MAX_TOTAL", 64 << 10)
    with S.Server(KEY, "127.0.0.1") as srv:
        done = threading.Event()
        t = threading.Thread(target=srv.serve_until, args=(done.is_set,), daemon=True)
        t.start()
        c = StoreClient("127.0.0.1", srv.port, KEY, 5.0)
        with pytest.raises(dist.DistStoreError, match="cap"):
            c.set("big", b"x" * (wire.MAX_VALUE + 1))
        for i in range(7):
            c.set(f"k{i}", b"x" * (8 << 10))
        with pytest.raises(dist.DistStoreError, match="full"):
            c.set("one-more", b"x" * (16 << 10))
        c.delete_key("k0")
        c.set("one-more", b"x" * (8 << 10))         # room again once a key is gone
        assert srv.size <= S.MAX_TOTAL
        c.close()
        done.set()
        t.join(5)


def test_a_tampered_frame_ends_only_its_own_connection(served):
    a, b = served.client(), served.client()
    a.set("x", "1")
    body = wire.pack(wire.SET, b"x", b"forged")
    a._sock.sendall((wire.MAC + len(body)).to_bytes(4, "big") + b"\0" * wire.MAC + body)   # no valid MAC
    with pytest.raises(dist.DistStoreError):
        a.get("x")
    assert b.get("x") == b"1"


def test_the_server_ends_with_its_parent_pipe(served):
    proc = served.spawned.proc
    served.spawned.close()
    assert proc.returncode == 0


def _read(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def _read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(4096):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def _still_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        while True:
            if not s.recv(4096):
                return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def test_a_pipeline_is_its_calls_in_order_in_one_round_trip(served):
    c, other = served.client(), served.client()
    got = c.pipeline(("set", "a", b"1"), ("append", "v", b"ab"), ("append", "v", b"cd"), ("add", "n", 2),
                     ("peek", "v"), ("peek", "absent"), ("cas", "a", b"1", b"2"), ("delete", "a"),
                     ("delete", "a"))
    assert got == [None, None, None, 2, b"abcd", None, b"2", True, False]
    t = threading.Timer(0.2, lambda: other.set("later", "here"))
    t.start()
    assert c.pipeline(("add", "n", 1), ("wait_get", "later", 5.0)) == [3, b"here"]
    t.join()
    with pytest.raises(ValueError):          # a wait holds what follows it on the link
        c.pipeline(("wait_get", "x", 1.0), ("add", "n", 1))
    # a refused call raises once every answer is read: the link stays in step
    with pytest.raises(dist.DistStoreError, match="refused"):
        c.pipeline(("add", "n", 1), ("set", "k" * (wire.MAX_KEY + 1), b"x"), ("add", "n", 1))
    assert c.add("n", 0) == 5 and c.peek("v") == b"abcd"
