"""The MPI control plane outlives a peer that dies with frames in flight to it (control/mpi.py,
mpi_env): real links, a real SIGSTOP then SIGKILL, as a hung node's fence does."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tm_slurm.control import mpi as mpictl

pytestmark = pytest.mark.procs
HERE = Path(__file__).parent


def test_a_peer_killed_with_frames_in_flight_does_not_abort_the_other_end(tmp_path):
    env = mpictl.mpi_env(extra={"PYTHONPATH": str(HERE.parents[1])})
    p = subprocess.Popen(mpictl.mpiexec_argv([sys.executable, str(HERE / "links.py"), "ctl", str(tmp_path)]),
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for pid in _naming(tmp_path):       # the peers, if the far end aborted before killing them
            os.kill(pid, signal.SIGKILL)
    assert p.returncode == 0, out[-3000:]
    res = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert res["survived"] and res["echo"], res
    assert not res["healthy"]["broken"], res


def _naming(d: Path) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and str(d).encode() in (p / "cmdline").read_bytes():
                out.append(int(p.name))
        except OSError:
            continue
    return out
