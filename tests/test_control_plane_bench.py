"""`tm-slurm bench --control-plane` at a small size: the real controller, store and vote against
emulated agents and node leaders in real processes (what it measures: README)."""
from tm_slurm.bench.controlplane import measure, table


def test_control_plane_bench_runs_the_real_vote_and_controller():
    r = measure(8, 2, 12, 0.05)
    # each figure measured something (a zero is a broken measurement, not a fast one), in a
    # range a loaded 2-core machine makes: a vote well under a second, a plan under a second
    for k in ("vote_p50_s", "store_vote_p50_s", "node_local_vote_p50_s", "controller_cpu_per_step_s",
              "swap_plan_s", "recovery_plan_s", "rss_start_mb"):
        assert r[k] > 0, (k, r[k])
    assert r["node_local_vote_p50_s"] < r["vote_p50_s"] <= r["vote_p99_s"] < 0.5, r
    assert r["swap_plan_s"] < 1 and r["recovery_plan_s"] < 1, r
    # 12 steps cannot grow the controller: what it holds is per node and per swap
    assert abs(r["rss_end_mb"] - r["rss_start_mb"]) < 20, r
    # the bare exchange under it, as many rounds as asked, both sides' CPU
    assert r["floor_rounds"] == 40
    for k in ("floor_exchange_p50_s", "floor_exchange_p99_s", "floor_nodes_cpu_per_round_s",
              "floor_central_cpu_per_round_s"):
        assert r[k] > 0, k
    assert r["aborted_votes"] == 0 and r["nodes_failed"] == []
    # one store vote a node (append, add, a get that waits; the deciding voter reads the votes
    # and the pending switch and writes the decision instead of waiting; the controller's
    # clean-up of old steps' keys)
    assert 8 * 3 <= r["store_ops_per_step"] <= 8 * 3 + 8
    assert r["groups_rebuilt"]["swap"] >= 1
    assert "vote p50 ms" in table([r]) and "floor p99 ms" in table([r])

