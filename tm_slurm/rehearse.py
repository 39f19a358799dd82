"""`tm-slurm rehearse`: the user's own script on this machine, run three times through the real
CLI: with a node drained (planned), with a node killed (unplanned), each once every standby is
warm, and undisturbed. Then each interrupted run's final checkpoint is compared with the
undisturbed one's, tensor by tensor: "bit-identical", or the tensors that differ, by how much,
and the likely cause.

The comparison (`compare`, `likely_cause`, `verdict`) is pure; `main` runs the jobs (demo.Job).
Separate runs, not a drain and a kill in one: each verdict then names the interruption that
broke the script, and one standby is enough.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import checkpoints as ckpt
from . import events as evlog
from . import jobdir
from .demo import Job, due, seen
from .export import ExportError, read_checkpoint, same_bits
from .launch.job import LaunchError, parse_local
from .topology import Topology


class Outcome(enum.IntEnum):
    IDENTICAL = 0
    DIFFERENT = 1
    USAGE = 2            # the command line (as tm-slurm run's Exit.USAGE)
    RUN_FAILED = 3       # a run itself failed: its exit code and logs are named
    TOO_SHORT = 4        # a run ended before its interruption came: more steps


# ---------------------------------------------------------------- comparison (pure)

# the parts of the state, in the order a verdict names them
GROUPS = ("parameters", "buffers", "optimizer", "scheduler", "script state", "step")
# a checkpoint does not say which model entries are buffers: these names (BatchNorm's) are
BUFFER_NAMES = {"running_mean", "running_var", "num_batches_tracked"}
# the plain state's fields (messages.StateManifest) by part; any other one is the script's own
PLAIN_GROUPS = {"param_groups": "optimizer", "opt_scalars": "optimizer", "scheduler": "scheduler"}
MAX_NAMES = 10           # differing names shown per part
_STAGE = re.compile(r"^pp\d+\.")

RANDOMNESS = ("randomness or data not keyed by step: the script's own torch.Generator, numpy/random "
              "in DataLoader workers, a sampler other than job.sampler, state kept outside "
              "job.optimizer/job.register")


@dataclass(frozen=True)
class Difference:
    group: str           # one of GROUPS
    name: str            # a tensor's name, or a plain value's path
    detail: str          # "max |diff| 0.0031", "3 != 4", ...


@dataclass(frozen=True)
class Interruption:
    """What a run's interruption was, and at which step it took effect: a drain's switch, or the
    step a kill discarded (and the run did again)."""
    event: str           # drain, kill
    node: str
    step: int
    lost: int = 0        # steps done again


def group_of(name: str, t: torch.Tensor) -> str:
    """Which part of the state a checkpoint's tensor is (export.py's names: `model.<key>`,
    `opt.<i>.<key>`, `pp<k>.` before them with pipeline stages); integer model tensors are
    buffers (a step counter), never parameters."""
    if _STAGE.sub("", name).startswith("opt."):
        return "optimizer"
    if name.rsplit(".", 1)[-1] in BUFFER_NAMES or not (t.is_floating_point() or t.is_complex()):
        return "buffers"
    return "parameters"


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    wide = torch.complex128 if a.is_complex() else torch.float64
    return (a.to(wide) - b.to(wide)).abs().max().item() if a.numel() else 0.0


def tensor_differences(ref: dict[str, torch.Tensor], run: dict[str, torch.Tensor]) -> list[Difference]:
    out = []
    for name in [*ref, *(n for n in run if n not in ref)]:        # the checkpoint's order
        a, b = ref.get(name), run.get(name)
        g = group_of(name, a if a is not None else b)
        if a is None or b is None:
            out.append(Difference(g, name, f"only in the {'interrupted' if a is None else 'undisturbed'} run"))
        elif a.dtype != b.dtype or a.shape != b.shape:
            out.append(Difference(g, name, f"{a.dtype} {tuple(a.shape)} != {b.dtype} {tuple(b.shape)}"))
        elif not same_bits(a, b):
            out.append(Difference(g, name, f"max |diff| {_max_abs(a, b):.3g}"))
    return out


def _plain_fields(state) -> list[tuple[str, str, object]]:
    """(part, name, value) of each pipeline stage's plain state (`pp<k>.` before the names when
    there are several); the step and the tensors' list are compared on their own."""
    stages = state.stages or (state.plain,)
    return [(PLAIN_GROUPS.get(f.name, "script state"), f"pp{i}." * (len(stages) > 1) + f.name, getattr(m, f.name))
            for i, m in enumerate(stages) for f in dataclasses.fields(m) if f.name not in ("step", "tensors")]


def _value_differences(path: str, a, b) -> list[tuple[str, str]]:
    """(path, "a != b") of each differing leaf of two plain values, dicts and sequences walked
    (a scheduler's last_epoch, a param group's lr)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in [*a, *(k for k in b if k not in a)]
                for d in _value_differences(f"{path}.{k}", a.get(k, "<absent>"), b.get(k, "<absent>"))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _value_differences(f"{path}[{i}]", x, y)]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = same_bits(a, b)
    else:
        same = not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b
    return [] if same else [(path, f"{a!r:.40} != {b!r:.40}")]


def plain_differences(ref, run) -> list[Difference]:
    """The plain states' differences (`ref`, `run`: whole states, each stage's plain state)."""
    return [Difference(g, path, detail)
            for (g, name, a), (_, _, b) in zip(_plain_fields(ref), _plain_fields(run))
            for path, detail in _value_differences(name, a, b)]


def compare(ref, run) -> list[Difference]:
    """Every difference between two final states (export.Exported: step, tensors, plain)."""
    step = [] if ref.step == run.step else [Difference("step", "step", f"{ref.step} != {run.step}")]
    return step + tensor_differences(ref.tensors, run.tensors) + plain_differences(ref, run)


def covered(state) -> list[str]:
    """The parts a state has, so that "bit-identical" names what was compared."""
    have = {group_of(n, t) for n, t in state.tensors.items()}
    have |= {g for g, _, v in _plain_fields(state) if v not in (None, (), {}, [])}
    return [g for g in GROUPS if g in have]


def first_loss_difference(ref: dict[int, float], run: dict[int, float]) -> int | None:
    """The first step whose loss differs, of the steps both runs report one for."""
    return next((s for s in sorted(ref.keys() & run.keys()) if ref[s] != run[s]), None)


def likely_cause(groups: set[str], first_loss: int | None = None, at: Interruption | None = None) -> str:
    """Why the parts in `groups` differ, from which they are and (if the script reports its
    losses) whether the runs parted before the interruption."""
    if first_loss is not None and at is not None and first_loss < at.step:
        return (f"the script is not deterministic even undisturbed (its losses differ from step "
                f"{first_loss}, before the {at.event} at step {at.step}): {RANDOMNESS}")
    if "step" in groups:
        return "the runs ended at different steps: a run's last checkpoint is not its final state"
    causes = []
    if groups & {"parameters", "optimizer"}:
        causes.append(RANDOMNESS)
    elif "buffers" in groups:
        causes.append("buffers updated outside a committed step (running_mean/var, num_batches_tracked): "
                      "a forward pass outside the loop's steps, e.g. an evaluation in train mode")
    if "scheduler" in groups:
        causes.append("scheduler stepped outside opt.step(): pass it to job.optimizer(model, opt, sched) "
                      "and drop the script's own sched.step()")
    if "script state" in groups:
        causes.append("the script's registered state (job.register) changed outside a committed step")
    return "; ".join(causes)


def _loss_line(first_loss: int | None, has_losses: bool, at: Interruption) -> str:
    if not has_losses:
        return ("losses: none reported (a tm_slurm.run step function returns its loss), so not where "
                "the runs parted")
    if first_loss is None:
        return "losses: every step's is the same in both runs"
    gap = at.step - first_loss
    when = f"{gap} step(s) before" if gap > 0 else "at" if gap == 0 else f"{-gap} step(s) after"
    return f"losses: the first to differ is step {first_loss}'s, {when} the {at.event} (step {at.step})"


def verdict(name: str, diffs: list[Difference], ref, at: Interruption, first_loss: int | None,
            has_losses: bool) -> list[str]:
    """The lines that say how the run `name` compares with the undisturbed one (`ref`'s state)."""
    if not diffs:
        return [f"{name}: bit-identical: {', '.join(covered(ref))} ({len(ref.tensors)} tensors)"]
    n = sum(d.name in ref.tensors for d in diffs)
    other = f", {len(diffs) - n} other values" if len(diffs) > n else ""
    lines = [f"{name}: DIFFERS from the undisturbed run ({n} of {len(ref.tensors)} tensors{other})"]
    for g in GROUPS:
        ds = [d for d in diffs if d.group == g]
        if ds:
            more = f", and {len(ds) - MAX_NAMES} more" if len(ds) > MAX_NAMES else ""
            lines.append(f"  {g}: " + ", ".join(f"{d.name} ({d.detail})" for d in ds[:MAX_NAMES]) + more)
    lines.append("  " + _loss_line(first_loss, has_losses, at))
    lines.append("  likely cause: " + likely_cause({d.group for d in diffs}, first_loss, at))
    return lines


# ---------------------------------------------------------------- the runs

MIN_STEP = 3             # an interruption comes once every standby is warm and this many steps are in
# how long a run goes on after its interruption is due, at the least: a drain's phase 1 and
# switch (~1 s here), a kill's detection and recovery (~0.5 s), and the status' refresh (0.5 s)
SLACK_S = 5.0
# rehearse's own options of `run`'s: each run gets a layout, a job directory and an id of its own
OWN = {"local", "standbys", "job_dir", "job_id"}


class Stop(Exception):
    """The rehearsal cannot go on: why, and the command's exit code."""

    def __init__(self, outcome: Outcome, message: str):
        super().__init__(message)
        self.outcome = outcome


@dataclass
class Run:
    name: str                    # drain, kill, undisturbed
    local: str
    actions: list
    sets: list[str]
    checkpoint_every: int = 0    # the kill waits for a checkpoint (its node's state is nowhere else)
    job: Job | None = None
    seconds: float = 0.0


def _warm_and_checkpointed(job: Path) -> bool:
    """A kill's moment when the killed node's state has no replica: it needs a checkpoint."""
    return due(job, MIN_STEP) and seen(job, "checkpoint_complete")


def plan(cfg, active: int, standbys: int) -> list[Run]:
    """The drain's run first: a script too short for its standbys to warm says so before the
    other two runs are spent. The drain takes node1, the kill the last active node."""
    victim = f"node{active}"
    topo = Topology(cfg.layout)
    lone = any(not topo.replicas(r) for r in topo.slot_ranks(active - 1))
    if lone and not cfg.checkpoint.every_steps:
        raise Stop(Outcome.USAGE, f"no other node holds {victim}'s state (layout {cfg.layout}) and "
                   "checkpoint.every_steps is 0: a killed node could not be recovered, here or in a real "
                   "job; add --set checkpoint.every_steps=N to rehearse a kill")
    local = f"{active}+{standbys}"
    return [Run("drain", local, [(MIN_STEP, "drain", "node1")], []),
            Run("kill", local, [(_warm_and_checkpointed if lone else MIN_STEP, "kill", victim)], [],
                cfg.checkpoint.every_steps if lone else 0),
            Run("undisturbed", f"{active}+0", [], ["standby.count=0"])]


def forwarded(args) -> list[str]:
    """`run`'s options as the user gave them to rehearse, but for rehearse's own (OWN)."""
    out = []
    for a in args.run_options:
        v = getattr(args, a.dest)
        if a.dest not in OWN and v is not None:
            out += [x for item in (v if isinstance(v, list) else [v]) for x in (a.option_strings[0], str(item))]
    return out


def argv(args, run: Run, root: Path, name: str) -> list[str]:
    job = root / run.name
    # each run's checkpoints of its own, wherever the config puts the job's (JSON is YAML)
    sets = [f"checkpoint.dir={json.dumps(str(job / 'checkpoints'))}", *run.sets]
    return [sys.executable, "-m", "tm_slurm", "run", "--local", run.local, "--job-dir", str(job),
            "--job-id", f"{name}-{run.name}", *forwarded(args), *(x for s in sets for x in ("--set", s)),
            "--", *args.command]


def execute(run: Run, timeout: float) -> None:
    t0 = time.monotonic()
    try:
        rc = run.job.run(timeout)
    except KeyboardInterrupt:
        run.job.kill()           # the job is a session of its own: Ctrl-C does not reach it
        raise
    except TimeoutError:
        run.job.kill()
        raise Stop(Outcome.RUN_FAILED, _failed(run, f"did not finish within {timeout:.0f} s (killed)")) from None
    run.seconds = time.monotonic() - t0
    if rc != 0:
        raise Stop(Outcome.RUN_FAILED, _failed(run, f"failed (exit {rc})"))
    if run.job.missing() or (run.actions and interruption(run) is None):
        raise Stop(Outcome.TOO_SHORT, too_short(run))


def _failed(run: Run, what: str) -> str:
    job = run.job.job_dir
    try:
        tail = run.job.out_file().read_text(errors="replace").splitlines()[-15:]
    except OSError:
        tail = []
    return "\n".join([f"the {run.name} run {what}: its output is {run.job.out_file()}, its logs "
                      f"{jobdir.log_dir(job)}/, its events {jobdir.events_file(job)}",
                      *(f"  | {line}" for line in tail)])


def interruption(run: Run) -> Interruption | None:
    """The run's interruption as the job recorded it, once it took effect."""
    (_, verb, node), = run.actions
    kind, key = ("planned", "switch_step") if verb == "drain" else ("unplanned", "resume_step")
    rec = next((e for e in run.job.result()["interruptions"] if e["kind"] == kind and e["node"] == node), None)
    return None if rec is None or rec.get(key) is None else Interruption(verb, node, rec[key],
                                                                         rec.get("lost_steps") or 0)


def _steps(job: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in jobdir.steps_file(job).read_text().splitlines()]
    except (OSError, json.JSONDecodeError):
        return []


def _ended(steps: list[dict]) -> int:
    """How many steps a run did, from its steps log."""
    return max((d["step"] + 1 for d in steps), default=0)


def losses(job: Path) -> dict[int, float]:
    """Each step's loss (steps.jsonl, when the script reports one): a step done again after a
    kill is logged again, and that later loss is the one the run went on from."""
    return {d["step"]: d["loss"] for d in _steps(job) if d.get("loss") is not None}


def too_short(run: Run) -> str:
    """Why the run ended before its interruption, and how many steps would do: the standbys'
    warm-up (at least twice the run, if they never got warm) and SLACK_S more, at the run's pace."""
    (_, verb, node), = run.actions
    job = run.job.job_dir
    steps = _steps(job)
    if not steps:
        return f"the {run.name} run did no step: give the script steps to run"
    active, _, k = run.local.partition("+")
    standbys = {f"node{int(active) + i + 1}" for i in range(int(k))}
    ready = {e["node"]: e["ts"] for e in evlog.read(jobdir.events_file(job)) if e["kind"] == "node_ready"}
    start, end = steps[0]["wall"], max(d["wall"] for d in steps)
    warm_t = max(ready[n] for n in standbys) if standbys <= ready.keys() else None
    if run.job.done:
        why = f"the {verb} came at step {run.job.done[0]['at_step']} but the run ended before it took effect"
    elif warm_t is None:
        why = "its standbys were not warm yet (a standby first rehearses the script in a sandbox)"
    elif run.checkpoint_every:
        why = (f"no checkpoint was complete yet (no other node holds {node}'s state: the kill waits for "
               f"one, every {run.checkpoint_every} steps)")
    else:
        w = sum(d["wall"] <= warm_t for d in steps)
        why = (f"its standbys were warm from step {w}, {_ended(steps) - w} step(s) "
               f"({max(end - warm_t, 0):.1f} s) before its end")
    wait = 2 * (end - start) if warm_t is None else max(warm_t - start, 0.0)
    need = max(MIN_STEP + math.ceil((wait + SLACK_S) / statistics.median(d["dur_s"] for d in steps)),
               2 * run.checkpoint_every)
    return (f"the {run.name} run ended after {_ended(steps)} steps, before it could {verb} {node}: {why}; "
            f"run at least {need} steps")


def final_state(run: Run):
    """The run's final state: its newest whole checkpoint, which the runtime writes as the loop
    ends (one of an earlier step would compare something else)."""
    root = run.job.job_dir / "checkpoints"
    found = ckpt.latest_whole(root)
    ended = _ended(_steps(run.job.job_dir))
    try:
        state = None if found is None else read_checkpoint(*found)
    except ExportError as e:
        raise Stop(Outcome.RUN_FAILED, f"the {run.name} run's final checkpoint cannot be read: {e}") from None
    if state is None or state.step != ended:
        raise Stop(Outcome.RUN_FAILED, f"the {run.name} run ended at step {ended} but its newest whole "
                   f"checkpoint in {root} is {'none' if state is None else f'of step {state.step}'}")
    return state


def describe(run: Run) -> str:
    """One line of what happened in the run."""
    done = f"{_ended(_steps(run.job.job_dir))} steps in {run.seconds:.1f} s"
    if not run.actions:
        return f"  {run.name} run: {done}"
    at = interruption(run)
    took = (f"drained, its standby took over at step {at.step}" if at.event == "drain"
            else f"killed, the run went on from step {at.step} ({at.lost} step(s) done again)")
    return f"  {run.name} run: {at.node} {took}; {done}"


def main(args, cfg) -> int:
    try:
        return rehearse(args, cfg)
    except Stop as e:
        print(f"tm-slurm rehearse: {e}", file=sys.stderr)
        return e.outcome


def rehearse(args, cfg) -> int:
    if not args.command:
        raise Stop(Outcome.USAGE, "no training command given: tm-slurm rehearse --local A+K [options] -- "
                   "python train.py ...")
    if not args.local:
        raise Stop(Outcome.USAGE, "rehearse runs on this machine: give --local A+K (A active nodes, K >= 1 "
                   "standby)")
    try:
        active, standbys = parse_local(args.local)
    except LaunchError as e:
        raise Stop(Outcome.USAGE, str(e)) from None
    if standbys < 1 or (args.standbys is not None and args.standbys != standbys):
        raise Stop(Outcome.USAGE, f"--local {args.local}: a drain and a kill need at least one standby "
                   "(and --standbys, if given, must say the same)")
    runs = plan(cfg, active, standbys)
    name = args.job_id or f"rehearse-{time.strftime('%Y%m%d-%H%M%S')}"
    root = Path(args.job_dir or Path.cwd() / "tm_slurm_jobs" / name).resolve()
    kill = runs[1]
    later = "; the kill after the first checkpoint, no other node holding its state" * bool(kill.checkpoint_every)
    print(f"tm-slurm rehearse: {' '.join(args.command)} on {active} active + {standbys} standby nodes: "
          f"{', then '.join(f'{v} {n}' for r in runs for _, v, n in r.actions)} (each once every standby "
          f"is warm, from step {MIN_STEP}{later}), then undisturbed; jobs in {root}", flush=True)
    for run in runs:
        run.job = Job(root / run.name, argv(args, run, root, name), run.actions, reason="rehearse")
        execute(run, args.timeout)
        print(describe(run), flush=True)
    *interrupted, ref_run = runs
    ref, ref_losses = final_state(ref_run), losses(ref_run.job.job_dir)
    same = True
    for run in interrupted:
        diffs = compare(ref, final_state(run))
        run_losses = losses(run.job.job_dir)
        first = first_loss_difference(ref_losses, run_losses)
        print("\n".join(verdict(run.name, diffs, ref, interruption(run), first, bool(ref_losses))), flush=True)
        same = same and not diffs
    return Outcome.IDENTICAL if same else Outcome.DIFFERENT
