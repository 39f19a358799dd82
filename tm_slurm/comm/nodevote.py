"""A node's ranks vote as one (docs/design.md §9): the store sees one vote per node, not per rank.

The node's workers combine their verdicts with one MIN all-reduce over a gloo group of their own
(loopback: only this node's processes, built when they start, standbys too), the first of them
votes for the node in the store (comm/vote.py, `per_node`), and a broadcast hands its decision to
the others. Store operations per step fall from 4 per rank to 4 per node (comm/vote.py): 8,192
ranks on 1,024 nodes are 1,024 voters.

The guarantees stay those of the store vote: a rank that saw a failure makes its node vote abort;
the decision is the one in the store. A worker of the node that dies or hangs fails the node's
collective; its node is fenced whole anyway (agent.py), and the survivors on it abort the step in
the store directly, which gives them the decision that stands (a commit may have won). The
group's timeout is longer than the leader's longest wait for a decision, so a mate never gives
up on a leader that is still waiting legitimately."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import vote as votes
from ..messages import GroupBuild
from .groups import gather
from .listeners import gloo_group

# the decision as JSON, length-prefixed; `why` is cut to fit
BUF = 512


def pack(d: votes.Decision) -> torch.Tensor:
    raw = d.encode().encode()
    if len(raw) > BUF - 2:
        raw = votes.Decision(d.commit, d.switch, d.gen_to, d.checkpoint, d.exit, d.why[:200]).encode().encode()
    buf = torch.zeros(BUF, dtype=torch.uint8)
    buf[0], buf[1] = len(raw) >> 8, len(raw) & 0xFF
    buf[2:2 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def unpack(buf: torch.Tensor) -> votes.Decision:
    n = (int(buf[0]) << 8) | int(buf[1])
    return votes.Decision.decode(bytes(buf[2:2 + n].tolist()))


class NodeVote:
    """`local`/`per_node`: this worker's index on its node and the node's worker count; `spawn`:
    the agent's token for this set of workers (a restarted set rendezvous afresh)."""

    def __init__(self, store, spawn: str, local: int, per_node: int, timeout_s: float):
        self.local, self.per_node = local, per_node
        self.pg = None
        if per_node > 1:
            prefix = f"nodevote/{spawn}"
            pstore = dist.PrefixStore(prefix, store)
            gather(pstore, GroupBuild("nodevote", tuple(range(per_node)), prefix), local)
            self.pg = gloo_group(pstore, local, per_node, iface="127.0.0.1", timeout_s=timeout_s)

    def __call__(self, store, gen: int, step: int, world: int, ok: bool, timeout: float,
                 rank: int) -> votes.Decision:
        if self.pg is None:
            return votes.vote(store, gen, step, world, ok, timeout, rank)
        if self.local == 0 and rank % self.per_node:
            raise RuntimeError(f"rank {rank} is its node's first worker but not the first rank of a "
                               f"node of {self.per_node}: the store vote would miss a node")
        try:
            flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
            o = dist.AllreduceOptions()
            o.reduceOp = dist.ReduceOp.MIN
            self.pg.allreduce([flag], o).wait()
            buf = torch.zeros(BUF, dtype=torch.uint8)
            if self.local == 0:
                d = votes.vote(store, gen, step, world, bool(flag.item()), timeout, rank, self.per_node)
                buf = pack(d)
            b = dist.BroadcastOptions()
            b.rootRank = 0
            self.pg.broadcast([buf], b).wait()
            return d if self.local == 0 else unpack(buf)
        except Exception as e:      # a node-mate is gone: this node is being fenced
            return votes.abort(store, gen, step, f"a worker of this node is gone ({type(e).__name__})")
