"""tm_slurm: keep large training jobs on Slurm running through drains, reboots and failures.

The user-facing API is small: `init()` for a stock training loop (DDP and friends), or the
low-level `run(build, step, steps)` with `TrainState` and `Context`; and `tm_slurm.data` for
deterministic data order. Imported lazily so the agent (which never needs
torch) starts fast.
"""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["init", "run", "TrainState", "Context"]


def __getattr__(name):
    if name == "init":
        from .worker.stock import init
        return init
    if name == "run":
        from .worker.loop import run
        return run
    if name == "TrainState":
        from .worker.state import TrainState
        return TrainState
    if name == "Context":
        from .worker.context import Context
        return Context
    raise AttributeError(name)
