"""Site-admin tools: `tm-slurm evacuate` (a drain that waits for tm_slurm jobs to move off) and
`tm-slurm notify-nodes` (what the strigger and NHC hooks in plugins/ call).

Both find the running jobs on some nodes, tell which are tm_slurm jobs (their job directory
`<WorkDir>/tm_slurm_jobs/<job id>` has a request inbox) and drop request files there. A request
is authenticated by the file's owner (the job's user, root or SlurmUser; see
tm_slurm/controller/requests.py), so these tools must run as root or SlurmUser to reach other
users' jobs. The job directory must be visible where they run: it is on the shared filesystem
the job's nodes use anyway.
"""
from __future__ import annotations

from . import evacuate, notify


def add_parsers(subparsers) -> None:
    """`tm-slurm evacuate` and `tm-slurm notify-nodes`."""
    evacuate.add_parser(subparsers)
    notify.add_parser(subparsers)
