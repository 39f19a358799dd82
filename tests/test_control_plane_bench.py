"""`tm-slurm bench --control-plane` at a small size: the real controller, store and vote against
emulated agents and node leaders in real processes (what it measures: README)."""
from tm_slurm.bench.controlplane import measure, table
from tm_slurm.controller.progress import Progress


def test_control_plane_bench_runs_the_real_vote_and_controller():
    r = measure(8, 2, 12, 0.05)
    for k in ("vote_p50_s", "vote_p99_s", "controller_cpu_per_step_s", "store_ops_per_step", "swap_plan_s",
              "recovery_plan_s", "rss_start_mb", "rss_end_mb"):
        assert r[k] >= 0, k
    assert r["aborted_votes"] == 0 and r["nodes_failed"] == []
    # one store vote a node (set, add, wait, get; the last voter more; the rank-0 clean-up)
    assert 8 * 4 <= r["store_ops_per_step"] <= 8 * 4 + 12
    assert r["groups_rebuilt"]["swap"] >= 1
    assert "vote p50 ms" in table([r])


def test_progress_counts_the_ranks_that_reported_a_step():
    p = Progress(keep=2)
    rec = lambda s: (s, 0.1, 0.1, None, 1.0, False)
    p.add(0, [rec(1), rec(2)])
    p.add(1, [rec(1)])
    p.add(1, [rec(1)])                 # again (a rollback): still one record
    assert p.reported(1) == 2 and p.reported(2) == 1
    p.add(0, [rec(3)])                 # step 1 of rank 0 falls out of the window
    assert p.reported(1) == 1 and p.reported(3) == 1


def test_a_broadcast_encodes_once_and_every_link_opens_it():
    from tm_slurm.control import auth, codec
    from tm_slurm.messages import Ping
    keys = auth.Keys.derive(b"s" * 32)
    enc = codec.prepare(Ping(3, 1.5))
    for peer in ("node1", "node2"):
        tx, rx = auth.Sealer(keys, "job", "controller"), auth.Sealer(keys, "job", peer, peer="controller")
        assert rx.open(tx.seal(enc)) == Ping(3, 1.5) == rx.open(tx.seal(Ping(3, 1.5)))
