"""Which backend this site gets: `backend_for` (pyslurm only where its Slurm version is the
cluster's, else the CLI). Apart from `backend.py` so that the interface and its value types do not
depend on the implementations that import them.
"""
from __future__ import annotations

import subprocess

from .backend import SlurmBackend, SlurmError, parse_version
from .cli_backend import CliBackend
from .pyslurm_backend import PyslurmBackend


def slurm_version(env: dict | None = None, timeout: float = 10.0) -> tuple[int, int] | None:
    """The Slurm major.minor of the CLI on PATH (`sinfo --version`), None if not found."""
    try:
        out = subprocess.run(["sinfo", "--version"], capture_output=True, text=True,
                             timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_version(out.stdout) if out.returncode == 0 else None


def _pyslurm_version() -> tuple[int, int] | None:
    try:
        import pyslurm  # noqa: F401  (optional dependency)
    except Exception:   # ImportError, or a libslurm mismatch at import time
        return None
    v = getattr(pyslurm, "__version__", None)
    if v is None and callable(getattr(pyslurm, "version", None)):
        v = pyslurm.version()
    return parse_version(str(v)) if v else None


def backend_for(kind: str = "auto", *, env: dict | None = None, timeout: float = 10.0) -> SlurmBackend:
    """Pick a backend.

    "cli": the Slurm CLI. "pyslurm": pyslurm, or SlurmError saying why it cannot be used.
    "auto": pyslurm if it imports AND its Slurm major.minor equals `sinfo --version`'s, else cli.
    `env` / `timeout` go to the CLI backend (env for every subprocess, timeout per call).
    """
    kind = (kind or "auto").lower()
    if kind == "cli":
        return CliBackend(env=env, timeout=timeout)
    if kind not in ("auto", "pyslurm"):
        raise ValueError(f"unknown Slurm backend {kind!r}: expected auto, cli or pyslurm")
    pv = _pyslurm_version()
    sv = slurm_version(env, timeout)
    if pv is not None and sv is not None and pv == sv:
        return PyslurmBackend()
    if kind == "pyslurm":
        if pv is None:
            why = "pyslurm is not importable (pip install pyslurm matching your Slurm version)"
        elif sv is None:
            why = (f"pyslurm {pv[0]}.{pv[1]} imports but the Slurm version could not be read "
                   "(`sinfo --version` failed: is slurm-client installed / on PATH?)")
        else:
            why = (f"pyslurm is built for Slurm {pv[0]}.{pv[1]:02d} but this cluster runs "
                   f"Slurm {sv[0]}.{sv[1]:02d}; install the matching pyslurm or use slurm.backend=cli")
        raise SlurmError(f"Slurm backend 'pyslurm' unusable: {why}")
    return CliBackend(env=env, timeout=timeout)
