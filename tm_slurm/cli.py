"""`tm-slurm`: the command line. Each verb parses, validates, and hands over to its module."""
from __future__ import annotations

import argparse
import os
import sys

from . import config as cfgmod
from .exits import Exit
from .findjob import find_job

# c10d's C++ warnings (a store client's hostname, wait timeouts) are noise in every process
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def load_config(args) -> cfgmod.Config:
    overrides = dict(cfgmod.parse_override(s) for s in (args.set or []))
    for flag, key in (("dp", "layout.dp"), ("pp", "layout.pp"), ("tp", "layout.tp"),
                      ("ranks_per_node", "layout.ranks_per_node"), ("dp_shard", "layout.dp_shard"),
                      ("standbys", "standby.count")):
        v = getattr(args, flag, None)
        if v is not None:
            overrides[key] = v
    return cfgmod.load(args.config, overrides)


# ---------------------------------------------------------------- verbs

def cmd_run(args) -> int:
    from .launch import job as jobmod
    try:
        cfg = load_config(args)
        spec = jobmod.resolve(cfg, args)
    except cfgmod.ConfigError as e:
        print(f"tm-slurm run: configuration error: {e}", file=sys.stderr)
        return Exit.USAGE
    except jobmod.LaunchError as e:
        print(f"tm-slurm run: {e}", file=sys.stderr)
        return Exit.USAGE
    return jobmod.run(cfg, spec)


def cmd_agent(args) -> int:
    from .agent import main
    return main(args.job_dir, args.node, args.hb, args.admit_timeout, args.controller_timeout)


def cmd_drain(args) -> int:
    from .controller.requests import submit
    job = find_job(args.job)
    p = submit(job, "drain", args.node, args.reason)
    print(f"drain of {args.node} requested ({p.name}) for job {job}")
    return 0


def cmd_fail(args) -> int:
    from .launch.local import fail
    t = fail(find_job(args.job), args.node, args.mode)
    print(f"{args.node} {args.mode} at {t:.3f}")
    return 0


def cmd_checkpoint(args) -> int:
    from .controller.requests import submit
    job = find_job(args.job)
    submit(job, "checkpoint", None, args.reason, exit=args.exit)
    print(f"checkpoint requested for {job}")
    return 0


def cmd_status(args) -> int:
    from .status import show
    return show(find_job(args.job), as_json=args.json, events=args.events)


def cmd_demo(args) -> int:
    from .demo import main
    return main(args)


def cmd_export(args) -> int:
    from pathlib import Path
    from .export import ExportError, export
    try:
        step, d = export(Path(args.checkpoint), Path(args.out))
    except (ExportError, OSError, RuntimeError) as e:      # RuntimeError: torch's, e.g. no such directory
        print(f"tm-slurm export: {e}", file=sys.stderr)
        return Exit.FAILED
    print(f"checkpoint of step {step} ({d}) written to {args.out}")
    return 0


def cmd_rehearse(args) -> int:
    from .rehearse import main
    try:
        cfg = load_config(args)
    except cfgmod.ConfigError as e:
        print(f"tm-slurm rehearse: configuration error: {e}", file=sys.stderr)
        return Exit.USAGE
    return main(args, cfg)


def add_run_options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """`run`'s options; `rehearse` takes the same ones and hands them to each of its runs."""
    return [
        p.add_argument("--config", help="YAML config (see sbatch/example.yaml)"),
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key"),
        p.add_argument("--local", metavar="A+K", help="no Slurm: A active + K standby nodes on this machine"),
        p.add_argument("--standbys", type=int, help="standby nodes (default: config standby.count)"),
        p.add_argument("--dp", type=int),
        p.add_argument("--pp", type=int),
        p.add_argument("--tp", type=int),
        p.add_argument("--ranks-per-node", type=int, dest="ranks_per_node"),
        p.add_argument("--dp-shard", type=int, dest="dp_shard", help="DP ranks that shard one copy "
                       "of the state (FSDP2: layout.dp_shard; --dp for fully_shard over the DP group)"),
        p.add_argument("--job-dir", help="default: ./tm_slurm_jobs/<job id>"),
        p.add_argument("--job-id", help="default: the Slurm job id, or local-<time>"),
        p.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT_DIR",
                       help="start from a checkpoint: a step directory, the newest valid one of an earlier "
                            "job (its directory or id: a new allocation continues an interrupted run), "
                            "or, with no value, of this job (default under Slurm when "
                            "SLURM_RESTART_COUNT > 0)"),
        p.add_argument("--controller-address", metavar="ADDR",
                       help="under Slurm: the address of this host the nodes reach the controller at "
                            "(default: the source address of the route to the first other node)"),
    ]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tm-slurm", description=__doc__)
    sub = ap.add_subparsers(dest="verb", required=True)

    r = sub.add_parser("run", help="run a training job (under sbatch/salloc, or --local A+K)")
    add_run_options(r)
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    r.set_defaults(fn=cmd_run)

    a = sub.add_parser("agent", help="(internal) the per-node agent")
    a.add_argument("--job-dir", required=True)
    a.add_argument("--node", required=True)
    a.add_argument("--hb", type=float, default=0.5)
    a.add_argument("--admit-timeout", type=float, default=120.0)
    a.add_argument("--controller-timeout", type=float, default=10.0)
    a.set_defaults(fn=cmd_agent)

    d = sub.add_parser("drain", help="planned migration of NODE (local mode, or any job)")
    d.add_argument("node")
    d.add_argument("--job", help="job directory or id (default: the newest here)")
    d.add_argument("--reason", default="drain requested")
    d.set_defaults(fn=cmd_drain)

    f = sub.add_parser("fail", help="local mode: make NODE fail for real")
    f.add_argument("node")
    f.add_argument("--mode", choices=("kill", "hang", "exit", "hang-worker"), default="kill",
                   help="kill: SIGKILL the node's processes; hang: SIGSTOP them; exit: its workers die; "
                   "hang-worker: its workers freeze (SIGSTOP), its agent lives")
    f.add_argument("--job")
    f.set_defaults(fn=cmd_fail)

    c = sub.add_parser("checkpoint", help="write a checkpoint at the next step boundary")
    c.add_argument("--job")
    c.add_argument("--reason", default="requested")
    c.add_argument("--exit", action="store_true", help="then end the job (requeue-able status)")
    c.set_defaults(fn=cmd_checkpoint)

    s = sub.add_parser("status", help="nodes, roles, generation and recent events of a job")
    s.add_argument("--job")
    s.add_argument("--json", action="store_true")
    s.add_argument("--events", type=int, default=10, help="how many recent events to show")
    s.set_defaults(fn=cmd_status)

    m = sub.add_parser("demo", help="the one-command tour: run the example, drain a node, check")
    m.add_argument("--json", action="store_true")
    m.add_argument("--scenario", choices=("planned", "unplanned", "both"), default="both")
    m.add_argument("--steps", type=int, help="default 60 (ddp: 400); 800 with --compile (the "
                   "standbys must be warm before the interruptions come)")
    m.add_argument("--compile", action="store_true", help="torch.compile the example model")
    m.add_argument("--comm", choices=("gloo", "nccl", "nccl-like"), help="comm.backend of both runs "
                   "(default: auto); nccl-like: gloo with NCCL's delivery of results and errors")
    m.add_argument("--example", choices=("gpt", "ddp", "fsdp", "llama"), default="gpt",
                   help="gpt: a small GPT, DP=2 x PP=2, on the low-level API (default); ddp: a stock "
                   "DDP loop on tm_slurm.init(), DP=2; fsdp: a stock FSDP2 loop, 2 shards; llama: a "
                   "Llama-style decoder, HSDP 2 x 2, two ranks a node")
    m.set_defaults(fn=cmd_demo)

    e = sub.add_parser("export", help="a checkpoint as one torch.save file of plain state dicts",
                       description="Verify a checkpoint and write it as one torch.save file: {'step', "
                       "'model', 'optimizer', 'scheduler', 'extra', 'registered'}, every tensor whole (sharded ones "
                       "assembled). 'model' has DDP's leading 'module.' (and torch.compile's '_orig_mod.') "
                       "stripped, so the plain nn.Module takes it: model.load_state_dict(d['model']); "
                       "'optimizer' is Optimizer.state_dict()'s form: opt.load_state_dict(d['optimizer']). "
                       "With pipeline parallelism: {'step', 'stages': [one such dict per stage]}.")
    e.add_argument("checkpoint", help="a step directory (step<N>), or a checkpoint root or job directory "
                   "(its newest whole checkpoint)")
    e.add_argument("out", help="the file to write (e.g. model.pt)")
    e.set_defaults(fn=cmd_export)

    h = sub.add_parser("rehearse", help="your script on this machine: undisturbed, with a drain, with a "
                       "kill (each once the standbys are warm); are the final states bit-identical?",
                       description="Runs the command three times here (--local A+K, K >= 1): node1 drained, "
                       "nodeA killed, undisturbed; then compares the final checkpoints. --job-dir: where "
                       "the three jobs go (default ./tm_slurm_jobs/<--job-id, or rehearse-TIME>). Exit 0: "
                       "bit-identical; 1: a run differs; 2: usage; 3: a run failed; 4: too few steps for "
                       "an interruption.")
    h.set_defaults(fn=cmd_rehearse, run_options=add_run_options(h))
    h.add_argument("--timeout", type=float, default=1800, help="seconds each run may take (default 1800)")
    h.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")

    from .admin import add_parsers as add_admin
    from .bench.cli import add_parser as add_bench
    from .minicluster.cli import add_parser as add_minicluster
    from .report import add_parser as add_report
    from .sim_cli import add_parser as add_sim
    add_report(sub)
    add_bench(sub)
    add_sim(sub)
    add_admin(sub)          # evacuate, notify-nodes
    add_minicluster(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    import faulthandler
    import signal
    faulthandler.enable()                                      # a crash leaves a traceback
    faulthandler.register(signal.SIGUSR2, all_threads=True)    # `kill -USR2 PID`: where is it stuck?
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) and args.command[:1] == ["--"]:
        args.command = args.command[1:]
    return args.fn(args) or 0
