"""From `tm-slurm run` arguments to a running controller: which nodes, which launcher, which job
directory, which address it serves from; all checked before anything starts."""
from __future__ import annotations

import dataclasses
import os
import shlex
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .. import config as cfgmod
from .. import faults
from .. import jobdir
from ..control import auth
from ..control import mpi as mpictl
from ..roles import JobState
from .supervise import record_exit, supervise

if TYPE_CHECKING:
    from ..slurm.address import Served


class LaunchError(RuntimeError):
    pass


@dataclass(frozen=True)
class JobSpec:
    mode: str                 # local | slurm
    job_id: str
    job_dir: Path
    nodes: tuple[str, ...]
    standbys: int
    command: tuple[str, ...]
    store_host: str
    resume: str | None = None        # checkpoint step directory to start from
    served: "Served | None" = None   # under Slurm: how store_host was chosen
    kind: str = "local"              # local, or the allocation's kind: batch | salloc | step


def parse_local(spec: str) -> tuple[int, int]:
    """`--local ACTIVE+STANDBY`: at least one active node, no negative count."""
    a, _, k = spec.partition("+")
    try:
        active, standbys = int(a), int(k or 0)
    except ValueError:
        active = standbys = -1
    if active < 1 or standbys < 0:
        raise LaunchError(f"--local expects ACTIVE+STANDBY with ACTIVE >= 1 and STANDBY >= 0, "
                          f"e.g. 4+1; got {spec!r}")
    return active, standbys


def resolve(cfg: cfgmod.Config, args) -> JobSpec:
    try:
        faults.check()
    except ValueError as e:
        raise LaunchError(str(e)) from None
    command = [c for c in (args.command or [])]
    if not command:
        raise LaunchError("no training command given: tm-slurm run [options] -- python train.py ...")
    standbys = cfg.standby.count
    if args.local:
        active, k = parse_local(args.local)
        if args.standbys is not None and args.standbys != k:
            raise LaunchError(f"--local {args.local} says {k} standbys but --standbys {args.standbys}")
        standbys = k
        cfg.check_nodes(active + k, k)
        nodes = tuple(f"node{i + 1}" for i in range(active + k))
        mode, host = "local", "127.0.0.1"
        job_id = os.environ.get("TM_SLURM_JOB_ID") or args.job_id or \
            f"local-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    else:
        from ..slurm import allocation
        alloc = allocation.from_env()
        if alloc is None:
            raise LaunchError("not inside a Slurm allocation (no SLURM_JOB_ID): run it from an "
                              "sbatch script or an salloc shell, or use --local A+K on one machine")
        cfg.check_nodes(len(alloc.nodes), standbys)
        from ..slurm.address import AddressError, serve_address
        try:
            served = serve_address(alloc.nodes, getattr(args, "controller_address", None) or "",
                                   cfg.comm.interface)
        except AddressError as e:
            raise LaunchError(str(e)) from None
        nodes, mode, host = alloc.nodes, "slurm", served.address
        job_id = os.environ.get("TM_SLURM_JOB_ID") or args.job_id or alloc.job_id
    job_dir = Path(os.environ.get("TM_SLURM_JOB_DIR") or args.job_dir or cfg.job_dir
                   or Path.cwd() / "tm_slurm_jobs" / job_id).resolve()
    resume = args.resume
    if resume is None and mode == "slurm" and alloc.restart_count > 0:
        resume = "auto"          # a requeued job continues from its last checkpoint, if any
    spec = JobSpec(mode, job_id, job_dir, tuple(nodes), standbys, tuple(command), host,
                   resume_checkpoint(cfg, job_dir, resume))
    if mode == "slurm":
        spec = dataclasses.replace(spec, served=served, kind=alloc.kind)
    return spec


def resume_checkpoint(cfg: cfgmod.Config, job_dir: Path, resume: str | None) -> str | None:
    from ..topology import Topology
    from .. import checkpoints as ckpt
    if resume is None:
        return None
    source = job_dir
    if resume not in ("latest", "auto"):
        d = Path(resume)
        if d.name.startswith("step"):
            bad = ckpt.bad_shards(d, Topology(cfg.layout))
            if bad:
                raise LaunchError(f"--resume {d}: shards {bad} are missing or do not match their digest")
            return str(d.resolve())
        # an earlier job's directory or id: a new allocation (another job id) continues from it
        source = d if d.is_dir() else Path.cwd() / "tm_slurm_jobs" / resume
    root = ckpt.root(cfg, source)
    found, rejected = ckpt.latest_valid(root, Topology(cfg.layout))
    for step, why in rejected:
        print(f"tm-slurm: checkpoint of step {step} rejected: {why}", file=sys.stderr)
    if found is None:
        if resume == "auto":
            return None
        raise LaunchError(f"--resume: no valid checkpoint under {root}")
    return str(found[1].resolve())


def run(cfg: cfgmod.Config, spec: JobSpec) -> int:
    if not mpictl.under_mpiexec():
        jobdir.make_private(spec.job_dir)
        os.environ["TM_SLURM_JOB_ID"] = spec.job_id
        os.environ["TM_SLURM_JOB_DIR"] = str(spec.job_dir)
        print(f"tm-slurm: job {spec.job_id} ({spec.mode}, {len(spec.nodes) - spec.standbys} active + "
              f"{spec.standbys} standby), job directory {spec.job_dir}", file=sys.stderr, flush=True)
        if spec.served is not None and not reachable(cfg, spec):
            return 2
        return supervise(spec.job_dir, cfg.timeouts.launcher_grace_s)
    from ..comm.groups import NCCL_ENV
    from ..controller.core import Controller
    # one inductor cache for the job: a joiner that compiles finds what the others compiled; one
    # OpenMP thread a worker unless the user says otherwise, as torchrun: a node's workers would
    # otherwise each start a thread per core
    env = {"PYTHONUNBUFFERED": "1", "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
           "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(spec.job_dir / "inductor")),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **NCCL_ENV}
    secret = auth.new_secret()
    if spec.mode == "local":
        from .local import LocalLauncher
        launcher = LocalLauncher(spec.job_dir, cfg, secret)
        cfg = cfgmod.from_dict(dict(cfgmod.to_dict(cfg), comm=dict(cfgmod.to_dict(cfg)["comm"],
                                                                   interface=cfg.comm.interface or "127.0.0.1")))
        watcher = None
    else:
        from ..slurm.launcher import SlurmLauncher
        from ..slurm.watcher import Watcher
        if spec.kind != "batch":
            # only a batch job can be requeued; an interactive run that ends resumable says so
            # by its exit status and is continued with --resume in a new allocation
            cfg = dataclasses.replace(cfg, slurm=dataclasses.replace(cfg.slurm, requeue_on_exit=False))
        launcher = SlurmLauncher(spec.job_dir, cfg, spec.job_id, secret)
        watcher = Watcher(cfg, spec.job_id)
    ctl = Controller(cfg, job_id=spec.job_id, job_dir=spec.job_dir, command=list(spec.command),
                     cwd=os.getcwd(), env=env, nodes=list(spec.nodes), standbys=spec.standbys,
                     launcher=launcher, store_host=spec.store_host, watcher=watcher,
                     resume_checkpoint=spec.resume, secret=secret)
    rc = ctl.run()
    print(f"tm-slurm: job {spec.job_id} ended {ctl.job.state.value} (exit {rc}); events in "
          f"{spec.job_dir / 'events.jsonl'}", file=sys.stderr, flush=True)
    if ctl.job.state == JobState.FAILED and ctl.ending is not None:
        print(f"tm-slurm: {ctl.ending.why}", file=sys.stderr, flush=True)
    if ctl.job.state == JobState.REQUEUED and not cfg.slurm.requeue_on_exit:
        print(f"tm-slurm: interrupted, resumable: continue with `tm-slurm run --resume {spec.job_dir} "
              f"...` (the same options)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    record_exit(spec.job_dir, rc)
    os._exit(rc)


def reachable(cfg: cfgmod.Config, spec: JobSpec) -> bool:
    """Can the allocation's nodes reach the address the controller will serve from? Asked before
    anything starts, so a wrong address costs seconds and leaves the allocation as it was."""
    from ..events import EventLog
    from ..slurm.address import probe
    s, t = spec.served, cfg.timeouts
    t0 = time.monotonic()
    why = probe(s.address, s.node, t.reach_timeout_s, t.admit_timeout_s, cfg.slurm.srun_args)
    log = EventLog(jobdir.events_file(spec.job_dir), spec.job_id)
    detail = dict(address=s.address, how=s.how, detail=s.detail, allocation=spec.kind,
                  host=socket.gethostname(), probed_from=s.node, probe_s=round(time.monotonic() - t0, 3))
    if why:
        log.emit("controller_unreachable", why=why, **detail)
        print(f"tm-slurm run: the nodes cannot reach this host at {s.address} ({s.how}: {s.detail}): "
              f"{why}; pass --controller-address ADDR, an address of this host they can reach. "
              "Nothing was started.", file=sys.stderr, flush=True)
    else:
        log.emit("controller_address", **detail)
        print(f"tm-slurm: the controller serves from {s.address} ({s.how}: {s.detail})",
              file=sys.stderr, flush=True)
    log.close()
    return why is None


def quote(cmd) -> str:
    return " ".join(shlex.quote(c) for c in cmd)
