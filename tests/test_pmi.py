"""The job's own `mpiexec -n 1` (control/pmi.py): real MPI worlds of one that Connect to each other
(each named apart, where gforker's `kvs_<pid>_0` could clash across nodes), the launched process's
status, and no listening port."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from tm_slurm.control import mpi as mpictl
from tm_slurm.control import pmi

PAIR = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tm_slurm.control import mpi as mpictl
    MPI = mpictl.mpi()
    port = Path(sys.argv[2])
    if sys.argv[1] == "accept":
        name = MPI.Open_port()
        port.write_text(name)
        c = MPI.COMM_WORLD.Accept(name)
        print("got", c.recv(source=0), flush=True)
    else:
        while not port.exists() or not port.read_text():
            time.sleep(0.05)
        c = MPI.COMM_WORLD.Connect(port.read_text())
        c.send("hello", dest=0)
    import os
    os._exit(0)
""")


def test_two_worlds_of_one_connect(tmp_path):
    port = tmp_path / "port"
    env = mpictl.mpi_env()
    a = subprocess.Popen(mpictl.mpiexec_argv([sys.executable, "-c", PAIR, "accept", str(port)]), env=env,
                         stdout=subprocess.PIPE, text=True)
    b = subprocess.Popen(mpictl.mpiexec_argv([sys.executable, "-c", PAIR, "connect", str(port)]), env=env)
    assert b.wait(60) == 0
    out, _ = a.communicate(timeout=60)
    assert a.returncode == 0 and "got hello" in out


def test_each_world_has_its_own_name():
    names = {pmi.world_name() for _ in range(100)}
    assert len(names) == 100
    kvs: dict = {}
    assert pmi.answer("cmd=get_my_kvsname\n", kvs, "w") == "cmd=my_kvsname kvsname=w rc=0"
    assert pmi.answer("cmd=put kvsname=w key=k value=v\n", kvs, "w") == "cmd=put_result rc=0"
    assert pmi.answer("cmd=get kvsname=w key=k\n", kvs, "w") == "cmd=get_result rc=0 value=v"
    assert "rc=-1" in pmi.answer("cmd=get kvsname=w key=nope\n", kvs, "w")
    assert "rc=-1" in pmi.answer("cmd=spawn\n", kvs, "w")


def test_the_launcher_ends_with_its_process_and_listens_on_nothing():
    assert subprocess.run(mpictl.mpiexec_argv(["sh", "-c", "exit 7"])).returncode == 7
    p = subprocess.Popen(mpictl.mpiexec_argv(["sleep", "30"]))
    time.sleep(1.0)
    assert not _listening(p.pid)
    p.send_signal(15)                                  # passed on: sleep dies of it
    assert p.wait(10) == 128 + 15


def _listening(pid: int) -> list[int]:
    from pathlib import Path
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = str(fd.readlink())
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                out.append(int(f[1].rsplit(":", 1)[1], 16))
    return out
