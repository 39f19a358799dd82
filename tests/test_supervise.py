"""`tm-slurm run` ends with its controller (launch/supervise.py): with the code the controller
recorded, else what its launcher says (128 + the signal for one killed outright), else as a
failure. Real launcher, real processes."""
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


def test_a_controller_killed_outright_ends_the_run_as_killed(tmp_path, monkeypatch):
    p = _started("import time; time.sleep(60)", monkeypatch)
    s = sup.Supervised(p, tmp_path / "controller-exit")

    def kill():
        time.sleep(1.0)
        os.kill(sup.descendants(p.pid)[0], signal.SIGKILL)
    threading.Thread(target=kill, daemon=True).start()
    t0 = time.monotonic()
    assert s.wait(2.0) == 128 + signal.SIGKILL
    assert time.monotonic() - t0 < 10


def test_the_recorded_exit_code_is_the_runs(tmp_path, monkeypatch):
    f = tmp_path / "controller-exit"
    p = _started(f"import os; open({str(f)!r}, 'w').write(f'{{os.getpid()}} 75'); os._exit(0)", monkeypatch)
    assert sup.Supervised(p, f).wait(2.0) == 75


def test_a_launcher_that_outlives_its_controller_is_killed(tmp_path, monkeypatch):
    """Nothing recorded, and a launcher that does not follow its process: killed after the
    grace, and the run is a failure."""
    p = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1)']).wait(); "
                          "time.sleep(60)"],
                         start_new_session=True)
    monkeypatch.setattr(sup, "controller_pid", lambda root: next(iter(sup.descendants(root)), None))
    t0 = time.monotonic()
    assert sup.Supervised(p, tmp_path / "controller-exit").wait(1.0) == int(Exit.FAILED)
    assert time.monotonic() - t0 < 10 and p.returncode is not None
