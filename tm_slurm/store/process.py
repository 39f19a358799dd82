"""The store server's process, a child of the controller (docs/design.md §9).

`spawn` starts it: the store key comes on its stdin, never in argv or the environment; it answers
with its port on stdout and ends when that stdin closes (its controller ended, however). No torch
here, so it starts in a fraction of a second, and a large job's store traffic does not share the
controller's interpreter lock.
"""
from __future__ import annotations

import os
import selectors
import subprocess
import sys

from ..osutil import die_with_parent, raise_fd_limit
from .server import Server


class Spawned:
    """The server process of a job, seen from the process that started it."""

    def __init__(self, proc: subprocess.Popen, host: str, port: int):
        self.proc, self.host, self.port = proc, host, port

    @property
    def addr(self) -> tuple[str, int]:
        return self.host, self.port

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def spawn(key: bytes, host: str, timeout: float = 30.0) -> Spawned:
    """Start the server for `key` on `host` (any free port)."""
    proc = subprocess.Popen([sys.executable, "-m", "tm_slurm.store.process", host],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
                            preexec_fn=die_with_parent)
    proc.stdin.write(key)
    proc.stdin.flush()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    line = proc.stdout.readline() if sel.select(timeout) else b""
    sel.close()
    if not line.strip().isdigit():
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the job's store did not start on {host}: {line.decode(errors='replace').strip()!r}")
    return Spawned(proc, host, int(line))


def main(argv: list[str]) -> int:
    key = b""
    while len(key) < 32:
        chunk = os.read(0, 32 - len(key))
        if not chunk:
            return 2
        key += chunk
    raise_fd_limit()
    try:
        srv = Server(key, argv[0])
    except OSError as e:
        print(f"cannot listen on {argv[0]}: {e.strerror}", flush=True)
        return 2
    print(srv.port, flush=True)
    srv.serve(stop_fd=0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
