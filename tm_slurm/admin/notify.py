"""`tm-slurm notify-nodes --event fail|down|drained NODELIST`: tell the running tm_slurm jobs on
these nodes about a Slurm node event at once, by dropping request files into their inboxes.

This is what plugins/strigger/tm-slurm-trigger runs (strigger passes the node list). The jobs
would see the same node states themselves at their next Slurm poll; the request only makes them
act sooner:

    fail     the node is expected to fail (State=FAIL): planned migration (drain); Slurm 22.05
             never fires --fail triggers, so there only `tm-slurm notify-nodes` run by hand does
    drained  the node became DRAINED: drain (normally nothing is left on it; a no-op then)
    down     the node is DOWN: treat it as failed (request verb `fail`: recovery on a standby)

For `down` every running job is checked, not only those Slurm still shows on the node: Slurm takes
a DOWN node out of a --no-kill job at once. A job that has already marked the node FAILED (it
usually has: its agent's srun step ends when Slurm drops the node) is told as well; the request is
a no-op for it, and its event log then shows that the hook works.
"""
from __future__ import annotations

import argparse
import sys
import time

from ..slurm import SlurmError, hostlist
from .jobs import LIVE_ROLES, affected, ask, privilege_note, running_jobs

VERB = {"fail": "drain", "drained": "drain", "down": "fail"}
ROLES = {"fail": LIVE_ROLES, "drained": LIVE_ROLES, "down": LIVE_ROLES | {"FAILED"}}


def notify(event: str, nodes: list[str], reason: str, source: str,
           list_jobs=None) -> tuple[list[str], int]:
    """(one line per affected job, exit code). Only the jobs are touched, never Slurm."""
    verb = VERB[event]
    jobs = (list_jobs or running_jobs)(None if event == "down" else nodes)
    lines, rc = [], 0
    for job, held in affected(jobs, nodes, ROLES[event]):
        where = hostlist.compress(held)
        if job.job_dir is None:
            lines.append(f"job {job.job_id} ({job.user}) on {where}: not a tm_slurm job, nothing to tell")
            continue
        try:
            files = ask(job, verb, held, reason, source)
        except OSError as e:
            lines.append(f"job {job.job_id} ({job.user}) on {where}: request not written: {e}")
            rc = 1
            continue
        lines.append(f"job {job.job_id} ({job.user}) on {where}: asked to {verb} "
                     f"({', '.join(files)} in {job.job_dir}/control/requests)")
    if not lines:
        lines.append(f"no running job on {hostlist.compress(nodes)}")
    return lines, rc


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "notify-nodes", help="admin/strigger: tell tm_slurm jobs on NODELIST about a node event now",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("nodes", metavar="NODELIST", help="a Slurm hostlist (what strigger passes)")
    p.add_argument("--event", required=True, choices=sorted(VERB))
    p.add_argument("--reason", help="default: 'slurm node EVENT (SOURCE)'")
    p.add_argument("--source", default="notify-nodes",
                   help="who is asking, recorded in the job's request event (the trigger: strigger)")
    p.set_defaults(fn=main)
    return p


def main(args) -> int:
    nodes = hostlist.expand(args.nodes)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    if not nodes:
        print(f"{stamp} tm-slurm notify-nodes: no nodes in {args.nodes!r}", file=sys.stderr)
        return 2
    note = privilege_note()
    if note:
        print(f"{stamp} tm-slurm notify-nodes: note: {note}", file=sys.stderr)
    reason = args.reason or f"slurm node {args.event} ({args.source})"
    try:
        lines, rc = notify(args.event, nodes, reason, args.source)
    except SlurmError as e:
        print(f"{stamp} tm-slurm notify-nodes: {e}", file=sys.stderr)
        return 2
    for line in lines:
        print(f"{stamp} {args.event} {hostlist.compress(nodes)}: {line}")
    return rc
