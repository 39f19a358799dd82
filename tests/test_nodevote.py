"""A node's ranks vote as one (comm/nodevote.py): real gloo groups and the job's real store, the
workers as threads. The store holds one vote per node; a failure anywhere aborts everywhere."""
import threading

import pytest

from tm_slurm.comm import vote as V
from tm_slurm.comm.nodevote import NodeVote, pack, unpack


@pytest.fixture
def store(served):
    yield served.client()


def client(m):
    return m.clone()


def workers(m, nodes, per_node, timeout_s=10.0):
    """{rank: (its store client, its NodeVote)}, built the way the node's workers start: together."""
    out, ths = {}, []
    # connected one by one, before the threads: a burst of connects has outlasted a timeout here
    stores = [client(m) for _ in range(nodes * per_node)]
    for r in range(nodes * per_node):
        def make(r=r):
            c = stores[r]
            out[r] = (c, NodeVote(c, f"spawn{r // per_node}", r % per_node, per_node, timeout_s))
        ths.append(threading.Thread(target=make))
    for t in ths:
        t.start()
    for t in ths:
        t.join(20)
    return out


def vote_all(ws, step, oks, skip=()):
    world, got = len(ws), {}

    def one(r):
        c, nv = ws[r]
        got[r] = nv(c, 0, step, world, oks[r], 5.0, r)
    ths = [threading.Thread(target=one, args=(r,)) for r in ws if r not in skip]
    for t in ths:
        t.start()
    for t in ths:
        t.join(30)
    return got


def test_one_store_vote_per_node_and_a_failure_anywhere_aborts_everywhere(store):
    ws = workers(store, nodes=2, per_node=2)
    got = vote_all(ws, 0, [True] * 4)
    assert all(d.commit for d in got.values()) and len(got) == 4
    assert store.add(V.nkey(0, 0), 0) == 2                        # two nodes voted, not four ranks
    assert sorted(V.voters(store, 0, 0)) == [0, 2]                # each node's first rank
    got = vote_all(ws, 1, [True, True, True, False])             # node 1's second rank saw a failure
    assert not any(d.commit for d in got.values())
    V.set_pending(store, 0, plan_id=4, gen_to=1)
    got = vote_all(ws, 2, [True] * 4)
    assert {(d.commit, d.switch, d.gen_to) for d in got.values()} == {(True, 4, 1)}


def test_a_node_mate_that_never_votes_makes_its_node_abort(store):
    ws = workers(store, nodes=2, per_node=2, timeout_s=1.0)
    got = vote_all(ws, 0, [True] * 4, skip={3})                   # node 1's second worker hangs
    assert len(got) == 3 and not any(d.commit for d in got.values())


def test_the_decision_fits_the_broadcast():
    d = V.Decision(True, 7, 3, "time limit", True, "x" * 2000)
    back = unpack(pack(d))
    assert (back.commit, back.switch, back.gen_to, back.checkpoint, back.exit) == (True, 7, 3, "time limit", True)
    assert back.why == "x" * 200
    assert unpack(pack(V.Decision(False, why="a rank saw a failure"))) == V.Decision(False, why="a rank saw a failure")
