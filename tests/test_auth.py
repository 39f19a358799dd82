"""The authenticated, pickle-free control plane: codec, sealed frames, the vote's distrust of the
count, and admission of agents (no processes but the job's store; its protocol: test_store.py)."""
from __future__ import annotations

import pickle
import threading

import pytest

from tm_slurm import config as cfgmod
from tm_slurm.comm import vote as V
from tm_slurm.control import codec
from tm_slurm.control.auth import MAC_BYTES, AuthError, Keys, Sealer, mac
from tm_slurm.controller.admission import Admission
from tm_slurm.messages import (Announce, Challenge, GroupBuild, Heartbeat, Hello, Launch, Move, Ping, StandbyReady,
                               SwapPlan, ToWorkers, Transfer, WorkerInfo, WorkerReport)

KEYS = Keys.derive(b"k" * 32)


def _plan() -> SwapPlan:
    return SwapPlan(3, "planned", 1, 2, (Move(1, "node2", "node5"),), (2, 3),
                    (GroupBuild("dp0", (0, 2), "g2/dp0"),), ("pp0",), (Transfer(2, 2, "x/2"),), reason="drain")


def test_codec_round_trips_every_shape_the_control_plane_sends():
    launch = Launch("j", 0, "ACTIVE", 1, (2, 3), 1, ("python", "x.py"), "/w", (("A", "1"),),
                    cfgmod.to_dict(cfgmod.Config()), ("127.0.0.1", 29500), (GroupBuild("a", (0, 1), "p"),))
    hb = Heartbeat("node1", 7, 1.5, (WorkerInfo(0, 11, 2, 5, 4, True),), True, (0, 5, 4),
                   (2, 4, 0.05, 0.1, float("nan"), 1e9, False, 0.0))
    rep = StandbyReady(2, None, None, warm=True, sandbox={"roles": ["first", "last"], "per": {1: (2, 3)}, "none": None})
    for msg in (launch, hb, WorkerReport("node1", 0, rep), ToWorkers(_plan()), Challenge("n"), Announce("node1", 5)):
        # the wire's positional form, and the named one of files
        for back in (codec.loads(codec.prepare(msg).encode()), codec.loads(codec.dumps(msg))):
            assert type(back) is type(msg)
            assert repr(back) == repr(msg)      # nan != nan: compare the printed form
    assert codec.loads(codec.dumps(launch)).config == cfgmod.to_dict(cfgmod.Config())


@pytest.mark.parametrize("raw,why", [
    (b'{"#m":"Popen","a":[]}', "unknown message type"),
    (b'{"#m":"Challenge","a":["a",0]}', "2 fields, not 1..1"),
    (b'{"#m":"Challenge","a":[]}', "0 fields, not 1..1"),
    (b'{"#m":"Popen","f":{}}', "unknown message type"),
    (b'{"#m":"Challenge","f":{"nonce":"a","uid":0}}', "unknown fields"),
    (b'{"#m":"Challenge","f":{}}', "missing fields"),
    (b'{"#m":"Challenge","x":[]}', "unknown tags"),
    (b'{"#x":1}', "unknown tags"),
    (b'{"#d":[[[1],2]]}', "mapping key"),
    (b"[" * 100000, "not JSON"),
    (b"\xff", "not JSON"),
])
def test_codec_builds_only_known_messages(raw, why):
    with pytest.raises(codec.DecodeError, match=why):
        codec.loads(raw)


def test_codec_refuses_to_send_what_it_could_not_rebuild():
    with pytest.raises(TypeError):
        codec.dumps(StandbyReady(0, 0, 0, warm=True, sandbox={"s": {1, 2}}))


def test_a_frame_opens_only_with_the_secret_for_the_expected_sender_once():
    a = Sealer(KEYS, "job1", "node1")
    b = Sealer(KEYS, "job1", "controller", peer="node1")
    f1, f2 = a.seal(Challenge("1")), a.seal(Challenge("2"))
    assert b.open(f1) == Challenge("1")
    with pytest.raises(AuthError, match="replayed"):
        b.open(f1)
    assert b.open(f2) == Challenge("2")
    with pytest.raises(AuthError, match="bad MAC"):
        Sealer(Keys.derive(b"x" * 32), "job1", "c").open(a.seal(Challenge("3")))
    with pytest.raises(AuthError, match="job"):
        Sealer(KEYS, "job2", "c").open(a.seal(Challenge("4")))
    with pytest.raises(AuthError, match="expected 'node1'"):
        b.open(Sealer(KEYS, "job1", "node9").seal(Challenge("5")))
    evil = pickle.dumps(Challenge("6"))
    for frame in (evil, b"\0" * MAC_BYTES + evil, b"", mac(KEYS.frame, b"[") + b"["):
        with pytest.raises(AuthError):
            b.open(frame)


def test_a_count_without_every_nodes_vote_commits_nothing(served):
    """The count only says who checks: a count that reaches the world (a voter counted twice,
    say) with a node's vote missing aborts the step for everyone."""
    served.client().add(V.nkey(0, 5), 2)                    # "two ranks voted"
    got = [None, None]
    first = V.vote(served.client(), 0, 5, 3, True, 0.5, 0)  # the count says 3 = world
    assert not first.commit and "every node's vote" in first.why

    stores = [served.client(), served.client()]            # connected before the votes race

    def late(i):
        got[i] = V.vote(stores[i], 0, 5, 3, True, 1.0, i + 1)
    ths = [threading.Thread(target=late, args=(i,)) for i in (0, 1)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(5)
    assert got[0] == got[1] == first                          # one decision for everyone: abort


# ------------------------------------------------------------------------ admission

class FakeChannel:
    def __init__(self, frames=()):
        self.inbox = frames if callable(frames) else list(frames)
        self.sent, self.sealer, self.refused, self.refused_why, self.dead = [], None, 0, "", False

    def send(self, msg):
        self.sent.append(msg)

    def poll(self):
        out = []
        frames = self.inbox(self) if callable(self.inbox) else self.inbox
        for f in frames:
            try:
                out.append(self.sealer.open(f))
            except ValueError as e:
                self.refused, self.refused_why = self.refused + 1, str(e)
        if not callable(self.inbox):
            self.inbox = []
        return out

    def abandon(self):
        self.dead = True


class FakePort:
    def __init__(self, links):
        self.links = list(links)

    def accept(self):
        return self.links.pop(0), False


def _agent_answer(node):
    """A real agent: answers the challenge it was sent with a sealed Hello."""
    def frames(ch):
        if not ch.sent:
            return []
        return [Sealer(KEYS, "job", node, peer="controller").seal(
            Hello(node, "h", 1, 1, nonce=ch.sent[0].nonce))]
    return frames


def _admission(tmp_path, links, now):
    log = []
    join = tmp_path / "join"
    join.mkdir()
    adm = Admission(FakePort(links), KEYS, "job", join, 5.0, lambda kind, **kw: log.append((kind, kw)),
                    clock=lambda: now[0])
    return adm, join, log


def test_an_impostor_that_connects_first_does_not_take_the_agents_place(tmp_path):
    now = [0.0]
    impostor = FakeChannel([pickle.dumps("boom")])
    agent = FakeChannel(_agent_answer("node1"))
    adm, join, log = _admission(tmp_path, [impostor, agent], now)
    (join / "node1").write_bytes(Sealer(KEYS, "job", "node1").seal(Announce("node1", 1)))
    (join / ".node2.123.tmp").write_bytes(b"half written")
    assert adm.poll() == []                       # impostor refused; the Accept is owed again
    assert impostor.dead and log[0][0] == "auth_refused" and adm.owed == 1
    got = adm.poll()                              # the agent's Connect, accepted now
    assert [h.node for _, h in got] == ["node1"] and not agent.dead and adm.owed == 0


def test_a_silent_link_times_out_and_an_unsealed_note_is_no_announcement(tmp_path):
    now = [0.0]
    silent, agent = FakeChannel(), FakeChannel(_agent_answer("node2"))
    adm, join, log = _admission(tmp_path, [silent, agent], now)
    (join / "forged").write_bytes(b"node9")
    assert adm.poll() == [] and adm.owed == 0 and log[0][1]["peer"] == "join/forged"
    (join / "node2").write_bytes(Sealer(KEYS, "job", "node2").seal(Announce("node2", 1)))
    assert adm.poll() == [] and len(adm.links) == 1
    now[0] = 6.0
    assert adm.poll() == [] and silent.dead
    assert [h.node for _, h in adm.poll()] == ["node2"]


def test_a_hello_that_does_not_answer_the_challenge_is_refused(tmp_path):
    now = [0.0]
    replayed = FakeChannel([Sealer(KEYS, "job", "node3").seal(Hello("node3", "h", 1, 1, nonce="old"))])
    adm, join, log = _admission(tmp_path, [replayed], now)
    (join / "node3").write_bytes(Sealer(KEYS, "job", "node3").seal(Announce("node3", 1)))
    assert adm.poll() == [] and replayed.dead and "challenge" in log[-1][1]["why"]


def test_a_broadcast_encodes_once_and_every_link_opens_it():
    enc = codec.prepare(Ping(3, 1.5))
    for peer in ("node1", "node2"):
        tx, rx = Sealer(KEYS, "job", "controller"), Sealer(KEYS, "job", peer, peer="controller")
        assert rx.open(tx.seal(enc)) == Ping(3, 1.5) == rx.open(tx.seal(Ping(3, 1.5)))


def test_frames_sent_from_two_threads_all_open_in_order():
    """A worker sends from its loop and its heartbeat thread: each frame is sealed and written as
    one, so none arrives behind a later sequence number (refused as a replay)."""
    import socket
    import sys
    import threading

    from tm_slurm.control.wire import Wire
    a, b = socket.socketpair()
    tx = Wire(a, Sealer(KEYS, "job1", "node1/w0"))
    rx = Wire(b, Sealer(KEYS, "job1", "node1", peer="node1/w0"))
    n, switch = 5000, sys.getswitchinterval()
    sys.setswitchinterval(1e-6)       # threads switch often: sealed in one order, written in the other
    threads = [threading.Thread(target=lambda t=t: [tx.send(Challenge(f"{t}-{i}")) for i in range(n)])
               for t in range(2)]
    try:
        for t in threads:
            t.start()
        got = []
        while len(got) + rx.refused < 2 * n:
            got.append(rx.recv())
    finally:
        sys.setswitchinterval(switch)
        for t in threads:
            t.join()
        a.close(), b.close()
    assert rx.refused == 0 and len(set(got)) == 2 * n
