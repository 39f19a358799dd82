"""The MPI link layer on one process's own communicator (both ends of a link, told apart by tag,
as bench/controlplane.py plays them): frames cut into injected pieces and put back together,
one Testsome over every link, and what a hostile peer can send."""
from __future__ import annotations

import pytest

from tm_slurm.control import auth
from tm_slurm.control import mpi as mpictl
from tm_slurm.messages import Ping, Stop

KEYS = auth.Keys.derive(b"c" * 32)


def link():
    comm = mpictl.mpi().COMM_SELF.Dup()
    up, down = mpictl.Channel(comm, tags=(8, 7)), mpictl.Channel(comm, tags=(7, 8))
    up.sealer = auth.Sealer(KEYS, "j", "ctl", peer="n")
    down.sealer = auth.Sealer(KEYS, "j", "n", peer="ctl")
    return up, down


def drain(links, want: int) -> dict:
    got: dict = {}
    for _ in range(200):
        for k in mpictl.arrived(links):
            got.setdefault(k, []).extend(links[k].poll())
        if sum(map(len, got.values())) >= want:
            break
    return got


def test_frames_of_any_size_arrive_whole_and_only_links_with_data_are_touched():
    ends = {f"n{i}": link() for i in range(40)}
    ups = {k: u for k, (u, _) in ends.items()}
    assert mpictl.arrived(ups) == []
    big = Stop("x" * (3 * mpictl.INJECT_BYTES + 17))      # four pieces
    ends["n3"][1].send(Ping(1, 0.0))
    ends["n7"][1].send(big)
    ends["n7"][1].send(Ping(2, 0.0))
    got = drain(ups, 3)
    assert sorted(got) == ["n3", "n7"]
    assert got["n3"] == [Ping(1, 0.0)] and got["n7"] == [big, Ping(2, 0.0)]
    for u, d in ends.values():
        u.abandon()
        d.abandon()


def test_a_piece_or_frame_too_big_is_refused_and_the_link_goes_on(monkeypatch):
    up, down = link()
    MPI = mpictl.mpi()
    down.comm.Send([bytearray(mpictl.INJECT_BYTES + 1), MPI.BYTE], dest=0, tag=7)   # not ours
    assert up.poll() == [] and up.refused == 1 and "inject" in up.refused_why
    monkeypatch.setattr(mpictl, "MAX_FRAME", 2 * mpictl.INJECT_BYTES)
    down.send(Stop("y" * (3 * mpictl.INJECT_BYTES)))
    down.send(Ping(3, 0.0))
    got = drain({"n": up}, 1)
    assert got["n"] == [Ping(3, 0.0)] and up.refused == 2 and "over" in up.refused_why
    down.comm.Send([bytearray(b"\0garbage"), MPI.BYTE], dest=0, tag=7)          # unsealed
    assert up.poll() == [] and up.refused == 3
    up.abandon()
    assert up.dead and up.rreq is None and mpictl.arrived({"n": up}) == []
