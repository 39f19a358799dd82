"""`tm-slurm run` ends with its controller (launch/supervise.py): with the code the controller
recorded, and as a failure when it was killed outright, whatever its launcher (gforker, which
reports a child killed by a signal as exit 0) says. Real launcher, real processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from tm_slurm.control import mpi as mpictl
from tm_slurm.exits import Exit
from tm_slurm.launch import supervise as sup


def _started(child: str, monkeypatch) -> sup.Supervised:
    p = subprocess.Popen(mpictl.mpiexec_argv([sys.executable, "-c", child]), env=mpictl.mpi_env(),
                         start_new_session=True, stdin=subprocess.DEVNULL)
    # the controller is `python -m tm_slurm` below the launcher; here, whatever python is there
    monkeypatch.setattr(sup, "controller_pid", lambda root: next(iter(sup.descendants(root)), None))
    return p


def test_a_controller_killed_outright_ends_the_run_as_a_failure(tmp_path, monkeypatch):
    p = _started("import time; time.sleep(60)", monkeypatch)
    s = sup.Supervised(p, tmp_path / "controller-exit")

    def kill():
        time.sleep(1.0)
        os.kill(sup.descendants(p.pid)[0], signal.SIGKILL)
    threading.Thread(target=kill, daemon=True).start()
    t0 = time.monotonic()
    assert s.wait(2.0) == int(Exit.FAILED)
    assert time.monotonic() - t0 < 10
    assert p.returncode == 0               # what gforker itself said


def test_the_recorded_exit_code_is_the_runs(tmp_path, monkeypatch):
    f = tmp_path / "controller-exit"
    p = _started(f"import os; open({str(f)!r}, 'w').write(f'{{os.getpid()}} 75'); os._exit(0)", monkeypatch)
    assert sup.Supervised(p, f).wait(2.0) == 75
