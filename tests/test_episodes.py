"""The controller's episodes driven against a fake port and an in-memory store: every branch of a
planned swap, a recovery, a restart, a shrink and the ending, in milliseconds, with the clock
injected. Process tests (tests/procs) keep the end-to-end truth; these pin the decisions."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tm_slurm.comm import vote as votes
from tm_slurm.config import Config, Layout, Recovery as RecoveryCfg, Standby
from tm_slurm.controller.episodes.base import Failure
from tm_slurm.controller.episodes.ending import Ending
from tm_slurm.controller.episodes.recovery import Recovery, State as RS
from tm_slurm.controller.episodes.restart import FullRestart, State as XS
from tm_slurm.controller.episodes.swap import PlannedSwap, State as SS
from tm_slurm.controller.holders import Holders
from tm_slurm.controller.intake import Intake, Migrate, ReleaseStandby
from tm_slurm.controller.progress import Progress
from tm_slurm.controller.requests import Request
from tm_slurm.messages import (REPORT_KINDS, Aborted, CancelPlan, Exiting, Fence, Joined, Left, Move, Prepare,
                               PrepareFailed, Ready, Recover, RecoverBuilt, Recovered, Report, Resume, Shutdown,
                               ToWorkers, WriteCheckpoint, report)
from tm_slurm.planner import ShrinkPlan, plan_planned, plan_shrink
from tm_slurm.roles import JobState, JobStatus, NodeTable, Role, TransitionError
from tm_slurm.topology import Topology

LAYOUT = Layout(dp=2, pp=2)          # slot i holds rank i; DP replicas: 0-1, 2-3
ACTIVE = ["n0", "n1", "n2", "n3"]
STANDBY = ["s0", "s1"]


# ---------------------------------------------------------------- fakes

class FakeLog:
    def __init__(self):
        self.events: list[dict] = []
        self.gen = 0

    def emit(self, kind: str, **fields) -> dict:
        self.events.append(dict(fields, kind=kind))
        return self.events[-1]

    def kinds(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind]


class FakeStore:
    """The store calls the controller side makes (vote.py), on a dict; a missing key raises
    where a real store would block."""
    def __init__(self):
        self.d: dict[str, bytes] = {}

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else v

    def get(self, k):
        return self.d[k]

    def peek(self, k):
        return self.d.get(k)

    def check(self, keys):
        return all(k in self.d for k in keys)

    def compare_set(self, k, expected, desired):
        exp = expected.encode() if isinstance(expected, str) else expected
        des = desired.encode() if isinstance(desired, str) else desired
        cur = self.d.get(k)
        if (cur is None and exp == b"") or cur == exp:
            self.d[k] = des
            return des
        return exp if cur is None else cur

    def add(self, k, n):
        self.d[k] = str(int(self.d.get(k, b"0")) + n).encode()
        return int(self.d[k])

    def wait(self, keys, timeout=None):
        if not self.check(keys):
            raise TimeoutError(keys)


class FakePort:
    """Implements controller/port.py with plain data; records what episodes ask for."""
    def __init__(self, cfg: Config | None = None, standbys=STANDBY, ready=True):
        self.job_id = "job"
        self.cfg = cfg or Config(layout=LAYOUT)
        self.T = self.cfg.timeouts
        self.topo = Topology(self.cfg.layout)
        self.log = FakeLog()
        self.nodes = NodeTable(self.log)
        self.job = JobStatus(self.log)
        self.job.set(JobState.RUNNING)
        for i, n in enumerate(ACTIVE[:self.topo.world]):
            self.nodes.add(n, Role.ACTIVE, slot=i)
        for n in standbys:
            self.nodes.add(n, Role.STANDBY)
            self.nodes.set_ready(n, ready)
        self.holders = Holders(self.topo, dict(enumerate(ACTIVE[:self.topo.world])))
        self.progress = Progress()
        self.store = FakeStore()
        self.gen = 0
        self.first_steps: list[tuple[int, int]] = []     # (generation, its first step) entered
        self._gen_seq = self._plan_seq = 0
        self.total_steps = None
        self.requeue_code = 75
        self.clock = 100.0
        self.sent: list[tuple[str, object]] = []
        self.failed: list[tuple[str, str]] = []
        self.drains: list[str] = []
        self.released: list[str] = []
        self.stopped: list[tuple[str, JobState, int, bool]] = []
        self.started_eps: list = []
        self.interruptions: list[dict] = []
        self.exited: set[tuple[str, int]] = set()
        self.workers: dict[str, list[int]] = {}
        self.alive = list(ACTIVE[:self.topo.world]) + list(standbys)
        self.started_all = False
        self.checkpoints: set[int] = set()
        self.latest: tuple[int, str] | None = None
        self.restarted: list[tuple[str | None, int]] = []
        self.relaunched: list[str] = []
        self.exit_code = None

    # clock
    def now(self):
        return self.clock

    def wall(self):
        return 1000.0 + self.clock

    # the job
    def send(self, node, msg):
        self.sent.append((node, msg))

    def broadcast(self, msg):
        self.sent.append(("*", msg))

    def broadcasts(self, kind):
        return [m.payload if isinstance(m, ToWorkers) else m for n, m in self.sent
                if n == "*" and isinstance(m.payload if isinstance(m, ToWorkers) else m, kind)]

    def committed_step(self):
        return self.progress.min_committed(self.holders.ranks)

    def next_plan_id(self):
        self._plan_seq += 1
        return self._plan_seq

    def new_gen(self):
        self._gen_seq += 1
        return self._gen_seq

    def enter_gen(self, gen, first_step):
        self.gen = self.log.gen = gen
        self.first_steps.append((gen, first_step))

    def adopt(self, plan, since, first_step=None):
        self.enter_gen(plan.gen_to, since if first_step is None else first_step)
        for m in plan.moves:
            self.holders.hold(m.slot, m.joiner, since)

    def abort_in_flight(self, why):
        return self.gen, 0

    def fail(self, node, how, **detail):
        self.failed.append((node, how))

    def request_drain(self, node, request):
        self.drains.append(node)

    def release(self, node, why):
        self.released.append(node)

    def stop(self, why, final, code, wait_workers=False):
        self.stopped.append((why, final, code, wait_workers))

    def start(self, episode):
        self.started_eps.append(episode)
        episode.start()

    def record_interruption(self, rec):
        self.interruptions.append(rec)

    # workers and agents
    def worker_locals(self, node):
        return self.workers.get(node, [0])

    def has_exited(self, node, local):
        return (node, local) in self.exited

    def all_started(self):
        return self.started_all

    def agents_alive(self):
        return self.alive

    def set_exit_code(self, code):
        self.exit_code = code

    # checkpoints and restarts
    def checkpoint_done(self, step):
        return step in self.checkpoints

    def checkpoint_path(self, step):
        return f"/ck/step{step:08d}"

    def latest_checkpoint(self):
        return self.latest

    def reshape(self, layout):
        self.cfg = replace(self.cfg, layout=layout)
        self.topo = Topology(layout)
        self.progress.clear()

    def relaunch(self, node):
        self.relaunched.append(node)

    def forget_warmup(self, node):
        pass

    def restart_workers(self, checkpoint, start_step):
        self.restarted.append((checkpoint, start_step))

    # helpers for the tests
    def commit(self, *steps, ranks=None):
        for r in ranks if ranks is not None else range(self.topo.world):
            self.progress.add_rows(tuple(x for s in steps for x in (r, s, 0.1, 0.05, 1.0, 1000.0 + s, False, 0.05)),
                                   self.topo.world)

    def down(self, node, aborted=True) -> Failure:
        """What the controller does before it hands a failure to the episodes."""
        self.nodes.set_role(node, Role.FAILED, reason="test")
        return Failure(node, "test", {"how": "test", "detect_s": None}, self.wall(),
                       aborted=(self.gen, 5) if aborted else None)


def drain(node="n1", t=990.0) -> Request:
    return Request("drain", node, "maintenance", t, 0, "", {})


def r(cls, rank, step=None, gen=0, **fields) -> Report:
    return cls(gen, rank, step, **fields)


# ---------------------------------------------------------------- planned swap

def swap_on(port: FakePort, leaver="n1", joiner="s0") -> PlannedSwap:
    port.commit(0, 1, 2, 3, 4)
    plan = plan_planned(port.topo, port.next_plan_id(), port.gen, port.new_gen(),
                        [Move(port.nodes.nodes[leaver].slot, leaver, joiner)], reason="maintenance")
    ep = PlannedSwap(port, plan, drain(leaver))
    port.start(ep)
    return ep


def all_ready(port: FakePort, ep: PlannedSwap) -> None:
    for node, rank in sorted(ep.needed):
        ep.on_report(node, r(Ready, rank, plan=ep.plan.id, build_s=0.2, groups=[]))


def switch_at(port: FakePort, ep: PlannedSwap, step=6) -> None:
    """What the deciding voter of the boundary that carries the switch writes (comm/vote.py):
    its claim on the pending switch, the commit, the switch step."""
    plan, pk = ep.plan, votes.pending_key(ep.plan.gen_from)
    port.store.set(pk, json.dumps({**json.loads(port.store.get(pk)), "at": step}))
    port.store.set(votes.dkey(plan.gen_from, step), votes.Decision(True, plan.id, plan.gen_to).encode())
    port.store.set(votes.switch_key(plan.id), str(step))


def test_swap_from_plan_to_measured_completion():
    port = FakePort()
    ep = swap_on(port)
    assert port.nodes.nodes["n1"].role == Role.LEAVING and port.nodes.nodes["s0"].role == Role.JOINING
    assert port.job.state == JobState.SWAPPING and port.broadcasts(Prepare)
    port.clock += 1.0
    ep.tick(port.now())
    assert ep.state == SS.PREPARING                   # nobody ready yet
    all_ready(port, ep)
    ep.tick(port.now())
    assert ep.state == SS.SWITCHING
    assert port.store.check([votes.pending_key(ep.plan.gen_from)])
    (phase1,) = port.log.kinds("phase1_done")
    assert phase1["phase1_s"] == 1.0 and phase1["build_s_max"] == 0.2

    switch_at(port, ep, 6)
    port.clock += 0.5
    ep.tick(port.now())
    assert ep.state == SS.SWITCHED and ep.switch_step == 6
    assert port.holders.ranks[1] == "s0" and port.holders.since["s0"] == 5
    assert port.nodes.nodes["s0"].role == Role.ACTIVE and port.job.state == JobState.RUNNING
    assert port.gen == ep.plan.gen_to
    # the new generation's ranks vote from the step after the switch (its vote keys start there)
    assert port.first_steps == [(ep.plan.gen_to, 7)]

    ep.on_report("n1", r(Left, 1, 7, plan=ep.plan.id, bytes=100, transfer_s=0.01, tensors=3))
    assert ("n1", Shutdown("evacuated")) in port.sent
    ep.on_report("s0", r(Joined, 1, 7, plan=ep.plan.id, build_model_s=0.1, build_s=0.1, reused_sandbox=True,
                         wait_s=0.0, recv_s=0.02, bytes=100, transfer_s=0.01, tensors=3))
    port.commit(*range(5, 18))
    ep.tick(port.now())
    assert ep.done and ep.state == SS.DONE
    (rec,) = port.interruptions
    assert rec["kind"] == "planned" and rec["switch_step"] == 6 and not rec["interrupted"]
    assert rec["state_bytes"] == 100 and rec["event_to_plan_s"] == pytest.approx(1100.0 - 990.0)
    assert port.log.kinds("swap_complete")[0]["step"] == 7


def test_phase1_timeout_cancels_and_keeps_the_drain_wanted():
    port = FakePort()
    ep = swap_on(port)
    port.clock += port.T.phase1_timeout_s + 1
    ep.tick(port.now())
    assert ep.state == SS.CANCELLED and ep.done
    assert port.nodes.nodes["n1"].role == Role.ACTIVE and port.nodes.nodes["s0"].role == Role.STANDBY
    assert port.drains == ["n1"] and port.broadcasts(CancelPlan)
    assert port.job.state == JobState.RUNNING
    assert "phase 1 not done" in port.log.kinds("swap_cancelled")[0]["why"]


def test_prepare_failed_cancels():
    port = FakePort()
    ep = swap_on(port)
    ep.on_report("n0", r(PrepareFailed, 0, plan=ep.plan.id, error="boom"))
    assert ep.state == SS.CANCELLED and "could not prepare: boom" in port.log.kinds("swap_cancelled")[0]["why"]


def test_stale_reports_of_another_plan_are_ignored():
    port = FakePort()
    ep = swap_on(port)
    for node, rank in sorted(ep.needed):
        ep.on_report(node, r(Ready, rank, plan=ep.plan.id + 1, build_s=0.2, groups=[]))
    ep.on_report("n0", r(PrepareFailed, 0, plan=ep.plan.id - 1, error="old"))
    ep.tick(port.now())
    assert ep.state == SS.PREPARING and not ep.ready


def test_joiner_dies_before_the_switch():
    port = FakePort()
    ep = swap_on(port)
    all_ready(port, ep)
    ep.tick(port.now())
    assert ep.involves("s0") and ep.involves("n1") and not ep.involves("n0")
    took = ep.on_node_failed(port.down("s0"))
    assert not took                      # the aborted step is recovered by a new recovery
    assert ep.state == SS.CANCELLED
    assert port.store.get(votes.pending_key(ep.plan.gen_from)) == b""     # the switch taken back
    assert port.nodes.nodes["n1"].role == Role.ACTIVE and port.nodes.nodes["s0"].role == Role.FAILED
    assert port.holders.ranks[1] == "n1" and port.drains == ["n1"]


def test_joiner_dies_while_the_job_ends_cancels_without_abort():
    port = FakePort()
    ep = swap_on(port)
    ep.on_node_failed(port.down("s0", aborted=False))
    assert ep.state == SS.CANCELLED
    assert "joiner s0 failed" in port.log.kinds("swap_cancelled")[0]["why"]


def test_joiner_dies_after_the_commit_carried_the_switch():
    port = FakePort()
    ep = swap_on(port)
    all_ready(port, ep)
    ep.tick(port.now())
    switch_at(port, ep, 6)
    port.gen = ep.plan.gen_to   # what abort_in_flight reports: the ranks already moved on
    f = port.down("s0")
    port.gen = ep.plan.gen_from
    ep.on_node_failed(f)
    assert ep.state == SS.DONE and port.interruptions[0]["interrupted"]
    # the switch stands and the dead joiner holds the slot: the recovery replaces it
    assert port.holders.slot_of("s0") == 1 and port.nodes.nodes["s0"].role == Role.FAILED


def test_leaver_dies_during_the_state_transfer():
    port = FakePort()
    ep = swap_on(port)
    all_ready(port, ep)
    ep.tick(port.now())
    switch_at(port, ep, 6)
    ep.tick(port.now())
    assert ep.state == SS.SWITCHED
    ep.on_node_failed(port.down("n1"))
    assert ep.state == SS.DONE and port.interruptions[0]["interrupted"]
    assert port.interruptions[0]["state_bytes"] == 0
    assert "n1" not in port.holders          # its ranks had moved: nothing to recover for it


def test_stayer_fails_during_phase_1():
    port = FakePort()
    ep = swap_on(port)
    took = ep.on_node_failed(port.down("n3"))
    assert not took and ep.state == SS.CANCELLED
    assert port.nodes.nodes["s0"].role == Role.STANDBY and port.nodes.nodes["n1"].role == Role.ACTIVE
    assert "n3 failed (test)" in port.log.kinds("swap_cancelled")[0]["why"]


def test_stayer_fails_during_the_switch_before_the_commit():
    port = FakePort()
    ep = swap_on(port)
    all_ready(port, ep)
    ep.tick(port.now())
    ep.on_node_failed(port.down("n3"))
    assert ep.state == SS.CANCELLED and port.holders.ranks[1] == "n1"


def test_stayer_fails_during_the_switch_after_the_commit():
    port = FakePort()
    ep = swap_on(port)
    all_ready(port, ep)
    ep.tick(port.now())
    switch_at(port, ep, 6)          # a commit carried it before the controller saw it
    ep.on_node_failed(port.down("n3"))
    assert ep.state == SS.DONE and port.holders.ranks[1] == "s0"
    assert port.interruptions[0]["interrupted"] and port.nodes.nodes["s0"].role == Role.ACTIVE


def test_job_ending_inside_the_measuring_window_records_the_swap():
    port = FakePort()
    ep = swap_on(port)
    all_ready(port, ep)
    ep.tick(port.now())
    switch_at(port, ep, 6)
    ep.tick(port.now())
    ep.finish("stop requested")
    assert ep.state == SS.SWITCHED                     # not joined yet: nothing measured
    ep.on_report("s0", r(Joined, 1, 7, plan=ep.plan.id, build_model_s=0.1, build_s=0.1, reused_sandbox=False,
                         wait_s=0.0, recv_s=0.02))
    ep.finish("stop requested")
    assert ep.state == SS.DONE and port.interruptions[0]["interrupted"]


# ---------------------------------------------------------------- recovery

def recovery_on(port: FakePort, node="n3", step=5) -> Recovery:
    port.commit(0, 1, 2, 3, 4)
    ep = Recovery.after_failure(port, port.down(node))
    port.start(ep)
    return ep


def aborted_by_survivors(port, ep, step=5, gen=None, broken=("dp/pp1.tp0",)):
    for rank in ep.live_ranks():
        ep.on_report(port.holders.ranks[rank], r(Aborted, rank, step, gen=ep.gen if gen is None else gen,
                                                  broken=list(broken), why="x", t=1.0))


def test_recovery_from_failure_to_measured_completion():
    port = FakePort()
    ep = recovery_on(port)
    assert port.job.state == JobState.RECOVERING and ep.slots() == {"n3": 3}
    ep.tick(port.now())
    assert ep.state == RS.COLLECTING              # waiting for the survivors' abort
    aborted_by_survivors(port, ep)
    port.clock += 0.3
    ep.tick(port.now())
    assert ep.state == RS.BUILDING and port.nodes.nodes["s0"].role == Role.JOINING
    (plan,) = [m.plan for m in port.broadcasts(Recover)]
    assert plan.moves == (Move(3, "n3", "s0"),) and plan.resume_step == 5
    for node, rank in sorted(ep.needed):
        ep.on_report(node, r(RecoverBuilt, rank, 5, plan=plan.id, build_s=0.1, groups=[]))
    port.clock += 0.2
    ep.tick(port.now())
    assert ep.state == RS.RESUMED and port.broadcasts(Resume)
    assert port.holders.ranks[3] == "s0" and port.holders.since["s0"] == 5
    assert port.nodes.nodes["s0"].role == Role.ACTIVE and port.job.state == JobState.RUNNING
    for node, rank in sorted(ep.needed):
        if node == "s0":
            ep.on_report(node, r(Joined, rank, 5, plan=plan.id, build_model_s=0.1, build_s=0.1,
                                 reused_sandbox=True, wait_s=0.0, recv_s=0.03))
        elif rank == 2:      # the donor of rank 3's state
            ep.on_report(node, r(Recovered, rank, 5, plan=plan.id, resume_s=0.01, donor=True, bytes=64,
                                 transfer_s=0.02, tensors=2))
        else:
            ep.on_report(node, r(Recovered, rank, 5, plan=plan.id, resume_s=0.01, donor=False))
    ep.tick(port.now())
    assert ep.state == RS.RESUMED                 # step 5 not committed again yet
    port.commit(5)
    ep.tick(port.now())
    assert ep.done
    (rec,) = port.interruptions
    assert rec["kind"] == "unplanned" and rec["failed_nodes"] == ["n3"] and rec["state_bytes"] == 64
    assert rec["phases"]["collect_s"] == 0.3 and rec["phases"]["build_s"] == 0.2
    assert rec["phases"]["resume_s"] == 0.03 and rec["lost_steps"] == 1


def test_stale_abort_of_an_older_generation_is_ignored():
    port = FakePort()
    port.gen = 2
    ep = recovery_on(port)
    aborted_by_survivors(port, ep, gen=1)
    ep.tick(port.now())
    assert ep.state == RS.COLLECTING and not ep.aborted


def test_second_failure_while_collecting_moves_both_slots():
    port = FakePort()
    ep = recovery_on(port, "n3")
    assert ep.on_node_failed(port.down("n1"))
    aborted_by_survivors(port, ep)
    ep.tick(port.now())
    (plan,) = [m.plan for m in port.broadcasts(Recover)]
    assert plan.moves == (Move(1, "n1", "s0"), Move(3, "n3", "s1"))


def test_second_failure_while_building_replans():
    port = FakePort()
    ep = recovery_on(port, "n3")
    aborted_by_survivors(port, ep)
    ep.tick(port.now())
    assert ep.state == RS.BUILDING
    assert ep.on_node_failed(port.down("n0"))
    assert ep.state == RS.COLLECTING and ep.plan is None
    assert port.nodes.nodes["s0"].role == Role.STANDBY and port.broadcasts(CancelPlan)
    assert port.log.kinds("recovery_replan")[0]["why"] == "n0 failed during recovery"
    aborted_by_survivors(port, ep)
    ep.tick(port.now())
    plan = port.broadcasts(Recover)[-1].plan
    assert plan.moves == (Move(0, "n0", "s0"), Move(3, "n3", "s1")) and ep.plans_tried == 2


def test_failure_after_resume_ends_this_recovery_and_leaves_it_to_a_new_one():
    port = FakePort()
    ep = recovery_on(port, "n3")
    aborted_by_survivors(port, ep)
    ep.tick(port.now())
    for node, rank in sorted(ep.needed):
        ep.on_report(node, r(RecoverBuilt, rank, 5, plan=ep.plan.id, build_s=0.1, groups=[]))
    ep.tick(port.now())
    assert not ep.on_node_failed(port.down("n0"))
    assert ep.done and port.interruptions[0]["interrupted"] and port.interruptions[0]["stall_s"] is None


def test_failure_of_a_node_holding_nothing_does_not_replan():
    port = FakePort()
    ep = recovery_on(port, "n3")
    aborted_by_survivors(port, ep)
    ep.tick(port.now())
    assert ep.on_node_failed(port.down("s1"))
    assert ep.state == RS.BUILDING


def test_a_newer_abort_generation_restarts_the_collection():
    port = FakePort()
    ep = recovery_on(port, "n3")
    aborted_by_survivors(port, ep)
    port.gen = 4
    ep.on_node_failed(port.down("n0"))
    assert ep.gen == 4 and ep.aborted == {}


def test_recovery_fences_a_rank_that_never_aborts():
    port = FakePort()
    ep = recovery_on(port)
    ep.on_report("n0", r(Aborted, 0, 5, broken=[], why="x", t=1.0))
    port.clock += port.T.heartbeat_timeout_s + 0.1
    ep.tick(port.now())
    assert port.failed == []                       # re-abort first
    port.clock += 2 * port.T.collective_timeout_s
    ep.tick(port.now())
    assert port.failed == [("n1", "no_abort"), ("n2", "no_abort")]


def test_recovery_fences_a_stuck_builder():
    port = FakePort()
    ep = recovery_on(port)
    aborted_by_survivors(port, ep)
    ep.tick(port.now())
    port.clock += port.T.rebuild_timeout_s + port.T.heartbeat_timeout_s + 1
    ep.tick(port.now())
    assert ("s0", "recovery_stuck") in port.failed


def test_no_standby_checkpoints_and_stops_requeueable():
    port = FakePort(standbys=[])
    ep = recovery_on(port)
    aborted_by_survivors(port, ep)
    ep.tick(port.now())
    assert ep.state == RS.STOPPING and not ep.done
    (wc,) = port.broadcasts(WriteCheckpoint)
    assert wc.writers == (0, 2) and wc.step == 5          # one live replica per shard
    assert port.stopped == [("no standby left", JobState.REQUEUED, 75, True)]


def test_wait_policy_waits_for_a_standby_then_plans():
    port = FakePort(Config(layout=LAYOUT, standby=Standby(when_exhausted="wait", wait_s=30)), ready=False)
    ep = recovery_on(port)
    aborted_by_survivors(port, ep)
    ep.tick(port.now())
    assert ep.state == RS.WAITING
    port.clock += 10
    ep.tick(port.now())
    assert ep.state == RS.WAITING
    port.nodes.set_ready("s1")
    ep.tick(port.now())
    assert ep.state == RS.BUILDING and port.broadcasts(Recover)[0].plan.joiners == ("s1",)


def test_wait_policy_runs_out_and_checkpoints():
    port = FakePort(Config(layout=LAYOUT, standby=Standby(when_exhausted="wait", wait_s=30)), ready=False)
    ep = recovery_on(port)
    aborted_by_survivors(port, ep)
    ep.tick(port.now())
    port.clock += 31
    ep.tick(port.now())
    assert ep.state == RS.STOPPING and port.log.kinds("standbys_exhausted")[-1]["action"] == "checkpoint_exit"


def test_shrink_policy_hands_over_to_a_shrinking_restart():
    port = FakePort(Config(layout=LAYOUT, standby=Standby(when_exhausted="shrink")), standbys=[])
    ep = recovery_on(port, "n3")
    aborted_by_survivors(port, ep)
    ep.tick(port.now())
    assert ep.state == RS.SHRUNK and ep.done
    (restart,) = port.started_eps[1:]
    assert isinstance(restart, FullRestart) and restart.state == XS.CHECKPOINTING
    assert port.broadcasts(WriteCheckpoint)[0].reason.startswith("shrink:")
    # a failure during the shrink ends the job, requeueable
    assert restart.on_node_failed(port.down("n0"))
    assert port.stopped[-1][1:3] == (JobState.REQUEUED, 75) and restart.state == XS.FAILED and restart.done


def test_unrecoverable_plan_stops_the_job():
    port = FakePort(Config(layout=Layout(dp=1, pp=2)))
    ep = recovery_on(port, "n1")        # no replica of rank 1 and no checkpoint
    aborted_by_survivors(port, ep)
    ep.tick(port.now())
    assert ep.state == RS.FAILED and port.stopped[0][1] == JobState.FAILED


# ---------------------------------------------------------------- restart and shrink

def restart_cfg() -> Config:
    return Config(layout=LAYOUT, recovery=RecoveryCfg(strategy="restart"))


def test_planned_restart_checkpoints_then_relaunches_everyone():
    port = FakePort(restart_cfg())
    ep = FullRestart.planned(port, Move(1, "n1", "s0"), "maintenance")
    port.start(ep)
    assert ep.state == XS.CHECKPOINTING and port.store.check([votes.pending_key(0)])
    ep.on_report("n0", r(Exiting, 0, 9, reason="restart"))
    ep.tick(port.now())
    assert ep.state == XS.CHECKPOINTING               # checkpoint not complete yet
    port.checkpoints.add(9)
    port.exited |= {(n, 0) for n in ACTIVE + ["s0"]}
    ep.tick(port.now())
    assert ep.state == XS.STARTING
    assert port.holders.ranks[1] == "s0" and port.released == ["n1"]
    assert port.nodes.nodes["n1"].role == Role.RELEASED and port.restarted == [("/ck/step00000009", 9)]
    assert port.gen == 1
    port.started_all = True
    port.clock += 2
    ep.tick(port.now())
    assert ep.done and port.interruptions[0]["resume_step"] == 9
    assert port.interruptions[0]["phases"]["start_s"] == 2.0


def test_a_restart_whose_checkpoint_never_completes_ends_the_job_once():
    port = FakePort(restart_cfg())
    ep = FullRestart.planned(port, Move(1, "n1", "s0"), "maintenance")
    port.start(ep)
    ep.on_report("n0", r(Exiting, 0, 9, reason="restart"))
    port.exited |= {(n, 0) for n in ACTIVE + ["s0"]}
    port.clock += port.T.shutdown_s + 1
    ep.tick(port.now())
    assert ep.state == XS.FAILED and ep.done and port.stopped[-1][1:3] == (JobState.REQUEUED, 75)
    assert len(port.log.kinds("restart_failed")) == 1


def test_planned_restart_leaver_failing_is_not_replaced_twice():
    port = FakePort(restart_cfg())
    ep = FullRestart.planned(port, Move(1, "n1", "s0"), "maintenance")
    port.start(ep)
    assert ep.on_node_failed(port.down("n1"))
    assert ep.moves == [Move(1, "n1", "s0")] and port.nodes.nodes["s1"].role == Role.STANDBY


def test_restart_after_failure_resumes_from_the_latest_checkpoint():
    port = FakePort(restart_cfg())
    f = port.down("n2")
    ep = FullRestart.after_failure(port, f)
    port.start(ep)
    assert ep.state == XS.STOPPING and port.nodes.nodes["s0"].role == Role.JOINING
    assert sorted(n for n, m in port.sent if isinstance(m, Fence)) == ACTIVE + ["s0"]   # everyone stops
    port.latest = (3, "/ck/step00000003")
    port.clock += port.T.shutdown_s + 1
    ep.tick(port.now())
    assert port.restarted == [("/ck/step00000003", 3)] and port.holders.ranks[2] == "s0"
    # a second failure while restarting takes the other standby
    assert ep.on_node_failed(port.down("n0"))
    assert ep.moves[-1] == Move(0, "n0", "s1")


def test_restart_without_standby_stops_requeueable():
    port = FakePort(restart_cfg(), standbys=[])
    assert FullRestart.after_failure(port, port.down("n2")) is None
    assert port.stopped == [("no standby to restart on", JobState.REQUEUED, 75, False)]


def test_shrink_renumbers_the_survivors():
    port = FakePort(Config(layout=LAYOUT, standby=Standby(when_exhausted="shrink")), standbys=[])
    sp = plan_shrink(port.topo, [3])
    assert sp == ShrinkPlan(layout=Layout(dp=1, pp=2), dropped=(1,), slots={0: 0, 2: 1}, freed=(1,))
    port.down("n3")
    port.job.set(JobState.RECOVERING)             # a recovery found no standby
    ep = FullRestart.shrinking(port, sp, "n3: test", 0, 5, [0, 2])
    port.start(ep)
    port.checkpoints.add(5)
    port.exited |= {(n, 0) for n in ACTIVE}
    ep.tick(port.now())
    assert port.holders.by_slot == {0: "n0", 1: "n2"} and port.holders.ranks == {0: "n0", 1: "n2"}
    assert port.nodes.nodes["n1"].role == Role.STANDBY and port.relaunched == ["n1"]
    port.started_all = True
    ep.tick(port.now())
    assert port.log.kinds("shrink_complete")[0]["dp_to"] == 1


# ---------------------------------------------------------------- ending

def test_ending_waits_for_workers_then_shuts_down():
    port = FakePort()
    ep = Ending(port, "checkpoint and exit", JobState.REQUEUED, 75, wait_workers=True)
    port.job.set(JobState.SWAPPING)
    port.start(ep)
    assert port.job.state == JobState.STOPPING
    ep.tick(port.now())
    assert ep.state.value == "waiting"
    port.exited |= {(n, 0) for n in ACTIVE}
    ep.tick(port.now())
    assert ep.state.value == "shutdown" and ("*", Shutdown("checkpoint and exit")) in port.sent
    port.alive = []
    ep.tick(port.now())
    assert port.exit_code == 75 and port.job.state == JobState.REQUEUED and not ep.done


def test_ending_gives_up_on_agents_that_do_not_go():
    port = FakePort()
    ep = Ending(port, "finished", JobState.FINISHED, 0, wait_workers=False)
    port.start(ep)
    ep.tick(port.now())
    assert port.exit_code is None
    port.clock += port.T.shutdown_s + 2.1
    ep.tick(port.now())
    assert port.exit_code == 0


# ---------------------------------------------------------------- the state machines

@pytest.mark.parametrize("cls", [PlannedSwap, Recovery, FullRestart, Ending])
def test_every_state_has_its_transitions(cls):
    assert set(cls.TRANSITIONS) == set(cls.State)
    assert all(t <= set(cls.State) for t in cls.TRANSITIONS.values())
    assert all(not cls.TRANSITIONS[s] for s in cls.FINAL)


def test_an_illegal_transition_raises():
    port = FakePort()
    ep = swap_on(port)
    with pytest.raises(TransitionError, match="preparing -> switched"):
        ep.to(SS.SWITCHED)


# ---------------------------------------------------------------- intake

def test_intake_one_migration_at_a_time():
    port = FakePort()
    intake = Intake(port.log.emit)
    for node in ("s1", "n2", "n1"):
        intake.handle(drain(node), port.nodes.nodes)
    assert intake.next(port.nodes.nodes) == [Migrate(Move(1, "n1", "s0"), drain("n1"))]
    assert sorted(intake.wanted_drains) == ["n2", "s1"]     # a drain arriving during a swap waits
    port.nodes.set_role("s0", Role.JOINING)
    assert intake.next(port.nodes.nodes) == [Migrate(Move(2, "n2", "s1"), drain("n2"))]


def test_intake_releases_drained_standbys_at_once_and_never_as_joiners():
    port = FakePort(standbys=["a0"])
    intake = Intake(port.log.emit)
    intake.handle(drain("a0"), port.nodes.nodes)
    intake.handle(drain("n1"), port.nodes.nodes)
    assert intake.next(port.nodes.nodes) == [ReleaseStandby("a0", "maintenance")]
    assert port.log.kinds("drain_deferred")[0]["node"] == "n1" and list(intake.wanted_drains) == ["n1"]
    intake.next(port.nodes.nodes)
    assert len(port.log.kinds("drain_deferred")) == 1           # said once


def test_intake_rejects_a_drain_of_a_failed_node():
    port = FakePort()
    port.down("n1")
    assert intake_handles(port, drain("n1")) == [] and port.log.kinds("request_rejected")


def intake_handles(port, req):
    return Intake(port.log.emit).handle(req, port.nodes.nodes)


# ---------------------------------------------------------------- the controller with fakes

class FakeLauncher:
    kind = "fake"

    def __init__(self):
        self.killed, self.released = [], []

    def kill(self, node):
        self.killed.append(node)

    def release(self, node):
        self.released.append(node)
        return "released"

    def poll(self):
        return []


@pytest.fixture
def ctl(tmp_path):
    from tm_slurm.controller.core import Controller
    from tm_slurm.controller.votekeys import VoteKeys
    c = Controller(Config(layout=LAYOUT), job_id="t", job_dir=tmp_path, command=["x"], cwd=".", env={},
                   nodes=ACTIVE + STANDBY, standbys=2, launcher=FakeLauncher())
    c.store, c.t_start = FakeStore(), 0.0
    c.vote_keys = VoteKeys(c.store, 0, 0)
    c.job.set(JobState.RUNNING)
    for n in STANDBY:
        c.nodes.set_ready(n)
    for rank in range(4):
        c.progress.add_rows(tuple(x for s in range(5) for x in (rank, s, 0.1, 0.05, 1.0, 1000.0 + s, False, 0.05)),
                            c.topo.world)
    yield c
    c.releases.close(5)
    c.records.close()


def test_controller_drain_during_a_swap_waits_for_it(ctl):
    ctl.handle_request(drain("n1"))
    ctl._drive_intake()
    (swap,) = ctl.live()
    assert isinstance(swap, PlannedSwap)
    ctl.handle_request(drain("n2"))
    ctl._drive_intake()
    assert ctl.live() == [swap] and "n2" in ctl.intake.wanted_drains
    swap.cancel("test")
    ctl._drive_intake()
    assert isinstance(ctl.live()[0], PlannedSwap) and ctl.live()[0].plan.leavers == ("n1",)


def test_controller_failure_during_phase_1_cancels_the_swap_and_recovers(ctl):
    ctl.handle_request(drain("n1"))
    ctl._drive_intake()
    ctl.fail("n3", "test")
    (rec,) = ctl.live()
    assert isinstance(rec, Recovery) and rec.slots() == {"n3": 3}
    assert ctl.nodes.nodes["n1"].role == Role.ACTIVE and "n1" in ctl.intake.wanted_drains
    assert ctl.launcher.killed == ["n3"]


def test_controller_restarts_everything_after_a_failure_with_the_restart_strategy(ctl):
    ctl.cfg = restart_cfg()
    ctl.fail("n2", "test")
    (restart,) = ctl.live()
    assert isinstance(restart, FullRestart) and restart.moves == [Move(2, "n2", "s0")]
    ctl.fail("n0", "test")
    assert ctl.live() == [restart] and restart.moves == [Move(2, "n2", "s0"), Move(0, "n0", "s1")]


def test_controller_with_the_restart_strategy_collects_no_aborts(ctl):
    ctl.cfg = restart_cfg()
    ctl._report("n0", 0, Aborted(0, 0, 5, broken=[], why="x", t=1.0))    # before the failure is seen
    assert ctl.live() == []
    ctl.fail("n2", "test")
    assert [type(e) for e in ctl.live()] == [FullRestart]


def test_controller_starts_collecting_on_a_rank_abort_and_ignores_stale_gens(ctl):
    ctl._report("n0", 0, Aborted(0, 0, 5, broken=[], why="x", t=1.0))
    (rec,) = ctl.live()
    assert rec.aborted == {0: []}
    ctl._report("n1", 0, Aborted(7, 1, 5, broken=[], why="x", t=1.0))   # another generation
    assert rec.aborted == {0: []}


def test_controller_releases_a_leaver_whose_ranks_moved(ctl):
    ctl.handle_request(drain("n1"))
    ctl._drive_intake()
    (swap,) = ctl.live()
    swap.to(SS.SWITCHING)
    swap.on_switched(6)
    ctl._agent_gone("n1", "bye")
    ctl.releases.close(5)                 # Slurm is asked on a thread of its own
    assert ctl.nodes.nodes["n1"].role == Role.RELEASED and ctl.launcher.released == ["n1"]
    assert not ctl.live()[0].done and ctl.nodes.nodes["s0"].role == Role.ACTIVE


def test_controller_gives_a_failed_node_back_to_slurm(ctl):
    ctl.fail("n2", "crash")
    assert ctl.launcher.killed == ["n2"] and ctl.nodes.nodes["n2"].role == Role.FAILED
    ctl.releases.close(5)
    assert ctl.launcher.released == ["n2"]


def test_controller_report_events_keep_their_fields(ctl):
    ctl._report("n1", 0, report("left", 0, 1, 7, plan=3, bytes=10, transfer_s=0.5, tensors=2))
    ev = [e for e in _events(ctl) if e["kind"] == "rank_left"][0]
    assert {k: ev[k] for k in ("node", "rank", "step", "plan", "bytes", "transfer_s", "tensors")} == \
        {"node": "n1", "rank": 1, "step": 7, "plan": 3, "bytes": 10, "transfer_s": 0.5, "tensors": 2}
    ctl._report("s0", 0, report("recovered", 0, 3, 5, plan=2, resume_s=0.1, donor=False))
    ev = [e for e in _events(ctl) if e["kind"] == "rank_recovered"][0]
    assert "bytes" not in ev and ev["donor"] is False


def _events(ctl):
    from tm_slurm import events, jobdir
    return list(events.read(jobdir.events_file(ctl.job_dir)))


# ---------------------------------------------------------------- reports and structure

def test_every_report_kind_builds_by_name_and_keeps_gen_rank_step():
    assert {"started", "standby_ready", "ready", "switched", "left", "joined", "aborted", "recover_built",
            "recovered", "finished", "crashed", "checkpoint", "exiting", "stopped", "hb"} <= set(REPORT_KINDS)
    rep = report("aborted", 3, 1, 9, broken=["dp/pp0.tp0"], why="x", t=2.0)
    assert isinstance(rep, Aborted) and (rep.gen, rep.rank, rep.step) == (3, 1, 9)
    assert rep.data() == {"broken": ["dp/pp0.tp0"], "why": "x", "t": 2.0}
    with pytest.raises(TypeError):
        report("ready", 0, 0, None, plan=1)         # a kind's fields are checked when built


def test_a_shard_written_again_while_it_is_verified_is_verified_again(ctl, monkeypatch, tmp_path):
    """A shrink at a periodic checkpoint's step: the last shard's report starts the verification,
    then a shard is reported again (rewritten). A verification that saw it half-written runs
    again instead of declaring the checkpoint invalid, whose remaining reports would never come."""
    import threading
    from tm_slurm import events as evlog, jobdir
    from tm_slurm.controller import records
    seen, go = [], threading.Event()

    def bad_shards(d, topo):
        seen.append(d)
        if len(seen) == 1:
            go.wait(5)
            return ["pp1.tp0"]                  # read while the shard was being rewritten
        return []
    monkeypatch.setattr(records.ckpt, "bad_shards", bad_shards)
    for rank in (0, 2):                         # one rank of each shard (pp0, pp1)
        ctl.records.checkpoint_written(40, rank)
    ctl.records.checkpoint_written(40, 2)       # pp1's shard again, while the first read runs
    go.set()
    for _ in range(500):
        ctl.records.poll_checkpoints()
        if ctl.checkpoint_done(40):
            break
        threading.Event().wait(0.01)
    assert ctl.checkpoint_done(40) and len(seen) == 2
    kinds = [e["kind"] for e in evlog.read(jobdir.events_file(tmp_path))]
    assert "checkpoint_complete" in kinds and "checkpoint_invalid" not in kinds
