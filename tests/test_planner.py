import pytest

from tm_slurm import planner as P
from tm_slurm.config import Layout
from tm_slurm.messages import Move
from tm_slurm.roles import Node, Role
from tm_slurm.topology import Topology

T = Topology(Layout(dp=2, pp=2))


def nodes(**roles):
    return {n: Node(n, Role[r.split(":")[0]], ready=r.endswith(":ready")) for n, r in roles.items()}


def test_choose_joiner_is_deterministic_and_ready_only():
    ns = nodes(a="ACTIVE:ready", s2="STANDBY:ready", s1="STANDBY", s3="STANDBY:ready")
    assert P.choose_joiner(ns.values()) == "s2"
    assert P.choose_joiner(ns.values(), exclude=["s2"]) == "s3"
    assert P.choose_joiner(nodes(a="ACTIVE:ready").values()) is None


def test_check_drain():
    ns = nodes(a="ACTIVE:ready", b="FAILED", s="STANDBY:ready")
    assert P.check_drain(ns, "a") is None and P.check_drain(ns, "s") is None
    assert "FAILED" in P.check_drain(ns, "b")
    assert "unknown node 'zz'" in P.check_drain(ns, "zz")


def test_planned_plan_rebuilds_delta_and_sends_from_leaver():
    plan = P.plan_planned(T, 7, gen=3, gen_to=4, moves=[Move(1, "n2", "n5")])
    assert plan.ranks == (1,) and plan.gen_from == 3 and plan.gen_to == 4
    assert {b.id for b in plan.builds} == {"dp/pp0.tp0", "pp/dp1.tp0.s0-1"}
    assert set(P.kept(T, plan)) == {"dp/pp1.tp0", "pp/dp0.tp0.s0-1"}
    assert all(b.prefix.startswith("p7/") for b in plan.builds)
    assert [(t.rank, t.src_rank) for t in plan.transfers] == [(1, 1)]


def test_ready_needed_covers_stayers_leaver_and_joiner():
    plan = P.plan_planned(T, 1, 0, 1, [Move(1, "n2", "n5")])
    holder = {0: "n1", 1: "n2", 2: "n3", 3: "n4"}
    assert P.ready_needed(T, plan, holder) == {("n1", 0), ("n4", 3), ("n2", 1), ("n5", 1)}


def test_recovery_takes_state_from_replica_and_rebuilds_broken_groups():
    plan = P.plan_recovery(T, 2, 0, 1, [Move(3, "n4", "n5")], alive=[0, 1, 2],
                           broken=["dp/pp0.tp0"], resume_step=17)
    assert [(t.rank, t.src_rank) for t in plan.transfers] == [(3, 2)]
    assert {b.id for b in plan.builds} == {"dp/pp1.tp0", "pp/dp1.tp0.s0-1", "dp/pp0.tp0"}
    assert plan.resume_step == 17 and plan.checkpoint is None


def test_recovery_without_replica_needs_checkpoint():
    t = Topology(Layout(dp=1, pp=2))
    with pytest.raises(P.PlanError, match="no live replica"):
        P.plan_recovery(t, 1, 0, 1, [Move(0, "n1", "n3")], alive=[1], broken=[], resume_step=9)
    plan = P.plan_recovery(t, 1, 0, 1, [Move(0, "n1", "n3")], alive=[1], broken=[], resume_step=9,
                           checkpoint=(5, "/ck/step00000005"))
    assert plan.resume_step == 5 and plan.checkpoint == "/ck/step00000005" and plan.transfers == ()


def test_recovery_when_both_replicas_fail_uses_checkpoint():
    plan = P.plan_recovery(T, 1, 0, 1, [Move(0, "n1", "n5"), Move(1, "n2", "n6")], alive=[2, 3],
                           broken=[], resume_step=30, checkpoint=(20, "/c"))
    assert plan.checkpoint == "/c" and plan.ranks == (0, 1)


def test_recovery_rejects_unknown_groups():
    with pytest.raises(P.PlanError, match="unknown groups"):
        P.plan_recovery(T, 1, 0, 1, [], alive=[0, 1, 2, 3], broken=["nope"], resume_step=1)


def test_recovery_needed():
    plan = P.plan_recovery(T, 2, 0, 1, [Move(3, "n4", "n5")], alive=[0, 1, 2], broken=[], resume_step=1)
    holder = {0: "n1", 1: "n2", 2: "n3"}
    assert P.recovery_needed(T, plan, holder) == {("n1", 0), ("n2", 1), ("n3", 2), ("n5", 3)}


@pytest.mark.parametrize("policy,waited,dp,want", [
    ("wait", 1.0, 2, "wait"), ("wait", 100.0, 2, "checkpoint_exit"), ("shrink", 0, 2, "shrink"),
    ("shrink", 0, 1, "checkpoint_exit"), ("checkpoint_exit", 0, 2, "checkpoint_exit")])
def test_exhausted_action(policy, waited, dp, want):
    assert P.exhausted_action(policy, waited, 60.0, dp) == want


def test_shrink_drops_the_replica_that_lost_a_node_and_renumbers_like_a_fresh_smaller_job():
    topo = Topology(Layout(dp=2, pp=2))          # slots: 0=(dp0,pp0) 1=(dp1,pp0) 2=(dp0,pp1) 3=(dp1,pp1)
    sp = P.plan_shrink(topo, [0])                # node of replica 0, stage 0 lost
    assert sp.layout == Layout(dp=1, pp=2) and sp.dropped == (0,)
    assert dict(sp.slots) == {1: 0, 3: 1}       # replica 1 becomes replica 0 of the dp=1 job
    assert sp.freed == (2,)                      # the lost node's replica partner: a standby now


def test_shrink_keeps_untouched_replicas_in_order():
    topo = Topology(Layout(dp=3, pp=2))
    sp = P.plan_shrink(topo, [4])                # slot 4 = (dp1, pp1)
    assert sp.layout.dp == 2 and sp.dropped == (1,)
    assert dict(sp.slots) == {0: 0, 2: 1, 3: 2, 5: 3} and sp.freed == (1,)


@pytest.mark.parametrize("layout, lost, why", [
    (Layout(dp=2, pp=2), [0, 3], "every DP replica"),
    (Layout(dp=4, tp=1, ranks_per_node=2), [0], None),          # a node holds two replicas: both go
    (Layout(dp=3, ranks_per_node=3), [0], "every DP replica"),
    (Layout(dp=4, ranks_per_node=2), [0, 1], "every DP replica"),
])
def test_shrink_says_when_the_layout_does_not_allow_it(layout, lost, why):
    sp = P.plan_shrink(Topology(layout), lost)
    if why is None:
        assert sp.layout.dp == 2 and dict(sp.slots) == {1: 0}
    else:
        assert isinstance(sp, str) and why in sp


def test_hsdp_shrink_drops_the_whole_shard_group_and_keeps_the_shards():
    # 2 replicas x 2 shards, one rank a node: slot 3 = (dp3) is replica 1, shard 1
    topo = Topology(Layout(dp=4, dp_shard=2, pp=1))
    sp = P.plan_shrink(topo, [3])
    assert sp.layout == Layout(dp=2, dp_shard=2, pp=1) and sp.dropped == (2, 3)
    assert dict(sp.slots) == {0: 0, 1: 1} and sp.freed == (2,) and not sp.from_checkpoint
    small = Topology(sp.layout)
    assert [small.state_key(r) for r in range(2)] == [topo.state_key(r) for r in range(2)]


def test_fsdp_shrink_reshards_the_survivors_from_the_checkpoint():
    topo = Topology(Layout(dp=3, dp_shard=3, pp=1))
    sp = P.plan_shrink(topo, [1])
    assert sp.layout == Layout(dp=2, dp_shard=2, pp=1) and sp.from_checkpoint
    assert dict(sp.slots) == {0: 0, 2: 1} and sp.freed == ()
    assert P.plan_shrink(Topology(Layout(dp=2, dp_shard=2, pp=1)), [0]).layout == Layout(dp=1, pp=1)
