"""A rank's training state: what is registered, how it is digested, and how it moves.

State moves as raw tensors, one send per tensor straight into the receiver's tensors (3-4 GB/s on
loopback; pickling is 10-20x slower). Only a small `StateManifest` (names, shapes, dtypes,
optimizer hyper-parameters, scheduler state) goes ahead of them, as a sealed control-plane frame
(never a pickle). A receiver that already holds optimizer state (a warmed standby) receives in
place; otherwise it allocates from the manifest first.
"""
from __future__ import annotations

import copy
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import faults
from ..comm.handles import finish
from ..control.auth import Sealer
from ..messages import StateManifest


@dataclass
class TrainState:
    """What the user's `build` returns: the runtime owns optimizer.step() and moves all of it."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    extra: dict = field(default_factory=dict)   # user values to carry along (small, plain values)
    registered: dict = field(default_factory=dict)  # name -> object with state_dict/load_state_dict


class Rollback:
    """What a step changes besides the optimizer's work, taken at the step's start and put back
    when the vote discards the step: the model's buffers (BatchNorm's running statistics and
    counter, any registered buffer: the forward pass updates them before the vote) and the
    objects the script registered (`job.register`). Buffers are copied into tensors allocated
    once, in one foreach copy (150 BatchNorm buffers: ~60 us here); a model without buffers
    costs nothing."""

    def __init__(self, state: TrainState):
        self.state = state
        self._bufs: list[torch.Tensor] = []
        self._saved: list[torch.Tensor] = []
        self._objs: dict[str, object] = {}

    def take(self) -> None:
        bufs = [_local(b) for b in self.state.model.buffers()]
        if bufs:
            if [(b.shape, b.dtype, b.device) for b in bufs] != [(b.shape, b.dtype, b.device) for b in self._saved]:
                self._saved = [torch.empty_like(b) for b in bufs]      # first step, or the model changed
            torch._foreach_copy_(self._saved, bufs)
        self._bufs = bufs
        if self.state.registered:
            self._objs = {n: copy.deepcopy(o.state_dict()) for n, o in self.state.registered.items()}

    def restore(self) -> None:
        if self._bufs:
            with torch.no_grad():
                torch._foreach_copy_(self._bufs, self._saved)
        for n, sd in self._objs.items():
            self.state.registered[n].load_state_dict(copy.deepcopy(sd))


def _opt_params(opt: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for g in opt.param_groups for p in g["params"]]


def named(state: TrainState) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the state in a canonical order (the same on sender and receiver), sharded
    ones (FSDP2's DTensors) as they are: what a checkpoint saves with their global shapes."""
    out = [(f"model.{k}", v) for k, v in state.model.state_dict(keep_vars=True).items()
           if isinstance(v, torch.Tensor)]
    if state.optimizer is not None:
        for i, p in enumerate(_opt_params(state.optimizer)):
            st = state.optimizer.state.get(p, {})
            for k in sorted(st):
                if isinstance(st[k], torch.Tensor):
                    out.append((f"opt.{i}.{k}", st[k]))
    return [(n, t.data if isinstance(t, torch.nn.Parameter) else t) for n, t in out]


def tensors(state: TrainState) -> list[tuple[str, torch.Tensor]]:
    """`named`, each as this rank's local tensor: what moves, and what a digest covers."""
    return [(n, _local(t)) for n, t in named(state)]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor (FSDP2's DTensor) moves, checkpoints and digests as this rank's shard:
    the local tensor, which shares its storage (receiving into it updates the parameter)."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def manifest(state: TrainState, step: int) -> StateManifest:
    opt = state.optimizer
    groups, scalars = (), {}
    if opt is not None:
        groups = tuple({k: v for k, v in g.items() if k != "params"} for g in opt.param_groups)
        scalars = {i: {k: v for k, v in opt.state.get(p, {}).items() if not isinstance(v, torch.Tensor)}
                   for i, p in enumerate(_opt_params(opt))}
    return StateManifest(step, tuple((n, tuple(t.shape), str(t.dtype)) for n, t in tensors(state)),
                         groups, scalars, state.scheduler.state_dict() if state.scheduler is not None else None,
                         dict(state.extra), {n: o.state_dict() for n, o in state.registered.items()})


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def allocate(state: TrainState, wanted: dict[str, tuple[tuple[int, ...], str]], local: bool) -> None:
    """Give the optimizer a tensor for each `opt.<i>.<key>` in `wanted` (name -> shape, dtype),
    keeping those of the right shape and dropping any other. Shapes are local ones (`local`: a transfer's manifest) or
    global ones (a checkpoint, whose layout may differ); a parameter's state of its shape is
    sharded as the parameter (FSDP2)."""
    opt = state.optimizer
    if opt is None:
        return
    for i, p in enumerate(_opt_params(opt)):
        st = opt.state.setdefault(p, {})
        for k in [k for k, v in st.items() if isinstance(v, torch.Tensor) and f"opt.{i}.{k}" not in wanted]:
            del st[k]                    # not in the state being taken over
        own = tuple((_local(p) if local else p).shape)
        for n in [n for n in wanted if n.startswith(f"opt.{i}.")]:
            k, (shape, dt) = n.split(".", 2)[2], wanted[n]
            cur = st.get(k)
            cur = (_local(cur) if local else cur) if isinstance(cur, torch.Tensor) else None
            if cur is not None and tuple(cur.shape) == tuple(shape) and str(cur.dtype) == dt:
                continue
            if isinstance(p, DTensor) and tuple(shape) == own:
                st[k] = torch.zeros_like(p, dtype=_dtype(dt))
            else:
                st[k] = torch.empty(tuple(shape), dtype=_dtype(dt), device=_local(p).device)


def apply_plain(state: TrainState, m: StateManifest) -> None:
    """The non-tensor state: optimizer hyper-parameters and per-parameter values, scheduler, extra."""
    opt = state.optimizer
    if opt is not None:
        for g, saved in zip(opt.param_groups, m.param_groups):
            g.update(saved)
        for i, p in enumerate(_opt_params(opt)):
            opt.state.setdefault(p, {}).update(m.opt_scalars.get(i, {}))
    if state.scheduler is not None and m.scheduler is not None:
        state.scheduler.load_state_dict(m.scheduler)
    state.extra.clear()
    state.extra.update(m.extra)
    for n, sd in m.registered.items():
        if n in state.registered:
            state.registered[n].load_state_dict(sd)


def apply_manifest(state: TrainState, m: StateManifest) -> list[torch.Tensor]:
    """Make `state` structurally equal to the sender's and return the tensors to receive into,
    in canonical order. Existing tensors of the right shape are reused (no allocation)."""
    allocate(state, {n: (tuple(shape), dt) for n, shape, dt in m.tensors}, local=True)
    apply_plain(state, m)
    mine = tensors(state)
    theirs = [(n, tuple(shape), dt) for n, shape, dt in m.tensors]
    if [(n, tuple(t.shape), str(t.dtype)) for n, t in mine] != theirs:
        diff = sorted(set((n, tuple(t.shape), str(t.dtype)) for n, t in mine) ^ set(theirs))[:5]
        raise RuntimeError(f"state of the receiving rank does not match the sender's: {diff}")
    return [t for _, t in mine]


def digest(state: TrainState) -> str:
    """sha256 over every tensor's bytes plus the non-tensor optimizer state: equal digests mean
    bit-identical training state."""
    h = hashlib.sha256()
    for n, t in tensors(state):
        h.update(f"{n}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    m = manifest(state, 0)
    h.update(repr((m.param_groups, sorted(m.opt_scalars.items()), m.scheduler,
                   sorted(m.extra.items()), sorted(m.registered.items()))).encode())
    return h.hexdigest()


def nbytes(state: TrainState) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors(state))


# ---------------------------------------------------------------- over a two-member group

def _device(state: TrainState) -> torch.device:
    """Where the link's tensors must live (NCCL sends device memory only)."""
    return next((t.device for _, t in tensors(state)), torch.device("cpu"))


def _send_bytes(pg, data: bytes, peer: int, device: torch.device, timeout_s: float) -> None:
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    finish([pg.send([n], peer, 0)], timeout_s)
    finish([pg.send([torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)], peer, 0)], timeout_s)


def _recv_bytes(pg, peer: int, device: torch.device, timeout_s: float) -> bytes:
    n = torch.zeros(1, dtype=torch.int64, device=device)
    finish([pg.recv([n], peer, 0)], timeout_s)
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    finish([pg.recv([buf], peer, 0)], timeout_s)
    return buf.cpu().numpy().tobytes()


def send_state(pg, state: TrainState, step: int, sealer: Sealer, peer: int = 1,
               timeout_s: float = 120.0) -> dict:
    """Send `state` (the manifest, then the raw tensors) and return once every send has
    completed (comm.handles.finish: on NCCL a work's wait() does not block the host, and a
    leaver that exits after it would end before its state had left). `transfer_s` is that."""
    t0 = time.perf_counter()
    device = _device(state)
    _send_bytes(pg, sealer.seal(manifest(state, step)), peer, device, timeout_s)
    ts = [t.detach().contiguous() for _, t in tensors(state)]
    # with a fault armed, half the tensors go (and complete) before the fault point
    half = len(ts) // 2 if faults.armed() else 0
    finish([pg.send([t], peer, i + 1) for i, t in enumerate(ts[:half])], timeout_s)
    if half:
        faults.at("transfer.mid")
    finish([pg.send([t], peer, i + 1) for i, t in enumerate(ts[half:], half)], timeout_s)
    dt = time.perf_counter() - t0
    b = sum(t.numel() * t.element_size() for t in ts)
    return {"bytes": b, "transfer_s": dt, "tensors": len(ts)}


def recv_state(pg, state: TrainState, sealer: Sealer, peer: int = 0,
               timeout_s: float = 120.0) -> tuple[int, dict]:
    """Receive into `state`; returns (the sender's step, timing), once every receive has
    completed. A manifest that fails its check raises AuthError before anything is received
    into `state`."""
    t0 = time.perf_counter()
    m = sealer.open(_recv_bytes(pg, peer, _device(state), timeout_s))
    if not isinstance(m, StateManifest):
        raise TypeError(f"expected a StateManifest on the transfer link, got {type(m).__name__}")
    ts = apply_manifest(state, m)
    bufs = [t if t.is_contiguous() else torch.empty_like(t) for t in ts]
    finish([pg.recv([b], peer, i + 1) for i, b in enumerate(bufs)], timeout_s)
    with torch.no_grad():
        for t, b in zip(ts, bufs):
            if b is not t:
                t.copy_(b)
    dt = time.perf_counter() - t0
    b = sum(t.numel() * t.element_size() for t in ts)
    return m.step, {"bytes": b, "transfer_s": dt, "tensors": len(ts)}
