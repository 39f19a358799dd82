"""The commit vote on the job's real store (tm_slurm/store/), with real threads as voters."""
import json
import random
import threading

import pytest

from tm_slurm.comm import vote as V


@pytest.fixture
def store(served):
    yield served.client()


def client(m):
    return m.clone()


def vote_all(m, world, gen, step, oks, stores=None):
    out, stores = [None] * world, stores or [client(m) for _ in range(world)]   # connected before the race
    ths = [threading.Thread(target=lambda i=i: out.__setitem__(i, V.vote(stores[i], gen, step, world, oks[i], 5.0, i)))
           for i in range(world)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(10)
    return out


def test_all_ok_commits_everywhere(store):
    got = vote_all(store, 4, 0, 0, [True] * 4)
    assert all(d.commit and d.switch is None for d in got)


def test_one_failure_aborts_everywhere(store):
    got = vote_all(store, 4, 0, 3, [True, True, False, True])
    assert all(not d.commit for d in got)


def test_pending_switch_is_taken_at_one_boundary(store):
    V.set_pending(store, 2, plan_id=9, gen_to=3)
    got = vote_all(store, 3, 2, 11, [True] * 3)
    assert all(d.commit and d.switch == 9 and d.gen_to == 3 for d in got)
    assert store.get(V.switch_key(9)) == b"11"


def test_pending_checkpoint_is_consumed_once(store):
    V.set_pending(store, 0, checkpoint="time limit", exit=True)
    first = vote_all(store, 2, 0, 5, [True, True])
    second = vote_all(store, 2, 0, 6, [True, True])
    assert all(d.checkpoint == "time limit" and d.exit for d in first)
    assert all(d.commit and d.checkpoint is None for d in second)


def test_controller_abort_lands_on_the_in_flight_step(store):
    vote_all(store, 2, 0, 0, [True, True])
    vote_all(store, 2, 0, 1, [True, True])
    assert V.abort_in_flight(store, 0, 0, 3, "node failed") == (0, 2)
    # a rank arriving late at step 2 sees the abort
    assert not V.vote(client(store), 0, 2, 2, True, 5.0, 0).commit


def test_abort_follows_a_committed_switch(store):
    V.set_pending(store, 0, plan_id=1, gen_to=5)
    vote_all(store, 2, 0, 0, [True, True])
    assert V.abort_in_flight(store, 0, 0, 1, "x") == (5, 1)


def test_abort_reaches_a_new_generation_whose_first_step_is_not_the_lower_bound(store):
    # generation 3 started at step 40 (a switch); the controller only knows "about step 39"
    assert V.abort_in_flight(store, 3, 39, 41, "joiner died") == (3, 39)
    assert not V.vote(client(store), 3, 40, 2, True, 5.0, 0).commit


def test_missing_voter_times_out_into_abort(store):
    d = V.vote(client(store), 0, 0, 2, True, 0.3, 0)
    assert not d.commit and "no decision" in d.why


def test_peek_reads_without_waiting_or_creating(store):
    c = client(store)
    assert c.peek("k") is None and not c.check(["k"])
    c.set("k", "v")
    assert c.peek("k") == b"v"


def test_the_votes_of_a_step_are_one_key_of_sealed_pieces(store):
    assert all(d.commit for d in vote_all(store, 3, 0, 0, [True] * 3))
    assert sorted(V.voters(store, 0, 0)) == [0, 1, 2] and store.add(V.nkey(0, 0), 0) == 3
    V.forget(store, 0, 0)
    assert not store.check([V.vkey(0, 0)]) and not store.check([V.nkey(0, 0)]) and not store.check([V.dkey(0, 0)])
    for step in (1, 2, 3):
        vote_all(store, 3, 0, step, [True] * 3)
    V.forget(store, 0, 1, count=2)                  # steps 1 and 2, in one round trip
    assert [store.check([V.dkey(0, s)]) for s in (1, 2, 3)] == [False, False, True]


def test_abort_walks_past_steps_the_controller_has_not_heard_of(store):
    # the ranks committed steps 0..6; the heartbeats that say so have not arrived yet
    for step in range(7):
        vote_all(store, 2, 0, step, [True, True])
    assert V.abort_in_flight(store, 0, 2, 3, "node failed") == (0, 7)
    assert not V.vote(client(store), 0, 7, 2, True, 5.0, 0).commit


def test_a_switch_taken_back_before_its_boundary_is_not_carried(store):
    V.set_pending(store, 2, plan_id=9, gen_to=3)
    assert V.take_back(store, 2, 9, "swap cancelled") is None
    got = vote_all(store, 3, 2, 11, [True] * 3)
    assert all(d.commit and d.switch is None for d in got) and not store.check([V.switch_key(9)])


def test_taking_back_a_claimed_switch_settles_on_the_claimed_steps_decision(store):
    V.set_pending(store, 2, plan_id=9, gen_to=3)          # claimed and committed: it stands
    vote_all(store, 3, 2, 11, [True] * 3)
    assert V.take_back(store, 2, 9, "swap cancelled") == 11
    # claimed, the decision not written yet (the decider is between its two writes): the step
    # is aborted, and the decider's commit loses to it everywhere
    V.set_pending(store, 4, plan_id=10, gen_to=5)
    pk = V.pending_key(4)
    raw = store.peek(pk)
    store.compare_set(pk, raw, json.dumps({**json.loads(raw), "at": 20}))
    assert V.take_back(store, 4, 10, "swap cancelled") is None
    assert all(not d.commit for d in vote_all(store, 3, 4, 20, [True] * 3))


def test_a_switch_taken_back_while_a_step_is_decided_is_carried_everywhere_or_nowhere(store):
    """The controller's cancel races the vote of the boundary (real threads, real store): the
    ranks switch exactly when take_back says the switch stands."""
    rng, seen = random.Random(7), set()
    ctl, voters = client(store), [client(store) for _ in range(3)]
    for gen in range(40):
        V.set_pending(store, gen, plan_id=gen, gen_to=gen + 1000)
        out = []
        t = threading.Timer(rng.uniform(0, 0.006),
                            lambda: out.append(V.take_back(ctl, gen, gen, "swap cancelled")))
        t.start()
        got = vote_all(store, 3, gen, 0, [True] * 3, voters)
        t.join()
        assert len(set(got)) == 1, got
        stands = out[0] == 0
        assert all(d.switch == (gen if stands else None) for d in got), (out, got)
        assert stands or out[0] is None
        seen.add((stands, got[0].commit))
    assert (True, True) in seen and (False, True) in seen    # both outcomes happened


def test_a_large_job_reads_the_votes_only_where_the_count_is_the_last(store, monkeypatch):
    """Past SPECULATE_NODES voters nobody reads the votes with its own (the decider reads them
    after its count, in one batch with the pending switch): the same decisions."""
    monkeypatch.setattr(V, "SPECULATE_NODES", 2)
    V.set_pending(store, 0, plan_id=4, gen_to=1)
    got = vote_all(store, 3, 0, 0, [True] * 3)
    assert all(d.commit and d.switch == 4 for d in got)
    assert all(not d.commit for d in vote_all(store, 3, 1, 0, [True, False, True]))


def test_a_store_without_batches_votes_a_call_at_a_time():
    """torch's TCPStore (no `pipeline`): the vote and the controller's clean-up still work."""
    from datetime import timedelta

    import torch.distributed as dist
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))

    class Votes:     # TCPStore has append and compare_set; the vote's peek and wait_get on top
        def __init__(self, s):
            self.s = s

        def __getattr__(self, name):
            return getattr(self.s, name)

        def peek(self, key):
            return self.s.get(key) if self.s.check([key]) else None

        def wait_get(self, key, timeout_s):
            self.s.wait([key], timedelta(seconds=timeout_s))
            return self.s.get(key)

    s = Votes(tcp)
    assert not hasattr(s.s, "pipeline")
    got = [None, None]
    t = threading.Thread(target=lambda: got.__setitem__(0, V.vote(s, 0, 0, 2, True, 5.0, 0)))
    t.start()
    got[1] = V.vote(Votes(dist.TCPStore("127.0.0.1", tcp.port, is_master=False, timeout=timedelta(seconds=5))),
                    0, 0, 2, True, 5.0, 1)
    t.join(10)
    assert all(d.commit for d in got)
    V.forget(s, 0, 0)
    assert not tcp.check([V.vkey(0, 0)]) and not tcp.check([V.dkey(0, 0)])
