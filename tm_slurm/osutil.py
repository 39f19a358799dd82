"""Process lifetime helpers shared by the launchers."""
from __future__ import annotations

import ctypes
import resource
import signal


def die_with_parent() -> None:
    """For `preexec_fn`: the child is SIGKILLed when the thread that started it ends, so nothing
    of the job outlives a `tm-slurm run` or a controller killed outright (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


def raise_fd_limit() -> None:
    """Descriptors up to the hard limit: they are what a flood of connections to a port of the job
    (MPI's, gloo's while a group is built) takes first, and a process out of them fails in every
    open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
