"""What the controller and the store hold does not grow with the number of steps (issue 14,
item 4): step records are a recent window, the committed step is kept incrementally, and the
controller deletes a step's vote keys KEYS_KEPT steps behind a commit."""
from __future__ import annotations



from tm_slurm.comm import vote as V
from tm_slurm.controller.holders import Holders
from tm_slurm.controller.progress import KEEP, CommittedMin, Progress, keep_for
from tm_slurm.controller.votekeys import PER_TICK, VoteKeys
from tm_slurm.topology import Topology
from tm_slurm.config import Layout


def rec(step):
    return (step, 0.1, 0.05, 1.0 / (step + 1), float(step), False, 0.05)


def test_step_records_are_a_window_and_the_committed_step_is_incremental():
    p = Progress(keep=50)
    for s in range(10_000):
        p.add_rows((0, *rec(s), 1, *rec(s)), 2)
    assert len(p.by_rank[0]) == 50 and p.committed(0) == 9_999 and p.min_committed([0, 1]) == 9_999
    # losses are a window of their own (result.json), as long whatever `keep` a large job has
    assert min(p.losses()) == 10_000 - KEEP and p.losses()[9_999] == rec(9_999)[3] and p.steady() is not None
    p.add_rows((0, *rec(9_990)), 2)                 # a replay after a rollback: still the top
    assert p.committed(0) == 9_999
    p.clear()
    assert p.committed(0) is None
    assert keep_for(8) == KEEP and keep_for(8192) * 8192 <= 1 << 19     # 1,024 x 8: 64 steps a rank


def _run(m, keys, gen, steps, lag=3):
    """Vote `steps` in `gen` with one voter, the controller sweeping each step with a view of
    the committed step `lag` steps old (heartbeats lag)."""
    for step in steps:
        assert V.vote(m, gen, step, 1, True, 5.0, 0).commit
        keys.sweep(step - lag)


def test_the_controller_deletes_vote_keys_and_the_store_stays_bounded(served):
    m = served.client()
    keys = VoteKeys(m, 0, 0)
    _run(m, keys, 0, range(400))
    # three keys per kept step (the votes, the count, the decision), whatever the length
    assert m.num_keys() <= 3 * (V.KEYS_KEPT + PER_TICK + 4)
    assert not m.check([V.dkey(0, 0)]) and m.check([V.dkey(0, 399)])
    # a switch after step 399: the old generation's keys go once the new one has a commit
    keys.enter(1, 400)
    _run(m, keys, 1, range(400, 420))
    assert not any(m.check([V.dkey(0, s)]) for s in range(300, 400))
    # a recovery from a checkpoint of step 200, in generation 2: the controller's picture of
    # the committed step is still the old top (419), and no key of a step the ranks are yet to
    # vote on again goes: nothing is deleted until generation 2 commits the step it names
    keys.enter(2, 200)
    for step in range(200, 300):
        assert V.vote(m, 2, step, 1, True, 5.0, 0).commit
        keys.sweep(419)
        assert m.check([V.dkey(2, step)]) and m.check([V.dkey(2, 200)])
    _run(m, keys, 2, range(300, 700))
    assert not m.check([V.dkey(2, 200)]) and not any(m.check([V.dkey(1, s)]) for s in range(400, 420))
    assert m.num_keys() <= 3 * (V.KEYS_KEPT + PER_TICK + 4)
    # a stalled job costs one look at the store, not one a tick
    ops = keys.ops
    for _ in range(50):
        keys.sweep(800)
    assert keys.ops == ops + 1


def test_progress_counts_the_ranks_that_reported_a_step():
    p = Progress(keep=2)
    rec = lambda s: (s, 0.1, 0.1, None, 1.0, False, 0.0)
    p.add_rows((0, *rec(1), 0, *rec(2)), 2)
    p.add_rows((1, *rec(1)), 2)
    p.add_rows((1, *rec(1)), 2)        # again (a rollback): still one record
    assert p.reported(1) == 2 and p.reported(2) == 1
    p.add_rows((0, *rec(3)), 2)        # step 1 of rank 0 falls out of the window
    assert p.reported(1) == 1 and p.reported(3) == 1


def test_the_committed_step_is_asked_every_tick_and_passes_over_all_ranks_once_a_step(monkeypatch):
    holders = Holders(Topology(Layout(dp=4, tp=2, ranks_per_node=2)), {i: f"n{i}" for i in range(4)})
    p = Progress()
    cm = CommittedMin(p)
    passes = []
    full = p.min_committed
    monkeypatch.setattr(p, "min_committed", lambda ranks: passes.append(1) or full(ranks))
    assert cm.get(holders) is None
    for step in range(3):
        for r in range(8):
            p.add_rows((r, *rec(step)), 8)
            assert cm.get(holders) == (step if r == 7 else (None if step == 0 else step - 1))
    assert len(passes) == 4                          # the first ask, then one a step
    holders.hold(0, "n9")                            # new owners: asked afresh
    assert cm.get(holders) == 2 and len(passes) == 5
    p.clear()
    assert cm.get(holders) is None


def test_the_controllers_heap_is_frozen_once_and_later_garbage_is_still_collected():
    import subprocess
    import sys
    code = ("import gc, weakref\n"
            "from tm_slurm import heap\n"
            "n = heap.freeze_startup()\n"
            "class C: pass\n"
            "a, b = C(), C(); a.b, b.a = b, a; w = weakref.ref(a); del a, b\n"
            "gc.collect(); print(n, w() is None)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    frozen, collected = out.stdout.split()
    assert int(frozen) > 1000 and collected == "True", out.stderr
