"""From `tm-slurm run` arguments to a running controller: which nodes, which launcher, which job
directory; all checked before anything starts."""
from __future__ import annotations

import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import config as cfgmod
from .. import jobdir
from ..control import auth
from ..control import mpi as mpictl


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


def resolve(cfg: cfgmod.Config, args) -> JobSpec:
    command = [c for c in (args.command or [])]
    if not command:
        raise LaunchError("no training command given: tm-slurm run [options] -- python train.py ...")
    standbys = cfg.standby.count
    if args.local:
        try:
            a, _, k = args.local.partition("+")
            active, k = int(a), int(k or 0)
        except ValueError:
            raise LaunchError(f"--local expects ACTIVE+STANDBY, e.g. 4+1; got {args.local!r}") from None
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
        nodes, mode, host = alloc.nodes, "slurm", alloc.batch_host
        job_id = os.environ.get("TM_SLURM_JOB_ID") or args.job_id or alloc.job_id
    job_dir = Path(os.environ.get("TM_SLURM_JOB_DIR") or args.job_dir or cfg.job_dir
                   or Path.cwd() / "tm_slurm_jobs" / job_id).resolve()
    resume = args.resume
    if resume is None and mode == "slurm" and alloc.restart_count > 0:
        resume = "auto"          # a requeued job continues from its last checkpoint, if any
    return JobSpec(mode, job_id, job_dir, tuple(nodes), standbys, tuple(command), host,
                   resume_checkpoint(cfg, job_dir, resume))


def resume_checkpoint(cfg: cfgmod.Config, job_dir: Path, resume: str | None) -> str | None:
    from ..topology import Topology
    from ..worker import checkpoint as ckpt
    if resume is None:
        return None
    if resume not in ("latest", "auto"):
        d = Path(resume)
        bad = ckpt.bad_shards(d, Topology(cfg.layout))
        if bad:
            raise LaunchError(f"--resume {d}: shards {bad} are missing or do not match their digest")
        return str(d.resolve())
    root = ckpt.root(cfg, job_dir)
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
        mpictl.reexec_under_mpiexec()
    from ..controller.core import Controller
    # one inductor cache for the job: a joiner that compiles finds what the others compiled
    env = {"PYTHONUNBUFFERED": "1", "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
           "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(spec.job_dir / "inductor"))}
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
        launcher = SlurmLauncher(spec.job_dir, cfg, spec.job_id, secret)
        watcher = Watcher(cfg, spec.job_id)
    ctl = Controller(cfg, job_id=spec.job_id, job_dir=spec.job_dir, command=list(spec.command),
                     cwd=os.getcwd(), env=env, nodes=list(spec.nodes), standbys=spec.standbys,
                     launcher=launcher, store_host=spec.store_host, watcher=watcher,
                     resume_checkpoint=spec.resume, secret=secret)
    rc = ctl.run()
    print(f"tm-slurm: job {spec.job_id} ended {ctl.job.state.value} (exit {rc}); events in "
          f"{spec.job_dir / 'events.jsonl'}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(rc)


def quote(cmd) -> str:
    return " ".join(shlex.quote(c) for c in cmd)
