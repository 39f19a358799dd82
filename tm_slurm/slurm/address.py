"""Which address of its own host the controller serves from (the job's store, MPI port).

The controller runs where `tm-slurm run` was typed: the batch host under sbatch, the login or
submit host under plain salloc, an allocated node under `salloc ... srun --pty bash`. Node names
may resolve only on the nodes (the mini cluster's head does not know them), so a node's address
comes from Slurm (`NodeAddr`) when the name does not resolve. The kernel's route to the first
allocated node that is not this host gives the source address those nodes can reach us at.
"""
from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator


class AddressError(RuntimeError):
    """No usable address: the message says what to pass instead."""


@dataclass(frozen=True)
class Route:
    dst: str
    dev: str
    src: str
    local: bool          # dst is an address of this host (`local ...` in `ip route get`)


@dataclass(frozen=True)
class Served:
    address: str
    how: str             # --controller-address | comm.interface | route | local
    detail: str
    node: str            # the node whose route decided (the first node otherwise): probe from it


def parse_route(text: str) -> Route | None:
    """`ip -o route get ADDR` output, e.g. `10.198.0.11 dev br0 src 10.198.0.1 uid 0 \\ cache`."""
    words = text.split()
    if not words:
        return None
    local = words[0] == "local"
    dst = words[1] if local and len(words) > 1 else words[0]
    kv = {words[i]: words[i + 1] for i in range(len(words) - 1) if words[i] in ("dev", "src")}
    if "src" not in kv:
        return None
    return Route(dst, kv.get("dev", ""), kv["src"], local)


def choose(override: str, interface: str, routes: Iterable[tuple[str, Route | None]]) -> Served:
    """The address to serve from: an explicit --controller-address, else comm.interface, else the
    source address of the route to the first node that is not this host (this host's own
    address when every node is local). `routes` is consumed lazily, in allocation order."""
    routes = iter(routes)
    if override or interface:
        first = next(routes, ("", None))[0]
        return Served(override, "--controller-address", "given on the command line", first) if override \
            else Served(interface, "comm.interface", "from the configuration", first)
    first_local = None
    tried = []
    for node, route in routes:
        if route is None:
            tried.append(node)
            continue
        if not route.local:
            return Served(route.src, "route", f"route to {node} ({route.dst}) via {route.dev}", node)
        first_local = first_local or (node, route)
    if first_local is not None:
        node, route = first_local
        return Served(route.src, "local", f"this host is {node} ({route.dst})", node)
    raise AddressError(f"no route to any allocated node ({', '.join(tried) or 'none'}): pass "
                       "--controller-address ADDR (an address of this host the nodes can reach)")


def node_address(node: str, run=subprocess.run) -> str | None:
    """The node's IP: its name if it resolves here, else Slurm's NodeAddr."""
    try:
        return socket.getaddrinfo(node, None, socket.AF_INET)[0][4][0]
    except OSError:
        pass
    p = run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True, timeout=30)
    addr = next((w.split("=", 1)[1] for w in p.stdout.split() if w.startswith("NodeAddr=")), "")
    try:
        return str(ipaddress.ip_address(addr))
    except ValueError:
        return None


def routes(nodes: Iterable[str], run=subprocess.run,
           address_of: Callable[[str], str | None] = node_address) -> Iterator[tuple[str, Route | None]]:
    for node in nodes:
        addr = address_of(node)
        if addr is None:
            yield node, None
            continue
        p = run(["ip", "-o", "route", "get", addr], capture_output=True, text=True, timeout=10)
        yield node, parse_route(p.stdout) if p.returncode == 0 else None


def check_local(address: str) -> None:
    """Whether this host can serve from `address`, asked before anything starts, so the user is
    told in one line which address to pass instead."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
            s.bind((address, 0))
    except OSError as e:
        raise AddressError(f"the controller cannot serve from {address}: {e.strerror} (it must be "
                           "an address of the host `tm-slurm run` runs on)") from None


# runs on the node, with the job's own python: a TCP connection like the agents' and workers'
_PROBE = """import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
except OSError as e:
    print(e)
    sys.exit(3)
"""


def probe(address: str, node: str, timeout: float, srun_timeout: float, srun_args=(),
          run=subprocess.run) -> str | None:
    """Why `node` cannot reach this host at `address`, or None: it did, or the probe's step could
    not start (then the agents' own steps will not either, and they say so)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.create_server((address, 0), family=family) as srv:
        port = srv.getsockname()[1]
        argv = ["srun", "-N1", "-n1", "-w", node, "--overlap", "--quiet", "--job-name=tm-reach",
                *srun_args, sys.executable, "-c", _PROBE, address, str(port), str(timeout)]
        try:
            p = run(argv, capture_output=True, text=True, timeout=srun_timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"{node} did not connect to {address}:{port} within {srun_timeout:.0f} s"
    if p.returncode == 3:
        return f"{node} cannot connect to {address}:{port}: {p.stdout.strip()}"
    return None


def serve_address(nodes: Iterable[str], override: str = "", interface: str = "") -> Served:
    served = choose(override, interface, routes(nodes))
    check_local(served.address)
    return served


__all__ = ["AddressError", "Route", "Served", "check_local", "choose", "parse_route", "probe",
           "routes", "serve_address"]
