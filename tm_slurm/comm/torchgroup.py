"""Process groups for stock torch code (docs/design.md §3): `DistributedDataParallel(process_group=
job.group("dp"))`, `dist.all_reduce(t, group=...)`.

A `TorchGroup` is a real `dist.ProcessGroup` (torch's C++ side calls its collectives through the
pybind trampoline) that stays the same Python object for the whole life of the worker, rehearsal
included. Each collective looks its group up in the bound table at call time, so a swap that
replaces the group's instance (only groups with a moving rank: the delta rule) is seen at the
next collective, and a group the swap keeps is untouched. Failures fail through
(`GroupTable.call`): DDP's backward completes, and the vote discards the step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .handles import FailThroughWork, done

# the collectives torch's own code calls on a group (DDP: allreduce, broadcast, allgather;
# dist.*: the rest); anything else raises, as on a group without that op
OPS = ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
       "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
       "reduce_scatter_tensor_coalesced", "barrier", "send", "recv")


def outputs(args: tuple) -> list:
    """The tensors a collective writes (its future's value): its first argument."""
    if not args or not isinstance(args[0], (list, torch.Tensor)):
        return []                              # barrier
    return args[0] if isinstance(args[0], list) else [args[0]]


def serve_locally(op: str, args: tuple, size: int) -> None:
    """`op` as if every other member held this rank's values: what a group of one computes, and
    what a sandbox serves in place of the real group (docs/design.md §5). recv is the caller's."""
    if op == "allgather":                      # (out lists, inputs, opts)
        for outs, t in zip(args[0], args[1]):
            for o in outs:
                o.copy_(t)
    elif op in ("_allgather_base", "allgather_into_tensor_coalesced"):   # (out(s), input(s))
        pairs = zip(args[0], args[1]) if isinstance(args[0], list) else [(args[0], args[1])]
        for out, t in pairs:
            for chunk in out.reshape(size, -1):
                chunk.copy_(t.reshape(-1))
    elif op == "reduce_scatter":               # (outputs, input lists, opts)
        for out, ins in zip(args[0], args[1]):
            out.copy_(ins[0])
    elif op in ("_reduce_scatter_base", "reduce_scatter_tensor_coalesced"):
        pairs = zip(args[0], args[1]) if isinstance(args[0], list) else [(args[0], args[1])]
        for out, t in pairs:
            out.copy_(t.reshape(size, -1)[0].view_as(out))
    # allreduce, broadcast, barrier, send: the local values are the result


class TorchGroup(dist.ProcessGroup):
    """One of a rank's groups (`kind`: "dp" or "tp") as a torch ProcessGroup. `bind` points it
    at a table and a group id: the sandbox's while a standby rehearses, the worker's once it
    holds a rank (whose group id and group rank it takes then)."""

    def __init__(self, kind: str, size: int):
        super().__init__(0, size)
        self.kind = kind
        self._table = None
        self._gid: str | None = None
        self._grank = 0

    def bind(self, table, gid: str | None, grank: int) -> None:
        self._table, self._gid, self._grank = table, gid, grank

    def rank(self) -> int:        # Python callers; the C++ rank, fixed at construction, is unused
        return self._grank

    def getBackendName(self) -> str:
        return "tm_slurm"

    def __repr__(self) -> str:
        return f"TorchGroup({self.kind}, {self._gid or 'local'}, rank {self._grank} of {self.size()})"

    def _call(self, op: str, args: tuple) -> FailThroughWork:
        outs = outputs(args)
        if self._table is None:
            raise RuntimeError(f"{self!r} is not bound to a table yet: use it from the training "
                               "script after tm_slurm.init() returned")
        if self._gid is None:                  # a group of one
            serve_locally(op, args, 1)
            return done(outs)
        return self._table.call(self._gid, op, args, outs)


def _op(name: str):
    def op(self, *args):
        return self._call(name, args)
    op.__name__ = op.__qualname__ = name
    return op


for _name in OPS:
    setattr(TorchGroup, _name, _op(_name))
