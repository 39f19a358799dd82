"""The floor under `tm-slurm bench --control-plane`'s figures on this machine: the least work of
one exchange between N nodes and one central process, whatever the protocol.

Every node sends 64 bytes on its own TCP connection; the central process waits until all N have
arrived and answers each with 64 bytes; a round ends when every node has its answer. That is the
shape of the least vote there can be (every node's vote in, one decision out to all), with no
authentication, no decoding and no store logic: plain sockets, one selector loop on each side,
the N nodes in one process and the central one in another (as the emulated leaders and the
controller's store are). What it costs here bounds what the vote and the controller can reach
when every node's message goes through one process: the vote's latency is at least the round's,
and the controller's CPU a step is at least the central side's CPU a round, for each message a
node sends it a step (its vote, its heartbeats)."""
from __future__ import annotations

import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import time

from .metrics import percentile, process_cpu

MSG = b"v" * 64
WARM = 5


def _collect(sel: selectors.BaseSelector, n: int) -> None:
    """Until each of the n registered sockets delivered one message."""
    need = {key.fd: len(MSG) for key in sel.get_map().values()}
    left = n
    while left:
        for key, _ in sel.select():
            got = len(key.fileobj.recv(need[key.fd]))
            if not got:
                raise ConnectionError("a peer closed its connection")
            need[key.fd] -= got
            if need[key.fd] == 0:
                need[key.fd] = len(MSG)
                left -= 1


def _run(nodes: int, rounds: int, pause_s: float) -> dict:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(nodes)
    port = srv.getsockname()[1]
    r, w = os.pipe()
    pid = os.fork()          # a fresh interpreter with no threads: forking is safe here
    if pid == 0:
        os.close(r)
        code = 1
        try:
            conns = [srv.accept()[0] for _ in range(nodes)]
            sel = selectors.DefaultSelector()
            for s in conns:
                sel.register(s, selectors.EVENT_READ)
            cpu = []
            for _ in range(rounds):
                c0 = process_cpu()      # its waits are in select, which spends no CPU
                _collect(sel, nodes)
                for s in conns:
                    s.sendall(MSG)
                cpu.append(process_cpu() - c0)
            os.write(w, json.dumps(cpu).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    srv.close()
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(nodes)]
    sel = selectors.DefaultSelector()
    for c in clients:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sel.register(c, selectors.EVENT_READ)
    lat, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), process_cpu()
        for c in clients:
            c.sendall(MSG)
        _collect(sel, nodes)
        lat.append(time.perf_counter() - t0)
        cpu.append(process_cpu() - c0)
        time.sleep(pause_s)
    with os.fdopen(r) as f:
        answer = f.read()
    _, status = os.waitpid(pid, 0)
    if status or not answer:
        raise RuntimeError(f"the central process of the floor failed (wait status {status})")
    central = json.loads(answer)[WARM:]
    lat, cpu = lat[WARM:], cpu[WARM:]
    return {"floor_exchange_p50_s": round(statistics.median(lat), 5),
            "floor_exchange_p99_s": round(percentile(lat, 0.99), 5),
            "floor_nodes_cpu_per_round_s": round(statistics.median(cpu), 5),
            "floor_central_cpu_per_round_s": round(statistics.median(central), 5),
            "floor_rounds": len(lat)}


def measure(nodes: int, rounds: int = 45, pause_s: float = 0.01) -> dict:
    """Run the floor in a process of its own (its 2 x N sockets stay out of the caller's)."""
    out = subprocess.run([sys.executable, "-m", "tm_slurm.bench.floor", str(nodes), str(rounds), str(pause_s)],
                         capture_output=True, text=True, timeout=120 + 0.2 * nodes)
    if out.returncode:
        raise RuntimeError(f"the exchange floor failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


if __name__ == "__main__":
    print(json.dumps(_run(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))))
