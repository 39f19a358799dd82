"""Agents under Slurm: each one its own step, `srun -N1 -n1 -w NODE`, so a node failure kills
only that node's step (docs/design.md §6). Inside the step the agent is started by the job's own
`mpiexec -n 1` (a process that Connects must be an MPI world of its own; see control/mpi, control/pmi).

Slurm facts this relies on (22.05, measured on the mini cluster): the srun of a step on a failed
node returns only when the node is DOWN (~16 s) and exits 0, so its exit says nothing about
health (the controller's heartbeats do); `scontrol update JobId=J NodeList=...` shrinks a
running job at once, SIGKILLing whatever step is left on the removed node.
"""
from __future__ import annotations

import shlex
import subprocess
import time
from pathlib import Path

from .. import jobdir
from ..control import auth
from ..control import mpi as mpictl
from ..launch.local import agent_argv, wait_until
from . import backend_for, hostlist
from .backend import SlurmError

# the text of ESLURM_JOB_SETTING_DB_INX, what a resized job's every later update gets (21.08-24.05)
DB_INDEX_HOLD = "the DB index is being set"


class SlurmLauncher:
    kind = "slurm"

    def __init__(self, job_dir: Path, cfg, job_id: str, secret: bytes, backend=None):
        self.job_dir, self.cfg, self.job_id = Path(job_dir), cfg, job_id
        self.agent_env = auth.agent_env(secret)   # srun's environment: never argv
        self.backend = backend or backend_for(cfg.slurm.backend)
        self.procs: dict[str, subprocess.Popen] = {}
        self.steps: dict[str, str] = {}
        self.ended: set[str] = set()
        self.released: set[str] = set()
        self.shrink_refused = ""                     # why Slurm will not shrink the job again
        self.resizes_once: bool | None = None        # Slurm's answer, asked after the first shrink
        self.batch_host: str | None = None
        self.companions: list[str] = []              # companion standby jobs submitted
        self.companion_nodes: dict[str, str] = {}   # node -> its companion job

    def srun_argv(self, node: str) -> list[str]:
        return ["srun", "-N1", "-n1", "-w", node, "--overlap", "--no-kill", "--kill-on-bad-exit=0",
                f"--job-name=tm-agent-{node}", *self.cfg.slurm.srun_args,
                *mpictl.mpiexec_argv(agent_argv(self.job_dir, node, self.cfg))]

    def start(self, node: str) -> None:
        log = open(jobdir.log_dir(self.job_dir) / f"{node}.agent.log", "ab")
        self.procs[node] = subprocess.Popen(self.srun_argv(node), env=mpictl.mpi_env(extra=self.agent_env),
                                            start_new_session=True, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def admitted(self, node: str, hello) -> None:
        if hello.step:
            self.steps[node] = hello.step
        if hello.job and hello.job != self.job_id:
            self.companion_nodes[node] = hello.job

    def poll(self) -> list[tuple[str, int]]:
        out = []
        for n, p in self.procs.items():
            if n not in self.ended and p.poll() is not None:
                self.ended.add(n)
                out.append((n, p.returncode))
        return out

    def kill(self, node: str) -> None:
        """Fence: SIGKILL the node's step through slurmctld (its srun goes too). A node that
        cannot be reached keeps its processes until Slurm declares it DOWN; the job's per-op
        collective timeouts are the backstop for that case."""
        step = self.steps.get(node)
        if step is not None:
            subprocess.Popen(["scancel", "--signal=KILL", f"{self.job_id}.{step}"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        p = self.procs.get(node)
        if p is not None and p.poll() is None:
            p.kill()

    def replenish(self, ctl) -> None:
        """Ask Slurm for one more standby: a one-node companion job whose batch script is an agent
        (the node's name is known when it says hello). Cancelled when this job ends."""
        argv = mpictl.mpiexec_argv(agent_argv(self.job_dir, "NODE", self.cfg))
        wrap = " ".join(shlex.quote(a) for a in argv).replace("NODE", '"$SLURMD_NODENAME"')
        # a node of its own: not one this job holds or held (Slurm would happily share one)
        known = hostlist.compress(sorted(ctl.nodes.nodes), sort=True)
        p = subprocess.run(["sbatch", "--parsable", "-N1", "-n1", "--exclusive", f"--exclude={known}",
                            f"--job-name=tm-standby-{self.job_id}",
                            f"--output={jobdir.log_dir(self.job_dir)}/standby-%j.out",
                            *self.cfg.standby.replenish_sbatch_args, f"--wrap=exec {wrap}"],
                           env=mpictl.mpi_env(extra=self.agent_env), capture_output=True, text=True,
                           timeout=30)
        if p.returncode != 0:
            raise RuntimeError(f"sbatch of a companion standby failed: {p.stderr.strip()}")
        self.companions.append(p.stdout.strip().split(";")[0])

    def release(self, node: str) -> str:
        """Give an evacuated or failed node back to Slurm: a drain completes (DRAINED), a job's
        end does not wait for a dead node (controller/releases.py)."""
        if node in self.companion_nodes:
            subprocess.run(["scancel", self.companion_nodes[node]], capture_output=True, timeout=30)
            return f"released: companion job {self.companion_nodes[node]} cancelled"
        if node == self.batch_host:
            return "kept: the batch host (the controller runs there) cannot leave the job"
        if self.shrink_refused:
            return f"not released: {self.shrink_refused}"
        info = self.backend.job(self.job_id)
        keep = [n for n in (info.nodes if info else ()) if n != node and n not in self.released]
        try:
            self.backend.release_nodes(self.job_id, keep)
        except SlurmError as e:
            if DB_INDEX_HOLD in str(e):
                self._refuse_shrinks()
            raise
        self.released.add(node)
        if self.resizes_once is None:
            self.resizes_once = self._ask_resizes_once()
        if self.resizes_once:
            self._refuse_shrinks()
        return f"released: job now on {len(keep)} nodes"

    def _ask_resizes_once(self) -> bool | None:
        """Slurm 21.08-24.05 without slurmdbd (backend.resizes_once): every later update of a
        resized job holds a slurmctld thread 5 s and fails, so it is not asked at all."""
        try:
            return self.backend.resizes_once()
        except SlurmError:
            return None                 # asked again next time; the first refusal tells too

    def _refuse_shrinks(self) -> None:
        self.shrink_refused = (f"Slurm will not shrink job {self.job_id} again (\"{DB_INDEX_HOLD}\": "
                               "Slurm 21.08-24.05 without slurmdbd resizes a job once); the node stays "
                               "in the job until Slurm declares it DOWN or the job ends")

    def requeue(self) -> None:
        self.backend.requeue(self.job_id)

    def stop_all(self, grace: float = 5.0) -> None:
        # each release left Slurm's slurm_job_<id>_resize.{sh,csh} (new SLURM_* values for
        # scripts that source them) in the job's working directory; nothing here needs them
        for f in Path.cwd().glob(f"slurm_job_{self.job_id}_resize.*"):
            f.unlink(missing_ok=True)
        if self.companions:
            subprocess.run(["scancel", *self.companions], capture_output=True, timeout=30)
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()               # srun forwards SIGTERM to its step
        # one grace for all steps, not one each: the end of a large job must not wait for
        # steps that do not go node by node
        end = time.monotonic() + grace
        for p in self.procs.values():
            wait_until(p, end)
        left = [n for n, p in self.procs.items() if p.poll() is None]
        for n in left:
            self.kill(n)
        end = time.monotonic() + 5
        for n in left:
            wait_until(self.procs[n], end)
