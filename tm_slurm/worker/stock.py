"""The stock-loop API (README "Porting"): a script keeps its own loop, its DDP and its optimizer.

    job = tm_slurm.init()                                   # in place of init_process_group
    model = DDP(net, process_group=job.group("dp"))
    opt = job.optimizer(model, torch.optim.AdamW(model.parameters()))
    for step in job.steps(1000):                            # in place of range(1000)
        loss = model(batch(step, job.dp_rank)).sum()
        opt.zero_grad(); loss.backward(); opt.step()        # step(): the commit vote, then the update

How it is driven: the runtime's start (`loop.start`: the build, and a standby's sandboxed
rehearsal and promotion) runs on a thread of its own and sees the script as a build function
(everything up to the loop) and a step function (one pass of the loop body); the two threads
take turns through a `Baton`, so exactly one of them runs at any time and the script's code
always runs on its main thread. Then the runtime hands the training loop (`loop.training`, with
the vote, the optimizer step under a commit, swaps and recovery) to the script's thread, and
`opt.step()` runs it on to the next step there: a healthy step costs no hand-off between threads
(two cost ~0.17 ms a step here). A step that the vote discards is handed to the script again; a
standby's script runs its first steps as a rehearsal (`job.sandbox`), then waits inside
`opt.step()` until it is promoted. When the last step has committed, and the runtime has
checkpointed the final state, `job.steps()` returns on every active rank and the script's code
after its loop runs; a standby that was never promoted never gets there (it is ended with the job).
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from ..comm.groups import bind_device
from ..comm.torchgroup import TorchGroup, WorldGroup, register, set_rank
from ..data import StepSampler
from ..errors import MisuseError
from . import loop
from .context import Context
from .rank import Worker
from .state import TrainState


class Baton:
    """Turn-taking between the runtime's thread and the script's: whoever hands over waits until
    it is handed back."""

    def __init__(self):
        self._user, self._runtime = threading.Semaphore(0), threading.Semaphore(0)
        self.value = None

    def to_user(self, value):
        self.value = value
        self._user.release()
        self._runtime.acquire()
        return self.value

    def to_runtime(self, value):
        self.value = value
        self._runtime.release()
        return self.wait_user()

    def hand_over(self, value) -> None:
        """The runtime's last turn: the script's thread goes on alone."""
        self.value = value
        self._user.release()

    def wait_user(self):
        self._user.acquire()
        return self.value


class Optimizer:
    """The script's optimizer, stepped by the runtime: `step()` ends the step, the commit vote
    decides, and only a committed step is applied (with the scheduler's step)."""

    def __init__(self, job: Job, opt: torch.optim.Optimizer):
        self._job, self.optimizer = job, opt

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None) -> None:
        if closure is not None:
            raise MisuseError("opt.step(closure) is not supported under tm_slurm: compute the loss "
                              "in the loop body and call opt.step()")
        self._job._end_step()

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self):
        return self.optimizer.state_dict()


class _Rank:
    """What a script reads of its rank (live: a standby learns its rank when promoted)."""

    @property
    def ctx(self) -> Context:
        raise NotImplementedError

    def __getattr__(self, name):
        if name in ("rank", "world", "dp_rank", "dp_size", "tp_rank", "tp_size", "device", "seed", "sandbox"):
            return getattr(self.ctx, name)
        raise AttributeError(name)

    @property
    def is_main(self) -> bool:
        """Whether this process writes what is written once (rank 0; never a rehearsing standby)."""
        return self.ctx.rank == 0 and not self.ctx.sandbox

    def generator(self, name: str = "default", device=None) -> torch.Generator:
        """A generator of the script's own (dropout masks, noise, augmentation), reseeded at each
        step's start from (seed, step, rank, name): a repeated step or a joiner draws the same."""
        return self._seeds.generator(name, device)

    def sampler(self, dataset, batch_size: int, micro_batches: int = 1, shuffle: bool = True,
                drop_last: bool = True, seed: int | None = None):
        """In place of DistributedSampler: `DataLoader(ds, batch_size=batch_size,
        sampler=job.sampler(ds, batch_size, micro_batches))`, iterated once inside each step,
        gives this step's `micro_batches` batches for this DP rank, whoever runs the step
        (tm_slurm/data.py)."""
        return StepSampler(dataset, batch_size, self._position, micro_batches=micro_batches,
                           shuffle=shuffle, drop_last=drop_last,
                           seed=self.ctx.seed if seed is None else seed)

    def _position(self) -> tuple[int, int, int]:
        if self._stepping is None:
            raise MisuseError("job.sampler's DataLoader is iterated inside a step of job.steps(): "
                              "it reads that step's batches (iterate it once per step)")
        return self._stepping, self.ctx.dp_rank, self.ctx.dp_size

    def register(self, name: str, obj) -> None:
        """Carry an object's state with the rank's (`state_dict()` / `load_state_dict()`, plain
        values: a metric's running sum, a curriculum's position): restored when a step is
        discarded, moved to a joiner, checkpointed."""
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise MisuseError(f"job.register({name!r}, ...): the object needs state_dict() and load_state_dict()")
        if isinstance(obj, torch.nn.Module):
            raise MisuseError(f"job.register({name!r}, ...) is for plain state: a module's tensors are "
                              "the model's (keep it inside the model given to job.optimizer)")
        self._registered[name] = obj

    def group(self, kind: str) -> TorchGroup:
        """This rank's group of `kind` ("dp", "tp"; with HSDP "dp_shard", "dp_rep") as a torch
        ProcessGroup: the same object for the whole run (the group under it changes at swaps)."""
        if kind not in self.ctx.groups:
            raise ValueError(f"no group kind {kind!r} in this layout: valid kinds are {sorted(self.ctx.groups)}")
        return self.ctx.groups[kind]

    def mesh(self):
        """This rank's data (x tensor) parallel DeviceMesh over the runtime's groups, for
        `fully_shard` and `parallelize_module`: dims ("dp",), or ("dp_rep", "dp_shard") for HSDP,
        then "tp" when layout.tp > 1 (`job.dp_dims` names the DP part: fully_shard(m,
        mesh=mesh[job.dp_dims]); parallelize_module(m, mesh["tp"], plan))."""
        from torch.distributed.device_mesh import DeviceMesh
        dims = self.ctx.mesh_dims
        groups = [self.group(d) for d in dims]
        return DeviceMesh.from_group(groups if len(groups) > 1 else groups[0], self.ctx.device.type,
                                     mesh=self.ctx.mesh, mesh_dim_names=dims)

    @property
    def dp_dims(self) -> tuple[str, ...]:
        return tuple(d for d in self.ctx.mesh_dims if d != "tp")


class Job(_Rank):
    """What `tm_slurm.init()` returns under tm-slurm: this process's rank and groups, the
    optimizer wrapper and the step iterator."""

    def __init__(self, w: Worker):
        self._w = w
        self._seeds = w.seeds
        self._registered: dict = {}
        self._baton = Baton()
        self._ctx: Context | None = None
        self._state: TrainState | None = None
        self._stepping: int | None = None       # the step the script is in, until opt.step()
        self._yielded: int | None = None        # ... and after it, until the next one
        self._training: Iterator[int] | None = None     # loop.training, once handed over
        self._runtime: threading.Thread | None = None

    @property
    def ctx(self) -> Context:
        return self._ctx

    def optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None) -> Optimizer:
        """Register what the runtime moves, checkpoints and digests (the model, e.g. the DDP
        module, its optimizer and scheduler) and get the optimizer to step in the loop."""
        if self._state is not None:
            raise MisuseError("job.optimizer() is called once, with the model and its optimizer")
        lay = self._w.cfg.layout
        if lay.dp_shard != lay.dp and _sharded_over(model, self.group("dp")):
            raise MisuseError(
                f"the model is sharded over job.group('dp') (FSDP2) but layout.dp_shard is {lay.dp_shard}: "
                "the runtime would recover a rank's shard from another DP rank's. Set layout.dp_shard "
                f"(--dp-shard {lay.dp} for fully_shard over the whole DP group; or shard over "
                "job.mesh() for HSDP)")
        self._state = TrainState(model, optimizer, scheduler, registered=self._registered)
        w = self._w

        def only_the_runtime(*_):
            if not w.applying:
                raise MisuseError("optimizer.step() was called on the optimizer itself: call step() "
                                  "on what job.optimizer() returned (it applies the step only after "
                                  "every rank has voted to commit it)")
        optimizer.register_step_pre_hook(only_the_runtime)
        if scheduler is not None:
            _runtime_steps(scheduler, w)
        return Optimizer(self, optimizer)

    def steps(self, total: int) -> Iterator[int]:
        """The steps to run, in place of `range(total)`: resumes where a checkpoint or a joiner's
        state says, repeats a discarded step, rehearses on a standby."""
        if self._state is None:
            raise MisuseError("call job.optimizer(model, optimizer) before job.steps()")
        self._w.total_steps = total
        msg = self._baton.to_runtime(self._state)      # the build is done
        while True:
            kind, self._ctx, step = msg
            if kind == "train":                          # the runtime's hand-over (_drive)
                self._training = step
                self._ctx, step = self._w.ctx, self._run(next, self._training)
            elif kind != "step":
                raise MisuseError("the runtime asked this script to build its model again: the "
                                  "stock-loop API builds once (pipeline parallel jobs use tm_slurm.run)")
            if step is None:
                return                                   # trained, and the final state checkpointed
            self._stepping = self._yielded = step
            yield step
            if self._stepping is not None:
                raise MisuseError(f"step {step} ended without opt.step() on the optimizer that "
                                  "job.optimizer() returned: the runtime commits a step there")
            msg = self._next

    def _end_step(self) -> None:
        if self._stepping is None:
            raise MisuseError("opt.step() outside a step of job.steps(), or twice in one step")
        self._stepping = None
        if self._training is None:                   # a rehearsal, or a standby until promoted
            self._next = self._baton.to_runtime(None)
        else:
            self._next = ("step", self._w.ctx, self._run(self._training.send, None))

    def _run(self, f, *a):
        """The training loop on this thread: the next step, or None once it is over. An error in
        it is the runtime's, reported as such (it ends the process), never the script's to catch."""
        try:
            return f(*a)
        except StopIteration:
            return None
        except BaseException as e:
            loop.crashed(self._w.inbox.wire, e, w=self._w)

    # ---- the runtime's side (its thread)
    def _build(self, ctx: Context) -> TrainState:
        return self._baton.to_user(("build", ctx, None))

    def _step(self, ctx: Context, state: TrainState, step: int):
        self._baton.to_user(("step", ctx, step))

    def _drive(self) -> None:
        w = self._w
        try:
            bind_device(w.device)
            first = loop.start(w, self._build, self._step)    # w.total_steps is known after it
            training = loop.training(w, w.total_steps, first)
        except BaseException:
            loop.crashed(w.inbox.wire, w=w)
        self._baton.hand_over(("train", None, training))


class PlainJob(_Rank):
    """`tm_slurm.init()` under torchrun: the same script trains on plain groups, without the
    runtime (no vote, no swaps): the steady-state baseline, and a way to debug a port."""

    def __init__(self):
        from .plain import PlainRun
        self._run = PlainRun()
        self._seeds = self._run.seeds
        self._registered: dict = {}
        self._stepping: int | None = None
        self._state: TrainState | None = None
        world = WorldGroup(self.ctx.world)
        register(self.ctx.groups, world)
        set_rank(world, self.ctx.rank)

    @property
    def ctx(self) -> Context:
        return self._run.ctx

    def optimizer(self, model, optimizer, scheduler=None) -> Optimizer:
        self._state = TrainState(model, optimizer, scheduler, registered=self._registered)
        return Optimizer(self, optimizer)

    def steps(self, total: int) -> Iterator[int]:
        if self._state is None:
            raise MisuseError("call job.optimizer(model, optimizer) before job.steps()")
        for step in self._run.steps(self._state, total):
            self._stepping = step
            yield step
        self._stepping = None

    def _end_step(self) -> None:
        self._state.optimizer.step()
        if self._state.scheduler is not None:
            self._state.scheduler.step()


def _sharded_over(model: torch.nn.Module, group) -> bool:
    """Whether a parameter of `model` is a DTensor sharded along a mesh dimension of `group`."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            if any(pl.is_shard() and mesh.get_group(d) is group for d, pl in enumerate(p.placements)):
                return True
    return False


def _runtime_steps(scheduler, w: Worker) -> None:
    """The scheduler given to job.optimizer() steps with each committed optimizer step, by the
    runtime: a `sched.step()` left in the loop would run the schedule twice as fast (and a
    OneCycleLR past its end), so it fails at once. The instance's class becomes a subclass (its
    state_dict, which copies the instance's attributes, stays as it was)."""
    cls = type(scheduler)

    def step(self, *a, **kw):
        if not w.applying:
            raise MisuseError(f"{cls.__name__}.step() was called by the script: the scheduler given "
                              "to job.optimizer() is stepped by the runtime with each committed "
                              "opt.step(); remove the script's call")
        return cls.step(self, *a, **kw)
    scheduler.__class__ = type(cls.__name__, (cls,), {"step": step, "__module__": cls.__module__})


def _keyed_data(loader) -> None:
    """A DataLoader's order must be a function of the step (job.sampler): the position of a
    DistributedSampler or of DataLoader(shuffle=True) is the iterator's, which a repeated step or a
    joiner does not have, so their batches would differ silently."""
    sampler = getattr(loader.batch_sampler, "sampler", None) or loader.sampler
    if isinstance(sampler, StepSampler) and loader.batch_size != sampler.batch_size:
        raise MisuseError(f"DataLoader(batch_size={loader.batch_size}) over job.sampler(..., batch_size="
                          f"{sampler.batch_size}): give both the same batch size, so that the loader "
                          f"yields the step's {sampler.micro_batches} micro-batch(es)")
    if isinstance(sampler, DistributedSampler):
        raise MisuseError("a DataLoader with a DistributedSampler under tm_slurm: its position is "
                          "lost when a step is repeated or a standby takes over. Use "
                          "sampler=job.sampler(dataset, batch_size, micro_batches) and iterate the "
                          "loader once inside each step (README \"Porting\")")
    if isinstance(sampler, RandomSampler):
        raise MisuseError("DataLoader(shuffle=True) under tm_slurm: every rank would shuffle alone "
                          "and a repeated step or a standby would read other samples. Use "
                          "sampler=job.sampler(dataset, batch_size, micro_batches) (README \"Porting\")")


def _forbid(what: str, instead: str):
    def forbidden(*_, **__):
        raise MisuseError(f"{what} is not available under tm_slurm: {instead}")
    return forbidden


def _guard_torch() -> None:
    """torch.distributed calls that would make groups the runtime does not know (and so could not
    swap) fail at once, saying what to use instead (a collective on the default group does too:
    `WorldGroup`)."""
    from torch.distributed import distributed_c10d as c10d
    init = _forbid("init_process_group", "tm_slurm.init() takes its place")
    new = _forbid("dist.new_group", "use job.group('dp') or job.group('tp'), the groups the "
                  "runtime keeps through swaps")
    for mod in (dist, c10d):
        mod.init_process_group, mod.new_group = init, new
    iterate = DataLoader.__iter__

    def checked_iter(loader):
        _keyed_data(loader)
        return iterate(loader)
    DataLoader.__iter__ = checked_iter


def init() -> Job | PlainJob:
    """Start this rank under tm-slurm; returns when the script is to build its model (on an
    active rank at once, on a standby when it starts its rehearsal)."""
    if os.environ.get(loop.ENV_FD) is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return PlainJob()                 # launched by torchrun: plain training, no swaps
    wire, keys = loop.connect("under torchrun it trains without the runtime")
    try:
        w = Worker(wire, keys)
        lay, sb = w.cfg.layout, w.cfg.standby
        if lay.pp > 1:
            raise MisuseError("tm_slurm.init() serves data, sharded and tensor parallel jobs (pp == 1); "
                              "a pipeline parallel job uses tm_slurm.run(build, step, steps)")
        if not sb.sandbox or sb.sandbox_steps < 2:
            raise MisuseError("tm_slurm.init() needs standby.sandbox on with sandbox_steps >= 2: "
                              "DDP settles its gradient buckets (a broadcast) in its second step, "
                              "and a joiner must have done so before it joins the others")
        _guard_torch()
        w.world = WorldGroup(lay.world)
        register(w.torch_groups, w.world)
        job = Job(w)
        job._runtime = threading.Thread(target=job._drive, name="tm-runtime", daemon=True)
    except BaseException:
        loop.crashed(wire)

    # an exception that reaches the top of the script's thread came from its own code (the
    # runtime's own errors end the process where they happen: Job._run, Job._drive)
    sys.excepthook = lambda typ, exc, tb: loop.crashed(wire, exc, w=w, by_script=True, step=job._yielded)
    job._runtime.start()
    job._baton.wait_user()
    _, job._ctx, _ = job._baton.value
    return job
