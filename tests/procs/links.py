"""Both ends of tests/procs/test_links.py, each under `mpiexec -n 1` as the controller and its
agents are: `ctl DIR` accepts two peers on a real port, stops one (SIGSTOP, as a hung node),
keeps sending heartbeat-sized frames to both, then kills it (SIGKILL, as its fence does) and
checks that it is still alive and that the other link still carries a round trip. `peer DIR`
answers every frame it gets with a Ping of the same sequence number."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tm_slurm.control import auth
from tm_slurm.control import mpi as mpictl
from tm_slurm.messages import Ping, Stop

KEYS = auth.Keys.derive(b"t" * 32)
FRAME = Stop("x" * 400)          # about a heartbeat's size (`tm-slurm bench --frames`)


def peer(d: Path) -> None:
    ch = mpictl.connect((d / "port").read_text())
    ch.sealer = auth.Sealer(KEYS, "j", f"peer{os.getpid()}", peer="ctl")
    ch.send(Ping(os.getpid(), 0.0))
    while True:
        for m in ch.poll():
            if isinstance(m, Ping):
                ch.send(m)
        time.sleep(0.005)


def _wait(ch, pred, timeout: float):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for m in ch.poll():
            if pred(m):
                return m
        time.sleep(0.005)
    return None


def ctl(d: Path) -> None:
    port = mpictl.Port(d / "port")
    peers = [subprocess.Popen(mpictl.mpiexec_argv([sys.executable, __file__, "peer", str(d)]),
                              env=mpictl.mpi_env(), start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
    try:
        chans = []
        for _ in peers:
            ch, _knocked = port.accept(knock_after=30)
            ch.sealer = auth.Sealer(KEYS, "j", "ctl")
            chans.append(ch)
        pids = [_wait(ch, lambda m: isinstance(m, Ping), 30).seq for ch in chans]
        victim, healthy = chans            # the first accepted link: the one that aborted us
        os.kill(pids[0], signal.SIGSTOP)
        sent = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4:
            if sent == 200:
                os.kill(pids[0], signal.SIGKILL)
            for ch in chans:
                ch.send(FRAME)
                ch.poll()
            sent += 1
            time.sleep(0.01)
        healthy.send(Ping(424242, 0.0))
        echo = _wait(healthy, lambda m: isinstance(m, Ping) and m.seq == 424242, 10)
        print(json.dumps({"survived": True, "sent": sent, "echo": echo is not None,
                          "victim": {"broken": victim.broken, "pending": victim.pending_sends()},
                          "healthy": {"broken": healthy.broken}}), flush=True)
    finally:
        for p in peers:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in peers:
            p.wait()
    os._exit(0)         # no Finalize with a dead peer (control/mpi.py)


if __name__ == "__main__":
    {"ctl": ctl, "peer": peer}[sys.argv[1]](Path(sys.argv[2]))
