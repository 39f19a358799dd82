"""`python -m tm_slurm.control.pmi CMD...`: the job's own `mpiexec -n 1` (docs/design.md §9).

A process that Connects or Accepts must be an MPI world of its own, started by a process manager
(control/mpi.py). This one starts CMD as rank 0 of a world of one and serves it MPICH's PMI-1 wire
protocol over a socketpair (PMI_FD): no port. hydra's mpiexec listens on every address for its
proxy, and one stranger's connection that sent it a few bytes left it blocked in a read for as
long as it stayed open: deaf to its process's PMI exchange (a controller or agent that never
started) and to its end (the allocation held). MPICH's gforker listens on nothing either, but
names its world `kvs_<its pid>_0`, and two worlds with one name cannot Connect ("groups not
disjoint"): launchers on two nodes with the same pid (a pid namespace per node, or chance at a
thousand nodes) made agents that never joined. Here the name is the host's, the pid's and 64
random bits. The launcher passes SIGINT, SIGTERM and SIGUSR1 on and ends with CMD's status
(128 + the signal for one killed by a signal).
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading

MAX_LINE = 4096


def world_name() -> str:
    return f"tm-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(8)}"


def answer(line: str, kvs: dict[str, str], name: str) -> str | None:
    """The PMI-1 answer to one request line of a world of one; None for a finalize's end."""
    req = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
    cmd = req.get("cmd", "")
    if cmd == "init":
        return "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0"
    if cmd == "get_maxes":
        return f"cmd=maxes kvsname_max=256 keylen_max=256 vallen_max={MAX_LINE // 2} rc=0"
    if cmd == "get_appnum":
        return "cmd=appnum appnum=0 rc=0"
    if cmd == "get_my_kvsname":
        return f"cmd=my_kvsname kvsname={name} rc=0"
    if cmd == "get_universe_size":
        return "cmd=universe_size size=1 rc=0"
    if cmd == "put":
        kvs[req.get("key", "")] = req.get("value", "")
        return "cmd=put_result rc=0"
    if cmd == "barrier_in":
        return "cmd=barrier_out rc=0"
    if cmd == "get":
        v = kvs.get(req.get("key", ""))
        return f"cmd=get_result rc=0 value={v}" if v is not None else "cmd=get_result rc=-1 msg=key_not_found"
    if cmd == "finalize":
        return "cmd=finalize_ack rc=0"
    return f"cmd={cmd or 'unknown'} rc=-1 msg=not_supported_by_tm_slurm"


def serve(sock: socket.socket, name: str) -> None:
    """Until the process closes its end (it ended, however)."""
    kvs: dict[str, str] = {}
    f = sock.makefile("rwb", buffering=0)
    while True:
        line = f.readline(MAX_LINE)
        if not line:
            return
        f.write((answer(line.decode(errors="replace"), kvs, name) + "\n").encode())


def main(argv: list[str]) -> int:
    ours, theirs = socket.socketpair()
    env = dict(os.environ, PMI_FD=str(theirs.fileno()), PMI_RANK="0", PMI_SIZE="1")
    p = subprocess.Popen(argv, env=env, pass_fds=(theirs.fileno(),))
    theirs.close()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda s, _f: p.send_signal(s))
    threading.Thread(target=serve, args=(ours, world_name()), name="pmi", daemon=True).start()
    rc = p.wait()
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
