"""Agents joining the job: announce, Connect, answer a challenge (security model: docs/design.md §9).

An agent writes a sealed `Announce` into control/join/, so the controller calls Accept only when a
Connect is coming (MPI_Comm_accept blocks). Concurrent Connects are matched in arrival order, not
in the order of the announcements, and anyone who learns the port name can Connect too, so a link
is nobody until its first frame is a Hello sealed with the job secret that carries back the
link's challenge nonce. Links wait for that without blocking the loop; a link that fails (a bad
frame, or silence past `timeouts.auth_timeout_s`) is dropped and logged as `auth_refused`, and the
Accept it used is owed again, so an impostor cannot take a real agent's place.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..control import mpi as mpictl
from ..control.auth import AuthError, Keys, Sealer
from ..control.codec import DecodeError
from ..messages import Announce, Challenge, Hello

MAX_ACCEPTS_PER_TICK = 4     # a flood of Connects costs the loop a bounded amount per tick


@dataclass
class _Link:
    ch: mpictl.Channel
    nonce: str
    deadline: float
    may_be_knock: bool       # accepted while the no-show watchdog fired: maybe its throw-away link


@dataclass
class Admission:
    port: mpictl.Port
    keys: Keys
    job: str
    join_dir: Path
    timeout_s: float
    log: Callable[..., object]
    clock: Callable[[], float] = time.monotonic
    owed: int = 0
    dropped: int = 0
    links: list[_Link] = field(default_factory=list)
    _told: set = field(default_factory=set)

    def _notes(self) -> list[Path]:
        return sorted(p for p in self.join_dir.iterdir() if not p.name.startswith("."))  # not mid-write

    def announced(self) -> bool:
        return self.owed > 0 or bool(self.links) or bool(self._notes())

    def poll(self) -> list[tuple[mpictl.Channel, Hello]]:
        """Agents that proved they belong to this job since the last call."""
        self._read_announcements()
        for _ in range(min(self.owed, MAX_ACCEPTS_PER_TICK)):
            self.owed -= 1
            ch, knocked = self.port.accept()
            ch.sealer = Sealer(self.keys, self.job, "controller")
            nonce = secrets.token_hex(16)
            ch.send(Challenge(nonce))
            self.links.append(_Link(ch, nonce, self.clock() + self.timeout_s, knocked))
        out = []
        for link in list(self.links):
            hello = next((m for m in link.ch.poll() if isinstance(m, Hello)), None)
            if hello is not None and hello.nonce == link.nonce and link.ch.sealer.peer == hello.node:
                self.links.remove(link)
                out.append((link.ch, hello))
            elif link.ch.refused or hello is not None:
                self._drop(link, link.ch.refused_why or "a Hello that does not answer the challenge")
            elif self.clock() > link.deadline:
                self._drop(link, f"no authenticated Hello within {self.timeout_s}s", silent=True)
        return out

    def _read_announcements(self) -> None:
        for f in self._notes():
            try:
                raw = f.read_bytes()[:4096]
                f.unlink(missing_ok=True)
                msg = Sealer(self.keys, self.job, "controller").open(raw)
                if not isinstance(msg, Announce):
                    raise AuthError(f"{type(msg).__name__} is not an announcement")
            except (OSError, AuthError, DecodeError) as e:
                self.refused(f"join/{f.name}", str(e)[:200])
                continue
            self.owed += 1

    def _drop(self, link: _Link, why: str, silent: bool = False) -> None:
        self.links.remove(link)
        link.ch.abandon()           # never Disconnect: that waits for a peer who may never answer
        if not (silent and link.may_be_knock):
            self.owed += 1          # whoever that was took an Accept meant for an announced agent
        self.dropped += 1
        if self.dropped <= 10 or self.dropped % 100 == 0:    # a flood is a few lines, not one each
            self.log("auth_refused", peer="MPI link", why=why, links_refused=self.dropped)

    def refused(self, peer: str, why: str) -> None:
        """Log a refused frame once per peer (a flood is one line, not one per frame)."""
        if peer not in self._told:
            self._told.add(peer)
            self.log("auth_refused", peer=peer, why=why)
