import pytest

from tm_slurm.config import Layout
from tm_slurm.topology import Coord, Topology


def topo(**kw):
    return Topology(Layout(**kw))


def test_rank_coords_roundtrip():
    t = topo(dp=3, pp=2, tp=2, ranks_per_node=2)
    assert t.world == 12 and t.slots == 6
    for r in range(t.world):
        assert t.rank(t.coord(r)) == r
    assert t.coord(0) == Coord(0, 0, 0) and t.coord(1) == Coord(0, 0, 1) and t.coord(2) == Coord(1, 0, 0)
    assert t.coord(6).pp == 1


def test_groups_dp2_pp2():
    t = topo(dp=2, pp=2)
    ids = {g.id: g.members for g in t.groups}
    assert ids == {"dp/pp0.tp0": (0, 1), "dp/pp1.tp0": (2, 3),
                   "pp/dp0.tp0.s0-1": (0, 2), "pp/dp1.tp0.s0-1": (1, 3)}


def test_delta_touches_only_groups_with_the_leaver():
    t = topo(dp=2, pp=2)
    rebuilt, kept = t.slot_delta([1])           # slot 1 holds rank 1 (dp1, first stage)
    assert {g.id for g in rebuilt} == {"dp/pp0.tp0", "pp/dp1.tp0.s0-1"}
    assert {g.id for g in kept} == {"dp/pp1.tp0", "pp/dp0.tp0.s0-1"}


def test_delta_middle_stage_touches_both_neighbours_only():
    t = topo(dp=2, pp=4)
    r = t.rank(Coord(0, 2, 0))
    rebuilt, kept = t.delta([r])
    assert {g.id for g in rebuilt} == {"dp/pp2.tp0", "pp/dp0.tp0.s1-2", "pp/dp0.tp0.s2-3"}
    assert len(kept) == len(t.groups) - 3


def test_tp_stays_inside_a_node_and_multi_rank_slots():
    t = topo(dp=2, pp=1, tp=2, ranks_per_node=2)
    assert t.slot_ranks(1) == (2, 3)
    tp_groups = [g for g in t.groups if g.kind == "tp"]
    assert all(t.slot_of(g.members[0]) == t.slot_of(g.members[-1]) for g in tp_groups)
    rebuilt, _ = t.slot_delta([0])
    assert {g.id for g in rebuilt} == {"dp/pp0.tp0", "dp/pp0.tp1", "tp/dp0.pp0"}


def test_replicas_and_roles():
    t = topo(dp=3, pp=3)
    assert t.replicas(t.rank(Coord(1, 2, 0))) == (t.rank(Coord(0, 2, 0)), t.rank(Coord(2, 2, 0)))
    assert [t.role(t.rank(Coord(0, s, 0))).name for s in range(3)] == ["first", "middle", "last"]
    assert topo(dp=2).role(0).name == "only"


def test_bad_rank():
    with pytest.raises(ValueError):
        topo(dp=2).coord(2)


def test_with_a_sharded_dp_dimension_only_the_same_shard_position_is_a_replica():
    # HSDP-style: dp=4 as 2 replicas x 2 shards (consecutive DP ranks shard one copy)
    topo = Topology(Layout(dp=4, pp=1, tp=1, dp_shard=2))
    assert [topo.state_key(r) for r in range(4)] == ["pp0.tp0.dp0", "pp0.tp0.dp1"] * 2
    assert topo.replicas(0) == (2,) and topo.replicas(3) == (1,)
    assert [topo.replica_index(r) for r in range(4)] == [0, 0, 1, 1]
    # fully sharded: no replica anywhere (a lost rank's state is only in the checkpoint)
    full = Topology(Layout(dp=2, dp_shard=2))
    assert full.replicas(0) == () and full.replicas(1) == ()
    # unsharded: the key is the same as before, every DP rank a replica
    assert Topology(Layout(dp=3)).state_key(2) == "pp0.tp0" and Topology(Layout(dp=3)).replicas(1) == (0, 2)
