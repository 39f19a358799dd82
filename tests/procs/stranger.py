"""What another user of the cluster can do to a running job, run as that user by test_security.py.

`read DIR`: try to list and read the job directory. `mpi PORT MARKER`: Connect to the controller's
MPI port (its name leaked) and send a pickle that would create MARKER if anyone unpickled it.
`store HOST PORT`: speak torch's store protocol to the job's store (list, overwrite, delete, add).
`flood SPEC`: everything at once on every port of SPEC (JSON: ports as [host, port], per_port): a
torch TCPStore client on each (list, overwrite, delete and add to every key it can see), a
gigabyte of values pushed at those of `push` (the store's), `per_port` idle connections held on
each and one that sends
a few bytes; prints what it got, then holds the connections until its stdin closes.
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


def as_store(host: str, port: int) -> str:
    """Speak torch's store protocol to PORT: list every key, overwrite, delete, add to each."""
    from datetime import timedelta

    import torch.distributed as dist
    try:
        s = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=3))
        keys = s.list_keys()
        for k in keys:
            s.set(k, b"\0" * 40 + b"stranger")
            s.add(k + "/n", 1000)
            s.delete_key(k)
        return f"spoke the store protocol: {len(keys)} keys"
    except Exception as e:
        return f"refused: {type(e).__name__}: {str(e)[:80]}"


def push(host: str, port: int, total: int = 1 << 30, limit_s: float = 10.0) -> dict:
    """Send up to `total` bytes of values, reconnecting whenever the port closes on us."""
    import socket
    import time
    chunk, sent, conns, end = os.urandom(1 << 20), 0, 0, time.monotonic() + limit_s
    while sent < total and time.monotonic() < end:
        try:
            with socket.create_connection((host, port), timeout=1) as s:
                conns += 1
                while sent < total and time.monotonic() < end:
                    sent += s.send(chunk)
        except OSError:
            if conns > 10_000:
                break
    return {"bytes_taken": sent, "connections": conns}


def flood(spec: dict) -> dict:
    import socket
    import threading
    import time
    ports, n = [tuple(p) for p in spec["ports"]], spec["per_port"]
    got: dict = {}

    def one(host: str, port: int) -> None:
        got[port] = {"store": as_store(host, port),
                     "push": push(host, port) if port in spec.get("push", ()) else None}
    ths = [threading.Thread(target=one, args=p) for p in ports]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    held = []
    for host, port in ports:
        for i in range(n + 1):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((host, port))
            held.append((port, i == n, s))
    time.sleep(2)
    for _, port in ports:
        got[port]["held"] = 0
    for port, chatty, s in held:
        if _still_open(s):
            got[port]["held"] += 1
            if chatty:
                try:
                    s.send(b"hello")
                except OSError:
                    pass
    print(json.dumps({str(k): v for k, v in got.items()}), flush=True)
    sys.stdin.read()                 # hold everything until told to let go
    return {"let_go": True}


def _still_open(s) -> bool:
    """Connected, and not closed by the other side (what it sent is read and dropped)."""
    try:
        s.getpeername()       # a connect still waiting (its SYN dropped) has no peer
        while True:
            if not s.recv(1 << 16):
                return False
    except BlockingIOError:
        return True
    except OSError:           # never connected (a dropped SYN), or reset
        return False


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    out = {"read": lambda: read(Path(args[0])), "mpi": lambda: mpi(args[0], args[1]),
           "store": lambda: {"store": as_store(args[0], int(args[1]))},
           "flood": lambda: flood(json.loads(args[0]))}[mode]()
    print(json.dumps(out), flush=True)
    os._exit(0)
