"""`tm-slurm minicluster VERB`: start, inspect, break, repair and use the minicluster.

Wired into the main CLI with `add_parser(subparsers)`; every verb sets `fn`, which
takes the parsed args and returns the exit status. `python -m tm_slurm.minicluster`
offers the same verbs on their own.
"""
from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys

from .cluster import MODES, MiniCluster, MiniClusterError

NOT_UP = 3  # like `systemctl status` of a stopped service


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "minicluster", help="a real multi-node Slurm cluster on this machine (root)",
        description="A real Slurm cluster on this machine: slurmctld plus N slurmd nodes, each "
                    "in its own network/UTS/IPC/mount/PID namespaces. Needs root.")
    add_verbs(p)
    return p


def add_verbs(parser: argparse.ArgumentParser) -> None:
    verbs = parser.add_subparsers(dest="minicluster_verb", required=True, metavar="VERB")

    v = verbs.add_parser("up", help="start the cluster and wait until every node is idle (no-op if healthy)")
    v.add_argument("--nodes", type=int, help="number of nodes (default: $TM_SLURM_MINICLUSTER_NODES or 5)")
    v.add_argument("--fresh", action="store_true", help="restart even if a healthy cluster is up")
    v.set_defaults(fn=cmd_up)

    v = verbs.add_parser("down", help="stop everything and remove namespaces and state (keeps last-logs)")
    v.add_argument("--purge", action="store_true", help="remove the logs and the run directory too")
    v.set_defaults(fn=cmd_down)

    v = verbs.add_parser("status", help="node states as slurmctld sees them")
    v.add_argument("--json", action="store_true")
    v.set_defaults(fn=cmd_status)

    v = verbs.add_parser("fail", help="make NODE fail for real; prints the epoch time of the failure")
    v.add_argument("node")
    v.add_argument("--mode", choices=MODES, default="crash",
                   help="crash: cable pulled, then every process SIGKILLed at once (default); "
                        "kill: processes killed, link up; netcut: cable pulled only; "
                        "slurmd: the daemon killed only; hang: every process SIGSTOPped")
    v.set_defaults(fn=cmd_fail)

    v = verbs.add_parser("restore", help="repair or reboot NODE")
    v.add_argument("node")
    v.add_argument("--wait", action="store_true", help="until slurmctld has the node back in service")
    v.set_defaults(fn=cmd_restore)

    v = verbs.add_parser("run", help="run a command against the cluster: run -- CMD... (e.g. sinfo)")
    v.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD")
    v.set_defaults(fn=cmd_run)

    v = verbs.add_parser("env", help="print shell lines that put the cluster's clients on PATH")
    v.set_defaults(fn=cmd_env)

    v = verbs.add_parser("exec", help='run a command "on" NODE, in its namespaces: exec NODE -- CMD...')
    v.add_argument("node")
    v.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD")
    v.set_defaults(fn=cmd_exec)


def _reports_errors(fn):
    """A failed script is an exit status and a message, not a traceback."""
    @functools.wraps(fn)
    def wrapper(args) -> int:
        try:
            return fn(args)
        except (MiniClusterError, TimeoutError) as e:
            print(f"tm-slurm minicluster {args.minicluster_verb}: {e}", file=sys.stderr)
            return 1
    return wrapper


def _command(args) -> list[str]:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise SystemExit(f"tm-slurm minicluster {args.minicluster_verb}: no command given (… -- CMD)")
    return argv


@_reports_errors
def cmd_up(args) -> int:
    MiniCluster(echo=True).up(nodes=args.nodes, fresh=args.fresh)
    return 0


@_reports_errors
def cmd_down(args) -> int:
    MiniCluster(echo=True).down(purge=args.purge)
    return 0


@_reports_errors
def cmd_status(args) -> int:
    mc = MiniCluster()
    states = mc.status()
    if args.json:
        print(json.dumps({"up": bool(states), "run_dir": str(mc.run_dir),
                          "slurm_conf": str(mc.conf_path), "nodes": states}, indent=2))
    elif states:
        print(f"minicluster up ({mc.run_dir}); SLURM_CONF={mc.conf_path}")
        for node, state in states.items():
            print(f"  {node:8} {state}")
    else:
        print(f"minicluster is down ({mc.run_dir})")
    return 0 if states else NOT_UP


@_reports_errors
def cmd_fail(args) -> int:
    print(f"{MiniCluster().fail(args.node, args.mode):.6f}")
    return 0


@_reports_errors
def cmd_restore(args) -> int:
    mc = MiniCluster(echo=True)
    mc.restore(args.node, wait=args.wait)
    return 0


@_reports_errors
def cmd_run(args) -> int:
    return _exit_status(MiniCluster().run(_command(args)).returncode)


@_reports_errors
def cmd_exec(args) -> int:
    return _exit_status(MiniCluster().run_on(args.node, _command(args)).returncode)


@_reports_errors
def cmd_env(args) -> int:
    mc = MiniCluster()
    print(f"export SLURM_CONF={shlex.quote(str(mc.conf_path))}; export PATH={shlex.quote(str(mc.bin_dir))}:$PATH")
    return 0


def _exit_status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by a signal: the shell's convention


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tm_slurm.minicluster",
                                 description="Start, inspect, break, repair and use the minicluster.")
    add_verbs(ap)
    args = ap.parse_args(argv)
    return args.fn(args)
