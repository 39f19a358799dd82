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
    return JobSpec(mode, job_id, job_dir, tuple(nodes), standbys, tuple(command), host)


def run(cfg: cfgmod.Config, spec: JobSpec) -> int:
    if not mpictl.under_mpiexec():
        spec.job_dir.mkdir(parents=True, exist_ok=True)
        os.environ["TM_SLURM_JOB_ID"] = spec.job_id
        os.environ["TM_SLURM_JOB_DIR"] = str(spec.job_dir)
        print(f"tm-slurm: job {spec.job_id} ({spec.mode}, {len(spec.nodes) - spec.standbys} active + "
              f"{spec.standbys} standby), job directory {spec.job_dir}", file=sys.stderr, flush=True)
        mpictl.reexec_under_mpiexec()
    from ..controller.core import Controller
    # one inductor cache for the job: a joiner that compiles finds what the others compiled
    env = {"PYTHONUNBUFFERED": "1",
           "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(spec.job_dir / "inductor"))}
    if spec.mode == "local":
        from .local import LocalLauncher
        launcher = LocalLauncher(spec.job_dir, cfg)
        cfg = cfgmod.from_dict(dict(cfgmod.to_dict(cfg), comm=dict(cfgmod.to_dict(cfg)["comm"],
                                                                   interface=cfg.comm.interface or "127.0.0.1")))
        watcher = None
    else:
        from ..slurm.launcher import SlurmLauncher
        from ..slurm.watcher import Watcher
        launcher = SlurmLauncher(spec.job_dir, cfg, spec.job_id)
        watcher = Watcher(cfg, spec.job_id)
    ctl = Controller(cfg, job_id=spec.job_id, job_dir=spec.job_dir, command=list(spec.command),
                     cwd=os.getcwd(), env=env, nodes=list(spec.nodes), standbys=spec.standbys,
                     launcher=launcher, store_host=spec.store_host, watcher=watcher)
    rc = ctl.run()
    print(f"tm-slurm: job {spec.job_id} ended {ctl.job.state.value} (exit {rc}); events in "
          f"{spec.job_dir / 'events.jsonl'}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(rc)


def quote(cmd) -> str:
    return " ".join(shlex.quote(c) for c in cmd)
