"""Process lifetime helpers shared by the launchers."""
from __future__ import annotations

import ctypes
import signal


def die_with_parent() -> None:
    """For `preexec_fn`: the child is SIGKILLed when the thread that started it ends, so nothing
    of the job outlives a `tm-slurm run` or a controller killed outright (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
