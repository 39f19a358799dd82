"""What another user of the cluster can do to a running job, run as that user by test_security.py.

`read DIR`: try to list and read the job directory. `mpi PORT MARKER`: Connect to the controller's
MPI port (its name leaked) and send a pickle that would create MARKER if anyone unpickled it.
`store HOST PORT`: write the store keys a job used to have (predictable) and random ones.
Prints one JSON line of what happened."""
from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def read(job: Path) -> dict:
    got = {}
    for target in (job, job / "events.jsonl", job / "status.json", job / "control" / "port",
                   job / "control" / "requests"):
        try:
            got[str(target)] = sorted(os.listdir(target)) if target.is_dir() else target.read_text()[:100]
        except OSError as e:
            got[str(target)] = f"refused: {type(e).__name__}"
    return got


def mpi(port: str, marker: str) -> dict:
    from tm_slurm.control import mpi as mpictl
    MPI = mpictl.mpi()
    comm = mpictl.connect(port, timeout=120).comm     # raw frames from here: no sealer
    evil = pickle.dumps(Payload(marker))
    for frame in (evil, b"\x00" * 32 + evil, b"x" * 100):
        comm.Send([bytearray(frame), MPI.BYTE], dest=0, tag=7)
    answer = None
    if comm.Iprobe(source=0, tag=7):
        st = MPI.Status()
        comm.Probe(source=0, tag=7, status=st)
        buf = bytearray(st.Get_count(MPI.BYTE))
        comm.Recv([buf, MPI.BYTE], source=0, tag=7)
        answer = len(buf)
    return {"connected": True, "sent": 3, "answer_bytes": answer}


def store(host: str, port: int) -> dict:
    import secrets
    from datetime import timedelta

    import torch.distributed as dist
    s = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    written = 0
    for gen in range(3):
        for step in range(300):
            s.set(f"vote/g{gen}/s{step}/d", json.dumps({"c": 0, "why": "stranger"}))
            s.add(f"vote/g{gen}/s{step}/n", 100)
            written += 2
        s.set(f"vote/g{gen}/pending", json.dumps({"ckpt": "stranger", "exit": True}))
    for plan in range(5):
        s.set(f"plan{plan}/switch_step", "3")
    for _ in range(100):
        s.set(secrets.token_hex(8), secrets.token_bytes(16))
    return {"written": written + 108}


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    out = {"read": lambda: read(Path(args[0])), "mpi": lambda: mpi(args[0], args[1]),
           "store": lambda: store(args[0], int(args[1]))}[mode]()
    print(json.dumps(out), flush=True)
    os._exit(0)
