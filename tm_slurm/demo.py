"""`tm-slurm demo`: the one-command tour.

Runs an example job (`--example`: sbatch/gpt_example.py, DP=2 x PP=2, by default; or the stock
DDP loop, sbatch/ddp_example.py) locally twice through the real CLI:
once undisturbed, once with a node drained (planned) and/or killed (unplanned) mid-run, then
prints the timeline of what happened and checks that both runs end bit-identical.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import events as evlog
from . import jobdir
from .controller.requests import submit
from .launch.local import NOTHING_TO_GIVE_BACK, fail, nodes_file
from .roles import JOB_TRANSITIONS, JobState

SBATCH = Path(__file__).resolve().parent.parent / "sbatch"
# the example's smallest model (the tests, the soak): startup and the control plane dominate a step
TINY_MODEL = ["--vocab", "64", "--dim", "32", "--layers", "4", "--heads", "2", "--seq", "16", "--batch", "4"]
# compiling every role in the sandbox takes a standby ~80 s here (while the active ranks compile
# too): a run with --compile this long still has its interruptions after that
COMPILE_STEPS = 800


class Example:
    """A job the demo and the bench can run: its script, which API it uses (`run`: build/step,
    `init`: a stock loop), its layout, and which nodes its scenarios interrupt."""

    def __init__(self, name: str, script: str, api: str, layout: dict, what: str, active: int, drain: str,
                 kill: str, steps: int):
        self.name, self.script, self.api, self.layout, self.what = name, SBATCH / script, api, layout, what
        self.active, self.drain, self.kill, self.steps = active, drain, kill, steps

    def args(self) -> list[str]:
        return [a for k, v in self.layout.items() for a in (f"--{k.replace('_', '-')}", str(v))]


EXAMPLES = {
    # node2 holds rank 1 (first stage, dp 1); node4 holds rank 3 (last stage, dp 1)
    "gpt": Example("gpt", "gpt_example.py", "run", {"dp": 2, "pp": 2}, "example GPT, DP=2 x PP=2 (the low-level API)",
                   4, "node2", "node4", 60),
    "ddp": Example("ddp", "ddp_example.py", "init", {"dp": 2, "pp": 1}, "stock DDP loop, DP=2 (tm_slurm.init)",
                   2, "node1", "node2", 400),   # ~10 ms steps: the kill comes after the swap
    # FSDP2 over the DP group: the drained node's shard moves to the joiner; the killed one's is
    # nowhere else, so every rank resumes from the checkpoint
    "fsdp": Example("fsdp", "llama_fsdp.py", "init", {"dp": 2, "pp": 1, "dp_shard": 2},
                    "Llama-style decoder, FSDP2 over 2 shards (tm_slurm.init)", 2, "node1", "node2", 300),
    # a Llama-style decoder, HSDP 2 replicas x 2 shards, two ranks a node: node1 holds replica
    # 0's two shards; the killed node2's shards come back from replica 0
    "llama": Example("llama", "llama_fsdp.py", "init", {"dp": 4, "pp": 1, "dp_shard": 2, "ranks_per_node": 2},
                     "Llama-style decoder, FSDP2 HSDP 2 x 2, two ranks a node (tm_slurm.init)",
                     2, "node1", "node2", 300),
}


def example_paths() -> tuple[Path, Path]:
    """The example job and its config, next to the job scripts in the source tree."""
    script, cfg = SBATCH / "gpt_example.py", SBATCH / "example.yaml"
    if not script.exists():
        raise SystemExit(f"the example job is not at {script}: run the demo from a source checkout "
                         "(pip install -e .)")
    return script, cfg


class Job:
    """One `tm-slurm run` through the real CLI (`argv`), with actions injected when they are due
    (`due`): [(when, verb, node)], a verb being `drain`, a `tm-slurm fail` mode, or a function of
    the job directory."""

    def __init__(self, job_dir: Path, argv: list[str], actions: list[tuple[int | str, str, str]],
                 env: dict[str, str] | None = None, reason: str = "demo: maintenance"):
        self.job_dir, self.argv, self.actions, self.env, self.reason = job_dir, argv, list(actions), env, reason
        self.done: list[dict] = []

    def run(self, timeout: float) -> int:
        self.job_dir.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.out_file(), "w")
        proc = self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True,
                                            env=None if self.env is None else {**os.environ, **self.env})
        end = time.monotonic() + timeout
        pending = list(self.actions)
        try:
            while proc.poll() is None:
                if time.monotonic() > end:
                    self._dump_stacks()
                    proc.kill()
                    raise TimeoutError(f"job {self.job_dir} did not finish within {timeout}s")
                if pending and due(self.job_dir, pending[0][0]):
                    _, verb, node = pending.pop(0)
                    self._act(verb, node, progress(self.job_dir)[0])
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            log.close()
        return proc.returncode

    def out_file(self) -> Path:
        """The launcher's output (stdout and stderr), next to the job directory."""
        return self.job_dir.parent / f"{self.job_dir.name}.out"

    def missing(self) -> list[tuple[int | str, str, str]]:
        """The actions the job ended before."""
        return self.actions[len(self.done):]

    def _dump_stacks(self) -> None:
        """A stuck job: ask the controller for its thread stacks (into the run's .out file)."""
        try:
            pid = json.loads(jobdir.status_file(self.job_dir).read_text())["pid"]
            os.kill(pid, signal.SIGUSR2)
            time.sleep(1.0)
        except (OSError, ValueError, KeyError):
            pass

    def _act(self, verb, node: str, step: int) -> None:
        """What `tm-slurm drain` / `tm-slurm fail` do, in process (so the event's time is exact)."""
        t = time.time()
        if callable(verb):                      # tests and the benchmark: anything else
            verb(self.job_dir)
            name = verb.__name__
        elif verb == "drain":
            submit(self.job_dir, "drain", node, self.reason)
            name = verb
        else:
            t = fail(self.job_dir, node, verb)
            name = verb
        self.done.append({"verb": name, "node": node, "at_step": step, "t": t})

    def kill(self) -> None:
        """Everything of the job at once, as a crash that takes the whole job down would: the
        controller's session and every node's process group."""
        for pg in [self.proc.pid, *(n["pgid"] for n in _local_nodes(self.job_dir).values())]:
            try:
                os.killpg(pg, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def result(self) -> dict:
        return json.loads(jobdir.result_file(self.job_dir).read_text())


class JobRun(Job):
    """The example (or `script`), run with `--steps` and the example's config."""

    def __init__(self, job_dir: Path, local: str, steps: int, actions: list[tuple[int | str, str, str]],
                 extra_args: list[str] = (), script_args: list[str] = (), config: Path | None = None,
                 sets: list[str] = (), env: dict[str, str] | None = None, script: Path | None = None):
        example, cfg = example_paths()
        argv = [sys.executable, "-m", "tm_slurm", "run", "--local", local, "--config",
                str(config or cfg), "--job-dir", str(job_dir), *extra_args]
        for s in sets:
            argv += ["--set", s]
        argv += ["--", sys.executable, str(script or example), "--steps", str(steps), *script_args]
        super().__init__(job_dir, argv, actions, env)


def _local_nodes(job: Path) -> dict:
    try:
        return json.loads(nodes_file(job).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def due(job: Path, when) -> bool:
    """Whether an action is due: `when` is a step (reached once every standby is warm), an event
    (`kind`, or `kind@node` for one about that node) that has appeared in the log, or a function
    of the job directory."""
    if callable(when):
        return when(job)
    if isinstance(when, str):
        return seen(job, when)
    step, ready = progress(job)
    return ready and step is not None and step >= when


def seen(job: Path, what: str) -> bool:
    """An event of kind `what`, or `kind@node` for one about that node."""
    kind, _, node = what.partition("@")
    return any(e["kind"] == kind and (not node or e["node"] == node) for e in evlog.read(jobdir.events_file(job)))


# the states a job is ending in: stopping, and where the state machine goes from there
ENDING = {s.value for s in (JobState.STOPPING, *JOB_TRANSITIONS[JobState.STOPPING])}


def progress(job: Path) -> tuple[int | None, bool]:
    """(committed step, ready for an event): events are injected once standbys are warm, as they
    would be long before a maintenance drain on a real cluster, and never into a job that is
    ending (it would not act on them)."""
    try:
        st = json.loads(jobdir.status_file(job).read_text())
    except (OSError, json.JSONDecodeError):
        return None, False
    warm = all(n["ready"] for n in st["nodes"].values() if n["role"] == "STANDBY")
    return st.get("committed_step"), warm and st.get("state") not in ENDING


def scenario_actions(scenario: str, steps: int, ex: Example = EXAMPLES["gpt"]) -> tuple[str, list[tuple[int | str, str, str]]]:
    """(--local spec, [(at step or after an event kind, action, node)]). In the combined scenario
    the kill waits for the drain's swap to complete: a standby that warmed up late would
    otherwise put both events into the same few steps."""
    a = max(3, steps // 4)
    if scenario == "planned":
        return f"{ex.active}+1", [(a, "drain", ex.drain)]
    if scenario == "unplanned":
        return f"{ex.active}+1", [(a, "kill", ex.kill)]
    return f"{ex.active}+2", [(a, "drain", ex.drain), ("swap_complete", "kill", ex.kill)]


def _when(at: int | str) -> str:
    return f"from step {at} once the standbys are warm" if isinstance(at, int) else f"after {at}"


def describe(e: dict) -> str | None:
    """One line for a timeline, for the event kinds a reader of the demo cares about."""
    k = e["kind"]
    if k == "job_state":
        return f"job {e['prev']} -> {e['state']}"
    if k == "node_ready":
        return f"{e['node']} ready ({e['role']}{', warmed in the sandbox' if e.get('warm') else ''})"
    if k == "swap_planned":
        return (f"drain {e['node']}: plan {e['plan']}, joiner {e['joiner']}, rebuild "
                f"{len(e['groups_rebuilt'])} groups, keep {e['groups_kept']}")
    if k == "phase1_done":
        return f"phase 1 done in {e['phase1_s']:.3f}s (training went on)"
    if k == "switch":
        return f"switch at the boundary after step {e['step']}"
    if k == "swap_complete":
        return (f"swap complete{' (measuring cut short)' if e.get('interrupted') else ''}: "
                f"stall {e['stall_s']}s, state {e['state_bytes'] / 1e6:.1f} MB in "
                f"{e['phases']['transfer_s']}s, groups rebuilt {e['groups_rebuilt']} / kept {e['groups_kept']}")
    if k == "node_released":           # local "nodes" are nobody's to give back: nothing to say
        return None if e["result"] == NOTHING_TO_GIVE_BACK else f"{e['node']} ({e['why']}): {e['result']}"
    if k == "failure_detected":
        return f"{e['node']} FAILED: {e['how']} (detected {e.get('detect_s')}s after)"
    if k == "recovery_planned":
        return (f"recovery plan {e['plan']}: moves {e['moves']}, donors {e['donors']}"
                + (f", fallback {e['fallback']}" if e.get("fallback") else ""))
    if k == "recovery_complete":
        return (f"recovered: stall {e['stall_s']}s, lost {e['lost_steps']} step(s), "
                f"groups rebuilt {e['groups_rebuilt']} / kept {e['groups_kept']}")
    if k in ("swap_cancelled", "checkpoint_exit", "standbys_exhausted"):
        return k.replace("_", " ") + (f": {e.get('why') or e.get('action')}" if e.get("why") or e.get("action") else "")
    return None


def timeline(job: Path) -> list[str]:
    lines = [(e["ts"], d) for e in evlog.read(jobdir.events_file(job)) if (d := describe(e))]
    return [f"  +{ts - lines[0][0]:7.2f}s  {d}" for ts, d in lines]


def compare(ref: dict, run: dict) -> tuple[bool, list[str]]:
    a, b = ref.get("digests", {}), run.get("digests", {})
    if not a or set(a) != set(b):
        return False, [f"ranks finished: reference {sorted(a)}, run {sorted(b)}"]
    diff = [r for r in a if a[r] != b[r]]
    return not diff, [f"rank {r}: {a[r][:12]} != {b[r][:12]}" for r in diff]


def main(args) -> int:
    ex = EXAMPLES[args.example]
    steps = args.steps or (COMPILE_STEPS if args.compile else ex.steps)
    root = Path.cwd() / "tm_slurm_jobs" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.compile and ex.name != "gpt":
        raise SystemExit(f"--compile is an option of the gpt example, not of {ex.name}")
    local, actions = scenario_actions(args.scenario, steps, ex)
    extra = ["--compile"] if args.compile else []
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    say(f"tm-slurm demo: {ex.what}, {steps} steps; reference run, then a run with "
        f"{', '.join(f'{v} {n} {_when(at)}' for at, v, n in actions)}  ({root})")
    timeout = 600 + (900 if args.compile else 0)
    comm = [f"comm.backend={args.comm}"] if args.comm else []
    ref = JobRun(root / "reference", f"{ex.active}+0", steps, [], extra_args=ex.args(), script_args=extra,
                 sets=["standby.count=0", *comm], script=ex.script)
    rc_ref = ref.run(timeout)
    say(f"  reference run finished (exit {rc_ref})")
    run = JobRun(root / "run", local, steps, actions, extra_args=ex.args(), script_args=extra, sets=comm,
                 script=ex.script)
    rc = run.run(timeout)
    say(f"  run with interruptions finished (exit {rc})")
    if rc_ref != 0 or rc != 0:
        say(f"  a run failed; see {root}/*.out and the job directories")
        return 1
    missing = run.missing()
    if missing:
        # a tour that shows no interruption is no success, however identical its digests
        say(f"  the run ended before it could {', '.join(f'{v} {n} {_when(at)}' for at, v, n in missing)}: "
            f"its standbys were not warm in time (the first compile takes minutes); run more --steps")
        return 1
    r_ref, r_run = ref.result(), run.result()
    same, diffs = compare(r_ref, r_run)
    out = {"example": ex.name, "comm": args.comm or "auto", "layout": {**ex.layout, "nodes": local},
           "events": r_run["interruptions"], "bitwise_identical": same, "steps": steps,
           "steady_step_s": r_run.get("steady_step_s"), "reference_steady_step_s": r_ref.get("steady_step_s"),
           "injected": run.done, "job_dir": str(run.job_dir), "reference_job_dir": str(ref.job_dir),
           "final_loss": list(r_run["losses"].values())[-1] if r_run["losses"] else None}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print("timeline:")
        print("\n".join(timeline(run.job_dir)))
        for e in out["events"]:
            ph = e.get("phases", {})
            print(f"{e['kind']} on {e['node']}: stall {e['stall_s']}s"
                  + (f", detected in {e['detect_s']}s, lost {e['lost_steps']} step(s)" if e["kind"] == "unplanned" else
                     f", phase 1 {ph.get('phase1_s')}s in the background")
                  + f", {e['state_bytes'] / 1e6:.1f} MB of state moved, groups rebuilt {e['groups_rebuilt']} / kept "
                    f"{e['groups_kept']}")
        loss = "n/a (the loop does not report it)" if out["final_loss"] is None else f"{out['final_loss']:.4f}"
        print(f"steady step {out['steady_step_s']:.3f}s; final loss {loss}")
        print(f"bitwise identical to the undisturbed run: {same}" + ("" if same else f" {diffs}"))
        print(f"events: {run.job_dir / 'events.jsonl'}")
    return 0 if same else 1
