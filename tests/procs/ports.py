"""Which TCP ports a job's processes listen on, and which process of the job each belongs to
(found through /proc, so nothing is guessed from argv), for a stranger to attack."""
from __future__ import annotations

import socket
from pathlib import Path

# an MPI launcher's processes: hydra's mpiexec listened on every address; the job's own
# (control/pmi.py) should listen on nothing
LAUNCHER = ("mpiexec", "mpiexec.hydra", "hydra_pmi_proxy", "mpiexec.gforke")


def role(name: str, cmdline: str) -> str:
    """Which of the job's processes: launcher, store, controller, agent or worker."""
    if name in LAUNCHER:
        return "launcher"
    for needle, what in ((" -m tm_slurm.control.pmi ", "launcher"), (" -m tm_slurm.store.process ", "store"), (" agent ", "agent"),
                         (" -m tm_slurm run ", "controller"), (" run ", "controller")):
        if needle in f" {cmdline} ":
            return what
    return "worker"


def job_listening_owners(job_dir: Path) -> dict[int, tuple[str, str, str]]:
    """port -> (name, command line, an address that reaches it) of the process that opened it
    (of those that hold the socket, the one whose parent does not: a launcher's listening socket
    is inherited by what it starts)."""
    procs = _job_pids(Path(job_dir))
    parent = {pid: ppid for pid, (ppid, _) in procs.items()}
    holders: dict[int, list[int]] = {}
    for pid in procs:
        for inode in _socket_inodes(pid):
            holders.setdefault(inode, []).append(pid)
    out = {}
    for inode, (addr, port) in _listening().items():
        pids = holders.get(inode)
        if pids:
            owner = next((p for p in pids if parent[p] not in pids), pids[0])
            out[port] = (procs[owner][1], _cmdline(owner), addr)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(bytes(1), b" ").decode(errors="replace")
    except OSError:
        return ""


def _job_pids(job_dir: Path) -> dict[int, tuple[int, str]]:
    """pid -> (ppid, name) of every process whose command line or environment names the job
    directory, and of their descendants."""
    needle = str(job_dir).encode()
    table: dict[int, tuple[int, str]] = {}
    ours = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            table[int(d.name)] = (ppid, name)
            if needle in (d / "cmdline").read_bytes() or needle in (d / "environ").read_bytes():
                ours.add(int(d.name))
        except (OSError, ValueError, IndexError):
            continue
    grew = True
    while grew:
        more = {pid for pid, (ppid, _) in table.items() if ppid in ours} - ours
        ours |= more
        grew = bool(more)
    return {pid: table[pid] for pid in ours}


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return out
    for fd in fds:
        try:
            link = str(fd.readlink())
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def _listening() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every TCP socket in LISTEN (state 0A) in this network
    namespace; a wildcard address as loopback."""
    out = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A":
                hexaddr, hexport = f[1].rsplit(":", 1)
                out[int(f[9])] = (_address(hexaddr), int(hexport, 16))
    return out


def _address(h: str) -> str:
    raw = bytes.fromhex(h)
    if len(raw) == 4:
        addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
        return "127.0.0.1" if addr == "0.0.0.0" else addr
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    addr = socket.inet_ntop(socket.AF_INET6, words)
    if addr.startswith("::ffff:"):
        addr = addr[7:]
    return "::1" if addr == "::" else ("127.0.0.1" if addr == "0.0.0.0" else addr)
