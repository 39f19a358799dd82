"""One benchmark sample: the example job locally, one interruption, one strategy.

tm_slurm             warm general standby (sandbox), two-phase delta swap
tm_slurm-no-standby  the same swap, but the joiner's process starts only after the event (cold)
elastic-restart      torchrun-style: every worker restarted in place from the last checkpoint
                     (the runtime's `recovery.strategy: restart`), a spare node cold
torchft              the ddp example as a torchft job (bench/peers.py): the others train on
                     with fewer replicas while the lost one restarts cold and heals from a peer
nvrx                 the ddp example under NVIDIA's ft_launcher (bench/peers.py): every worker
                     restarted in place, resumed from the last checkpoint
checkpoint-restart   what `sbatch --requeue` or a restart loop does: the whole job goes down,
                     a new one starts (fresh processes, every group re-initialised) and resumes
                     from the last checkpoint (planned: one written on request just before)

A hang is noticed by the restart strategies only when a collective times out (their watchdog is
the collective timeout); tm_slurm's agents notice a silent node after the heartbeat timeout and
fence it. Every strategy checkpoints every CKPT_EVERY steps, so they pay the same for it.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import events as evlog
from .. import jobdir
from ..controller.requests import submit
from ..demo import EXAMPLES, Example, JobRun
from . import metrics, peers

STRATEGIES = ("tm_slurm", "tm_slurm-no-standby", "checkpoint-restart", "elastic-restart", *peers.PEERS)
SCENARIOS = ("planned", "unplanned", "hang")
GPT = EXAMPLES["gpt"]            # interrupted at node2: rank 1, first stage, DP replica 1
CKPT_EVERY = 10
MODEL: list[str] = []             # the example job as it is (~0.1-0.2 s a step here)


@dataclass(frozen=True)
class Sample:
    scenario: str
    strategy: str
    downtime_s: float
    lost_steps: int
    steady_step_s: float
    job_dir: str
    detail: dict


def _cold(strategy: str, ex: Example) -> list[str]:
    """A joiner started after the event. A stock-loop script (tm_slurm.init) still runs its first
    steps locally before it joins (its DDP must have settled its buckets): it rehearses, late."""
    if strategy == "tm_slurm":
        return []
    return ["standby.prestart=false"] + (["standby.sandbox=false"] if ex.api == "run" else [])


def _sets(strategy: str, scenario: str, hang_timeout: float, ex: Example) -> list[str]:
    # the live-hang watchdog (timeouts.hang_timeout_s) must come before the collective timeout
    s = [f"checkpoint.every_steps={CKPT_EVERY}", f"timeouts.collective_timeout_s={hang_timeout}",
         f"timeouts.hang_timeout_s={hang_timeout - 0.25}", *_cold(strategy, ex)]
    if strategy == "elastic-restart":
        s.append("recovery.strategy=restart")
        if scenario == "hang":   # no heartbeat watchdog: the collective timeout is the detector
            s += [f"timeouts.heartbeat_timeout_s={hang_timeout - 0.5}",
                  f"timeouts.worker_heartbeat_timeout_s={hang_timeout - 0.5}",
                  f"timeouts.controller_timeout_s={hang_timeout + 10}",
                  f"timeouts.rebuild_timeout_s={hang_timeout + 5}"]
    return s


def _steps(job: Path) -> list[metrics.Step]:
    out = []
    for line in jobdir.steps_file(job).read_text().splitlines():
        d = json.loads(line)
        out.append(metrics.Step(d["step"], d["wall"], d["dur_s"]))
    return sorted(out, key=lambda s: s.wall)


def _verb(scenario: str) -> str:
    return {"planned": "drain", "unplanned": "kill", "hang": "hang"}[scenario]


def run(root: Path, scenario: str, strategy: str, steps: int, at_step: int, hang_timeout: float,
        script_args: list[str] = (), timeout: float = 600, ex: Example = GPT, comm: str = "") -> Sample:
    """`comm`: the runtime's comm.backend (default: auto); the other strategies have their own."""
    job = root / f"{scenario}-{strategy}-{time.strftime('%H%M%S')}"
    args = [*MODEL, *script_args]
    if strategy == "checkpoint-restart":
        t_event, info = _checkpoint_restart(job, scenario, steps, at_step, hang_timeout, args, timeout, ex)
    elif strategy in peers.PEERS:
        t_event, info = peers.run(job, scenario, strategy, steps, at_step, hang_timeout, args, timeout, ex,
                                  CKPT_EVERY)
    else:
        r = JobRun(job, f"{ex.active}+1", steps, [(at_step, _verb(scenario), ex.drain)], script_args=args,
                   sets=[*_sets(strategy, scenario, hang_timeout, ex), *([f"comm.backend={comm}"] if comm else [])],
                   extra_args=ex.args(), script=ex.script)
        rc = r.run(timeout)
        if rc != 0 or not r.done:
            raise RuntimeError(f"{strategy}/{scenario}: run failed (exit {rc}); see {job}")
        t_event, info = r.done[0]["t"], {"interruptions": r.result()["interruptions"]}
    (job / "bench-sample.json").write_text(json.dumps({"scenario": scenario, "strategy": strategy,
                                                       "t_event": t_event, **info}))
    try:
        return analyze(job)
    except ValueError as e:
        raise RuntimeError(f"{strategy}/{scenario}: {e}: the job ended before the interruption took "
                           f"effect (it waits for warm standbys); raise --steps; see {job}") from e


DONE_KINDS = ("swap_complete", "recovery_complete", "restart_complete", "shrink_complete")


def _done_at(job: Path, t_event: float) -> float | None:
    """When the runtime said the interruption was over (None: it did not say, e.g. a new job)."""
    f = jobdir.events_file(job)
    ts = [e["ts"] for e in (evlog.read(f) if f.exists() else ()) if e["kind"] in DONE_KINDS and e["ts"] > t_event]
    return min(ts, default=None)


def analyze(job: Path) -> Sample:
    """A sample from its job directory (`bench-sample.json` says what was done when)."""
    meta = json.loads((job / "bench-sample.json").read_text())
    t_done = meta["t_done"] if "t_done" in meta else _done_at(job, meta["t_event"])
    dt, d = metrics.downtime(_steps(job), meta["t_event"], t_done=t_done)
    info = {k: v for k, v in meta.items() if k not in ("scenario", "strategy", "t_event", "t_done")}
    return Sample(meta["scenario"], meta["strategy"], dt, d["lost_steps"], d["steady_step_s"], str(job),
                  {**d, **info})


def _checkpoint_restart(job: Path, scenario: str, steps: int, at_step: int, hang_timeout: float,
                        args: list[str], timeout: float, ex: Example) -> tuple[float, dict]:
    """Job A until the event; the event takes it down (a crash kills the job; a drain asks for a
    checkpoint and an exit; a hang kills it when the collective timeout fires); job B, new
    processes in the same job directory, resumes from the newest valid checkpoint."""
    sets = [f"checkpoint.every_steps={CKPT_EVERY}", "standby.count=0"]
    when = {}

    def event(job_dir: Path) -> None:
        when["t"] = time.time()
        if scenario == "planned":
            submit(job_dir, "checkpoint", None, "maintenance: save and restart", exit=True)
            return
        from ..launch.local import fail
        when["t"] = fail(job_dir, ex.drain, _verb(scenario))
        if scenario == "hang":
            time.sleep(hang_timeout)     # until a collective times out and the job dies
        a.kill()

    a = JobRun(job, f"{ex.active}+0", steps, [(at_step, event, ex.drain)], script_args=args, sets=sets,
               extra_args=ex.args(), script=ex.script)
    rc = a.run(timeout)
    if "t" not in when or rc == 0:
        raise RuntimeError(f"checkpoint-restart/{scenario}: job A ended (exit {rc}) before the event; see {job}")
    b = JobRun(job, f"{ex.active}+0", steps, [], extra_args=[*ex.args(), "--resume"], script_args=args,
               sets=sets, script=ex.script)
    rc = b.run(timeout)
    if rc != 0:
        raise RuntimeError(f"checkpoint-restart/{scenario}: the restarted job failed (exit {rc}); see {job}")
    return when["t"], {"first_exit": a.proc.returncode}


def plain_steady(root: Path, steps: int, script_args: list[str], timeout: float = 600,
                 ex: Example = GPT) -> tuple[float, dict]:
    """The same script without the runtime, its processes launched like torchrun would."""
    import os
    import statistics
    import subprocess
    out = root / f"plain-{time.strftime('%H%M%S')}"
    port = 0            # rank 0 picks one and tells the others (worker/plain.py)
    procs = []
    out.mkdir(parents=True)
    per_node = ex.layout.get("ranks_per_node", 1)
    world = ex.active * per_node
    lay = {f"TM_SLURM_{k.upper()}": str(v) for k, v in ex.layout.items() if k != "ranks_per_node"}
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r % per_node),
                   MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), TM_SLURM_PLAIN_OUT=str(out), **lay)
        with open(out / f"rank{r}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(ex.script), "--steps", str(steps), *MODEL,
                                           *script_args], env=env, stdout=log, stderr=subprocess.STDOUT))
    for r, p in enumerate(procs):
        if p.wait(timeout) != 0:
            raise RuntimeError(f"plain run failed (exit {p.returncode}): "
                               f"{(out / f'rank{r}.log').read_text()[-1500:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    per_step = [max(x["step_s"][i] for x in ranks) for i in range(steps)][3:]
    return statistics.median(per_step), {"digests": {str(x["rank"]): x["digest"] for x in ranks},
                                         "mean_step_s": statistics.fmean(per_step)}


def runtime_steady(root: Path, steps: int, script_args: list[str], timeout: float = 600,
                   ex: Example = GPT, comm: str = "") -> tuple[float, dict]:
    """The same script under tm-slurm (its active nodes, no interruption). Its info holds
    `cpu_ms_per_step`: what each kind of process of the job spent a step, in the steady middle
    of the run (`steady_cpu`)."""
    import statistics
    import threading
    job = root / f"steady-{time.strftime('%H%M%S')}"
    r = JobRun(job, f"{ex.active}+0", steps, [], script_args=[*MODEL, *script_args],
               sets=["standby.count=0", "checkpoint.every_steps=0", *([f"comm.backend={comm}"] if comm else [])],
               extra_args=ex.args(), script=ex.script)
    cpu: dict = {}
    t = threading.Thread(target=steady_cpu, args=(r, job, steps, ex, cpu), daemon=True)
    t.start()
    if r.run(timeout) != 0:
        raise RuntimeError(f"steady run failed; see {job}")
    t.join(5)
    # the runtime's own per-step time (compute to commit), like the plain run's
    durs = [s.dur_s for s in _steps(job)][3:]
    return statistics.median(durs), {"digests": r.result()["digests"], "mean_step_s": statistics.fmean(durs),
                                     "cpu_ms_per_step": cpu}


def _role(argv: list[str], launcher: int, pid: int, script: str) -> str:
    """Which of the job's processes a command line is."""
    if pid == launcher:
        return "launcher"
    if len(argv) > 1 and argv[1].endswith(script):      # python script.py (the others name it later)
        return "worker"
    head = argv[1:4]
    if "tm_slurm.control.pmi" in head:
        return "pmi"
    if "tm_slurm.store.process" in head:
        return "store"
    if "agent" in head:
        return "agent"
    return "controller" if "run" in head else "other"


def steady_cpu(r: JobRun, job: Path, steps: int, ex: Example, out: dict) -> None:
    """CPU milliseconds a step of each kind of the job's processes (all workers together, all
    agents together), between the commits of steps/4 and 3*steps/4 as the steps log shows them
    (the log lags by a heartbeat; both ends alike): a runtime's process that wakes often shows here.
    Fills `out`; leaves it empty if the run ended first."""
    seen = {"at": 0, "lines": 0}

    def logged() -> int:          # read on from where it was: the bench shares the job's cores
        try:
            with open(jobdir.steps_file(job), "rb") as f:
                f.seek(seen["at"])
                more = f.read()
        except OSError:
            return 0
        seen["at"] += len(more)
        seen["lines"] += more.count(b"\n")
        return seen["lines"]

    def sample() -> dict[int, tuple[str, float]]:
        return {pid: (_role(argv, r.proc.pid, pid, ex.script.name), cpu)
                for pid, (argv, cpu) in metrics.tree_cpu(r.proc.pid).items()}

    marks, got, end = (steps // 4, 3 * steps // 4), [], time.monotonic() + 60
    while getattr(r, "proc", None) is None and time.monotonic() < end:
        time.sleep(0.05)
    while getattr(r, "proc", None) is not None and len(got) < 2 and r.proc.poll() is None:
        n = logged()
        if n >= marks[len(got)]:
            got.append((n, sample()))
        time.sleep(0.05)
    if len(got) == 2 and got[1][0] > got[0][0]:
        (n0, a), (n1, b) = got
        by: dict[str, float] = {}
        for pid, (role, cpu) in b.items():          # a process in both samples
            if pid in a:
                role = a[pid][0] if role == "other" else role     # a command line read mid-change
                by[role] = by.get(role, 0.0) + cpu - a[pid][1]
        out.update({k: round(v * 1e3 / (n1 - n0), 4) for k, v in sorted(by.items())})
