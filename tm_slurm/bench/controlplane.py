"""`tm-slurm bench --control-plane`: the controller of an N-node x R-rank job, on this machine.

What is real and what is emulated (README "Control plane at scale"):
- The controller is the real `Controller` object with its real main-loop pass (`tick`: every
  link polled, every message opened and dispatched, liveness, pings, status.json), in this
  process, and its real store server (store/server.py), in its own, as a job has it.
- The N agents are emulated in this process: each has its own MPI communicator (a duplicate of
  COMM_SELF, so MPI's per-link polling and message path are real, but the links do not cross
  machines) and sends the real sealed Heartbeat of its R workers every
  timeouts.heartbeat_interval_s, with their step records, and reads what the controller sends.
  Their CPU is measured and taken out of the controller's.
- The vote's store part is real: N node leaders (one a node, as comm/nodevote.py has it), threads
  in a few processes with a store client each, call comm.vote.vote every step, with the real
  key clean-up. The node-local part (R ranks' MIN all-reduce and broadcast over loopback gloo)
  cannot run N times over on 2 cores: it is measured on one node of R ranks and added.
- Planning and announcing a swap and a recovery: the real planner on the N x R topology and the
  real announcement (the plan sealed and sent on every link, as the episodes do).
- The floor (bench/floor.py): the least exchange there can be between the N nodes and one central
  process on this machine, measured after the rest, which the vote and the controller cannot beat
  while every node's message goes through one process.
"""
from __future__ import annotations

import gc
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..messages import Heartbeat, WorkerInfo     # plain dataclasses: no torch, no MPI
from . import floor
from .metrics import percentile, process_cpu

HOST = "127.0.0.1"
SECRET_ENV = "TM_SLURM_BENCH_SECRET"


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Counted:
    """A store client that counts its calls (each a round trip but `append`, which is not answered,
    and those of a `pipeline`, which share one)."""

    def __init__(self, inner):
        self.inner, self.ops = inner, 0

    @property
    def timeout(self):
        return self.inner.timeout

    def _call(self, name, *a):
        self.ops += 1
        return getattr(self.inner, name)(*a)

    def set(self, *a): return self._call("set", *a)
    def get(self, *a): return self._call("get", *a)
    def compare_set(self, *a): return self._call("compare_set", *a)
    def multi_get(self, *a): return self._call("multi_get", *a)
    def append(self, *a): return self._call("append", *a)
    def add(self, *a): return self._call("add", *a)
    def check(self, *a): return self._call("check", *a)
    def wait(self, *a): return self._call("wait", *a)
    def delete_key(self, *a): return self._call("delete_key", *a)
    def peek(self, *a): return self._call("peek", *a)
    def pieces(self, *a): return self._call("pieces", *a)
    def wait_get(self, *a): return self._call("wait_get", *a)

    def pipeline(self, *calls):     # one round trip, its calls counted one by one (the store serves each)
        self.ops += len(calls)
        return self.inner.pipeline(*calls)


# ---------------------------------------------------------------- the voters (their own processes)
def voters_main(spec: dict) -> int:
    """A process of node leaders: one thread and one store client each. Prints "ready", waits for
    a line on stdin, votes `steps` steps, writes what it saw to spec["out"] as JSON."""
    from ..comm import vote as votes
    from ..control import auth
    from ..store.client import StoreClient
    keys = auth.Keys.derive(bytes.fromhex(os.environ[SECRET_ENV]))
    rpn, world, steps, step_s = spec["rpn"], spec["world"], spec["steps"], spec["step_s"]
    go, out, lock = threading.Event(), {}, threading.Lock()
    stores = {n: Counted(StoreClient(HOST, spec["port"], keys.store, spec["timeout_s"])) for n in spec["nodes"]}

    def leader(node: int) -> None:
        store = counted = stores[node]
        rank, times, cpu = node * rpn, [], 0.0
        go.wait()
        for step in range(steps):
            t0, c0 = time.monotonic(), time.thread_time()
            d = votes.vote(store, 0, step, world, True, spec["timeout_s"], rank, rpn)
            times.append((t0, time.monotonic(), d.commit))
            cpu += time.thread_time() - c0
            if rank == 0:
                counted.inner.set("bench/step", str(step))     # for the emulated agents' progress
            time.sleep(step_s)
        with lock:
            out[node] = {"times": times, "ops": counted.ops, "cpu_s": cpu}

    threads = [threading.Thread(target=leader, args=(n,), daemon=True) for n in spec["nodes"]]
    for t in threads:
        t.start()
    # a process holds many leaders, so one collection of its garbage would hold up all of them
    # at once (a 70 ms vote in one step of 80 at 64 nodes): a leader has a process of its own
    gc.disable()
    print("ready", flush=True)
    sys.stdin.readline()
    cpu0 = time.process_time()
    go.set()
    for t in threads:
        t.join()
    Path(spec["out"]).write_text(json.dumps({"leaders": out, "cpu_s": time.process_time() - cpu0}))
    return 0


# ---------------------------------------------------------------- the node-local part
def node_local(rpn: int, steps: int) -> list[float]:
    """Seconds a node vote takes for R ranks of one node (gloo MIN all-reduce, one store vote,
    broadcast), each rank a thread here: the part of a step's vote that stays on the node."""
    if rpn == 1:
        return [0.0]
    from ..comm.nodevote import NodeVote
    from ..control import auth
    from ..store import process as storeserver
    from ..store.client import StoreClient
    key = auth.Keys.derive(auth.new_secret()).store
    server = storeserver.spawn(key, HOST)
    lat: list[list[float]] = [[] for _ in range(steps)]
    bar = threading.Barrier(rpn)

    def rank(local: int) -> None:
        store = StoreClient(HOST, server.port, key, 30.0)
        nv = NodeVote(store, "bench", local, rpn, 30.0)
        for step in range(steps):
            bar.wait()
            t0 = time.monotonic()
            nv(store, 0, step, rpn, True, 30.0, local)
            lat[step].append(time.monotonic() - t0)

    ts = [threading.Thread(target=rank, args=(i,)) for i in range(rpn)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    server.close()
    return [max(x) for x in lat[5:]]         # the slowest rank of the node; warm-up left out


# ---------------------------------------------------------------- the controller side
class _Launcher:
    """The controller's launcher: nothing to start here, nothing ever ends."""
    kind = "bench"

    def start(self, node): pass
    def admitted(self, node, hello): pass
    def poll(self): return []
    def stop_all(self, grace=0.0): pass
    def replenish(self, ctl): return ""


class _NoAdmission:
    def announced(self): return False
    def refused(self, node, why): pass


class Agents:
    """N emulated agents: each sends its node's Heartbeat (R workers, their new step records) on
    its own communicator and drains what the controller sent it."""

    def __init__(self, ctl, mpi, rpn: int):
        from ..control import auth
        from ..control.mpi import Channel
        self.ctl, self.rpn = ctl, rpn
        self.ends: list[tuple[str, object, list[int]]] = []
        for name, n in sorted(ctl.nodes.nodes.items()):
            comm = mpi.COMM_SELF.Dup()
            up = Channel(comm, tags=(8, 7))          # the controller's end: receives 7, sends 8
            up.sealer = auth.Sealer(ctl.keys, ctl.job_id, "controller", peer=name)
            down = Channel(comm, tags=(7, 8))        # the agent's end
            down.sealer = auth.Sealer(ctl.keys, ctl.job_id, name, peer="controller")
            ctl.channels[name] = up
            ctl.last_hb[name] = time.monotonic()
            ranks = list(ctl.topo.slot_ranks(n.slot)) if n.slot is not None else []
            self.ends.append((name, down, ranks))
        self.seq = 0
        self.step = -1
        self.cpu = 0.0
        self.rounds = {"news": 0, "quiet": 0}    # beat rounds with new step records, and without
        self.beating = False     # a garbage collection now is the emulated agents', not the controller's

    def beat(self, step: int) -> None:
        t = time.thread_time()
        self.beating = True
        self.seq += 1
        now = time.time()
        new = range(self.step + 1, step + 1)
        self.step = max(self.step, step)
        full = self.seq == 1
        self.rounds["news" if new or full else "quiet"] += 1
        for name, ch, ranks in self.ends:
            # as agent.heartbeat: every worker once, then the steps its workers moved to and
            # the records of the steps they committed; nothing when no step is new
            slots = list(enumerate(ranks or [None] * self.rpn))
            infos = tuple(WorkerInfo(i, 1000 + i, r, step + 1, step, True) for i, r in slots) if full else ()
            moves = () if full or not new else tuple(x for i, _ in slots for x in (i, step + 1, step))
            records = tuple(x for _, r in slots if r is not None for s in new
                            for x in (r, s, 0.2, 0.2, 1.0, now, s == 0, 0.15))
            ch.send(Heartbeat(name, self.seq, now, infos, full, moves, records))
            ch.poll(limit=1 << 20)
        self.beating = False
        self.cpu += time.thread_time() - t


def _cpu_of(fn) -> float:
    t = time.thread_time()
    fn()
    return time.thread_time() - t


class _GcTime:
    """Seconds this process spent in garbage collection until `stop`, but for the collections
    that start while `skip()` is true (the emulated agents', whose CPU is not the controller's)."""

    def __init__(self, skip):
        self.total, self._t0, self._skip = 0.0, None, skip
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, _info) -> None:
        if phase == "start":
            self._t0 = None if self._skip() else time.perf_counter()
        elif self._t0 is not None:
            self.total += time.perf_counter() - self._t0

    def stop(self) -> None:
        gc.callbacks.remove(self._cb)


def _topology(nodes: int, rpn: int):
    from .. import config as cfgmod
    pp = 4 if nodes % 4 == 0 and nodes >= 8 else 1
    return cfgmod.Layout(dp=nodes // pp, pp=pp, tp=rpn, ranks_per_node=rpn)


def measure(nodes: int, rpn: int, steps: int, step_s: float, heartbeat_s: float | None = None, procs: int = 4,
            say=lambda *a: None) -> dict:
    from .. import config as cfgmod
    from .. import heap
    from ..control import auth
    from ..control.mpi import POLL_BUSY_S, POLL_IDLE_S, mpi
    from ..controller.core import Controller
    from .. import jobdir
    from ..messages import Move, Ping, Prepare, Recover, ToWorkers
    from ..planner import plan_planned, plan_recovery
    from ..roles import JobState, Role

    local = node_local(rpn, 105)
    say(f"  node-local vote of {rpn} ranks: p50 {statistics.median(local) * 1e3:.2f} ms")
    layout = _topology(nodes, rpn)
    cfg = cfgmod.Config(layout=layout)
    if heartbeat_s is not None:
        from dataclasses import replace
        cfg = replace(cfg, timeouts=replace(cfg.timeouts, heartbeat_interval_s=heartbeat_s,
                                            heartbeat_timeout_s=max(cfg.timeouts.heartbeat_timeout_s, 10 * heartbeat_s)))
    secret = auth.new_secret()
    work = Path(tempfile.mkdtemp(prefix="tm-cp-"))
    names = [f"node{i:04d}" for i in range(nodes + 1)]
    rss0 = _rss_mb()
    ctl = Controller(cfg, job_id="cp-bench", job_dir=work / "job", command=["true"], cwd=str(work), env={},
                     nodes=names, standbys=1, launcher=_Launcher(), secret=secret)
    ctl.open_store()
    ctl.admission = _NoAdmission()
    ctl.t_start = time.monotonic()
    world = layout.world
    split = [list(range(nodes))[i::procs] for i in range(procs)]
    env = dict(os.environ, **{SECRET_ENV: secret.hex()})
    kids = []
    for i, part in enumerate(split):
        if not part:
            continue
        spec = {"port": ctl.store_addr[1], "nodes": part, "rpn": rpn, "world": world, "steps": steps,
                "step_s": step_s, "timeout_s": 60.0, "out": str(work / f"voters{i}.json")}
        kids.append(subprocess.Popen([sys.executable, "-m", "tm_slurm.bench.controlplane", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
    try:
        # bounded: late in a session on this (gVisor) machine every TCP connect past the first
        # few dozen took 250 ms, in one process too, so 1,024 clients took minutes
        wait = 120 + 0.3 * nodes
        for k in kids:
            if not select.select([k.stdout], [], [], wait)[0] or k.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a voter process did not connect its store clients within {wait:.0f} s")
        MPI = mpi()
        agents = Agents(ctl, MPI, rpn)
        ctl.job.set(JobState.RUNNING)
        heap.freeze_startup()                  # as reports.on_started does when every rank started
        rss_start = _rss_mb()
        say(f"  {nodes} nodes x {rpn}: controller up ({rss_start:.0f} MB), voting {steps} steps ...")
        raw, store_pid = ctl.store, ctl.store_server.proc.pid
        for k in kids:
            k.stdin.write("go\n")
            k.stdin.flush()
        gc_s = _GcTime(lambda: agents.beating)
        cpu0, main0, t0 = process_cpu(), time.thread_time(), time.monotonic()
        store_cpu0 = process_cpu(store_pid)
        next_beat = 0.0
        while any(k.poll() is None for k in kids):
            now = time.monotonic()
            if now >= next_beat:
                at = int(raw.get("bench/step")) if raw.check(["bench/step"]) else -1
                agents.beat(at)
                next_beat = now + cfg.timeouts.heartbeat_interval_s
            busy = ctl.tick()
            time.sleep(POLL_BUSY_S if busy else POLL_IDLE_S)
        wall = time.monotonic() - t0
        cpu, main = process_cpu() - cpu0 - agents.cpu, time.thread_time() - main0 - agents.cpu
        store_cpu = process_cpu(store_pid) - store_cpu0
        gc_s.stop()
        rss_end = _rss_mb()
        if any(k.returncode for k in kids):
            raise RuntimeError(f"a voter process failed: {[k.returncode for k in kids]}")
        failed = [n for n, x in ctl.nodes.nodes.items() if x.role == Role.FAILED]
        # one heartbeat round, opened and dispatched on its own: the cost per agent of a beat
        # with a step's records, and of one that has nothing new (agent.heartbeat names no worker)
        rounds = dict(agents.rounds)

        def beat_round(step: int) -> float:
            agents.beat(step)
            t = time.thread_time()
            for node, ch in ctl.channels.items():
                for m in ch.poll():
                    ctl._dispatch(node, m)
            return (time.thread_time() - t) / nodes
        hb_s, hb_quiet_s = beat_round(agents.step + 1), beat_round(agents.step)
        # per beat, as the run's rounds mixed them
        hb_mean_s = (hb_s * rounds["news"] + hb_quiet_s * rounds["quiet"]) / max(1, sum(rounds.values()))
        # what the rest of the loop's periodic work costs once (the least of three: a garbage
        # collection that lands in one is counted apart): a ping to every link, status.json
        # rewritten and touched
        ping_s = min(_cpu_of(lambda: ctl.broadcast(Ping(0, time.time()))) for _ in range(3))
        status_s = min(_cpu_of(ctl.records.write_status) for _ in range(3))
        touch_s = min(_cpu_of(lambda: os.utime(jobdir.status_file(ctl.job_dir))) for _ in range(3))
        # a swap and a recovery of node 1 onto the standby, planned and announced on every link
        slot, joiner = 1, names[-1]
        t = time.perf_counter()
        plan = plan_planned(ctl.topo, ctl.next_plan_id(), 0, 1, [Move(slot, names[slot], joiner)], "bench")
        ctl.broadcast(ToWorkers(Prepare(plan)))
        swap_s = time.perf_counter() - t
        t = time.perf_counter()
        alive = [r for r in range(world) if r not in ctl.topo.slot_ranks(slot)]
        rplan = plan_recovery(ctl.topo, ctl.next_plan_id(), 0, 2, [Move(slot, names[slot], joiner)], alive,
                              (), steps)
        ctl.broadcast(ToWorkers(Recover(rplan)))
        recovery_s = time.perf_counter() - t
        store_keys = raw.num_keys()
        vote_keys_ops = ctl.vote_keys.ops
    finally:
        for k in kids:
            if k.poll() is None:
                k.kill()
            k.wait()
        ctl.store_server.close()
    seen, voters_cpu = {}, 0.0
    for f in work.glob("voters*.json"):
        got = json.loads(f.read_text())
        seen.update(got["leaders"])
        voters_cpu += got["cpu_s"]
    lat, skew, aborted = [], [], 0
    for s in range(steps):
        ts = [v["times"][s] for v in seen.values()]
        aborted += sum(1 for x in ts if not x[2])
        lat.append(max(x[1] for x in ts) - max(x[0] for x in ts))
        skew.append(max(x[0] for x in ts) - min(x[0] for x in ts))
    lat = lat[5:]                               # connections and caches warm up
    # the leaders' and the controller's (it deletes old steps' vote keys: controller/votekeys.py)
    ops = (sum(v["ops"] for v in seen.values()) + vote_keys_ops) / steps
    lp50, lp99 = statistics.median(local), percentile(local, 0.99)
    # a step's whole vote is its node-local round and its store round; the two are measured
    # apart, so each step's store latency is paired with a node-local round (a percentile of
    # the sums, not a sum of percentiles: their tails need not coincide)
    whole = [x + local[i % len(local)] for i, x in enumerate(lat)]
    say(f"  the floor: one bare exchange between {nodes} nodes and one process ...")
    least = floor.measure(nodes)
    out = {
        "nodes": nodes, "ranks_per_node": rpn, "world": world, "steps": steps, "step_s": step_s,
        "layout": {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp},
        "vote_p50_s": round(percentile(whole, 0.5), 5), "vote_p99_s": round(percentile(whole, 0.99), 5),
        "store_vote_p50_s": round(percentile(lat, 0.5), 5), "store_vote_p99_s": round(percentile(lat, 0.99), 5),
        "node_local_vote_p50_s": round(lp50, 5), "node_local_vote_p99_s": round(lp99, 5),
        "arrival_skew_p50_s": round(statistics.median(skew), 5),
        # the emulated leaders' own CPU (their store clients, the vote's Python, their sleeps'
        # wake-ups), on the same cores as the store server: what bounds the vote's latency here
        "voters_cpu_per_step_s": round(voters_cpu / steps, 5),
        "voters_vote_cpu_per_step_s": round(sum(v["cpu_s"] for v in seen.values()) / steps, 5),
        # the centre: the controller's process and its store server's
        "controller_cpu_per_step_s": round((cpu + store_cpu) / steps, 5),
        "controller_loop_cpu_per_step_s": round(main / steps, 5),
        "store_server_cpu_per_step_s": round(store_cpu / steps, 5),
        "heartbeat_s": round(hb_s, 7), "heartbeat_quiet_s": round(hb_quiet_s, 7),
        "heartbeat_rounds": rounds,
        "heartbeat_cpu_per_agent_s_per_s": round(hb_mean_s / cfg.timeouts.heartbeat_interval_s, 6),
        # the controller's CPU a second by what it does: every agent's heartbeats opened and
        # dispatched, the pings, status.json; the rest is the loop's own passes
        "controller_cpu_per_s_by_part": {
            "heartbeats": round(hb_mean_s * nodes / cfg.timeouts.heartbeat_interval_s, 5),
            "pings": round(ping_s / cfg.timeouts.ping_interval_s, 5),
            "status_json": round(status_s / jobdir.snapshot_every_s(nodes) + touch_s / jobdir.STATUS_EVERY_S, 5),
            # Python's collector, in the controller's own work (the agents' beats left out)
            "garbage_collection": round(gc_s.total / wall, 5)},
        "store_ops_per_step": round(ops, 1), "store_keys_end": store_keys,
        "swap_plan_s": round(swap_s, 5), "recovery_plan_s": round(recovery_s, 5),
        "groups_rebuilt": {"swap": len(plan.builds), "recovery": len(rplan.builds)},
        "rss_before_controller_mb": round(rss0, 1),
        "rss_start_mb": round(rss_start, 1), "rss_end_mb": round(rss_end, 1),
        "wall_s": round(wall, 2), "aborted_votes": aborted, "nodes_failed": failed,
        "heartbeat_interval_s": cfg.timeouts.heartbeat_interval_s,
        **least,
    }
    return out


def table(runs: list[dict]) -> str:
    cols = [("nodes", "nodes", "{}"), ("vote_p50_s", "vote p50 ms", "{:.2f}"), ("vote_p99_s", "p99 ms", "{:.2f}"),
            ("floor_exchange_p99_s", "floor p99 ms", "{:.2f}"),
            ("controller_cpu_per_step_s", "ctl CPU/step ms", "{:.2f}"),
            ("floor_central_cpu_per_round_s", "floor CPU ms", "{:.2f}"),
            ("store_ops_per_step", "store ops/step", "{:.0f}"), ("heartbeat_s", "hb us", "{:.1f}"),
            ("swap_plan_s", "swap plan ms", "{:.2f}"), ("recovery_plan_s", "recovery plan ms", "{:.2f}"),
            ("rss_start_mb", "RSS start MB", "{:.0f}"), ("rss_end_mb", "end MB", "{:.0f}")]
    scale = {"vote_p50_s": 1e3, "vote_p99_s": 1e3, "controller_cpu_per_step_s": 1e3, "heartbeat_s": 1e6,
             "floor_exchange_p99_s": 1e3, "floor_central_cpu_per_round_s": 1e3,
             "swap_plan_s": 1e3, "recovery_plan_s": 1e3}
    lines = ["  ".join(f"{h:>{max(len(h), 6)}s}" for _, h, _ in cols)]
    for r in runs:
        lines.append("  ".join(f"{f.format(r[k] * scale.get(k, 1)):>{max(len(h), 6)}s}" for k, h, f in cols))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(voters_main(json.loads(sys.argv[1])))
