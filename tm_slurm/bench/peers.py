"""The systems a user would pick instead, in the same bench (`pip install -e .[peers]`).

torchft: the ddp example written as a torchft job (sbatch/ddp_torchft.py): one process per replica
group (a node here), a Lighthouse started by the bench (in the bench's process), gloo on CPU. The
replica's supervisor (torchelastic or Slurm on a spare node) starts a lost replica again at once,
cold; it heals from a live peer while the survivors train on without it. The job's commit log is
that of a replica never interrupted (it takes part in every step the job commits); the
interruption is over when the restarted replica commits its first step. What torchft does
differently shows in the sample: steps trained with fewer replicas.

nvrx: the ddp example as a torchrun-style job that checkpoints and resumes (sbatch/ddp_nvrx.py),
under NVIDIA's `ft_launcher` (nvidia-resiliency-ext): when a rank fails it restarts every worker in
place, and they resume from the last checkpoint. The job's commit log is rank 0's; the
interruption is over at the first commit after the restart.

Both run the same model, data, seeds, steps and checkpoint cadence as the other strategies. An
interruption hits the node's processes: a kill is a SIGKILL; a drain is a SIGKILL too (neither has a
way to hand a node's work over); a hang is a SIGSTOP, and the process is killed once the collective
timeout has passed, as for the other restart strategies. Each sample says whether the final state
equals that of the same job undisturbed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

from .. import jobdir
from ..config import Timeouts
from ..demo import SBATCH, Example

PEERS = ("torchft", "nvrx")


def unavailable(strategy: str, ex: Example) -> str | None:
    """Why `strategy` cannot run the example here, or None."""
    if ex.name != "ddp":
        return f"{strategy} runs only the ddp example (sbatch/ddp_{strategy}.py); use --example ddp"
    try:
        _torchft() if strategy == "torchft" else _ft_launcher()
    except (ImportError, FileNotFoundError) as e:
        return f"{strategy} is not installed ({e}): pip install -e '.[peers]'"
    return None


def _ft_launcher() -> str:
    import nvidia_resiliency_ext  # noqa: F401
    exe = Path(sys.executable).parent / "ft_launcher"
    if not exe.exists():
        raise FileNotFoundError(f"no {exe}")
    return str(exe)


def _torchft():
    # its Rust side logs every quorum at INFO unless RUST_LOG says otherwise (read at import);
    # the replicas inherit the setting
    os.environ.setdefault("RUST_LOG", "warn")
    import torchft._torchft
    return torchft._torchft


def _commits(f: Path) -> list[dict]:
    """A process's commit log (one JSON object a line); a line being written has no closing brace yet."""
    return [json.loads(x) for x in (f.read_text().splitlines() if f.exists() else ()) if x.endswith("}")]


def _interrupt(send, how: str, hang_s: float) -> float:
    """`send` a kill, or a stop and, once the collective timeout has passed, a kill. Returns the
    interruption's wall time."""
    t = time.time()
    send(signal.SIGSTOP if how == "hang" else signal.SIGKILL)
    if how == "hang":
        time.sleep(hang_s)
        send(signal.SIGKILL)
    return t


class FtJob:
    """A Lighthouse and one process per replica group, in `out`."""

    def __init__(self, out: Path, replicas: int, steps: int, script_args: list[str], collective_timeout: float,
                 checkpoint_every: int):
        # the Lighthouse declares a replica gone after the runtime's heartbeat timeout: the same
        # detection time tm_slurm's agents get
        ms = int(Timeouts().heartbeat_timeout_s * 1000)
        self.out, self.replicas = out, replicas
        out.mkdir(parents=True)
        self.lighthouse = _torchft().LighthouseServer(bind="127.0.0.1:0", min_replicas=1,
                                                      join_timeout_ms=ms, heartbeat_timeout_ms=ms)
        self.argv = [sys.executable, str(SBATCH / "ddp_torchft.py"), "--steps", str(steps), *script_args, "--replicas", str(replicas),
                     "--lighthouse", self.lighthouse.address(), "--timeout", str(collective_timeout),
                     "--checkpoint-every", str(checkpoint_every)]
        self.procs: dict[int, subprocess.Popen] = {}
        self.restarted: dict[int, subprocess.Popen] = {}

    def start(self, timeout: float) -> None:
        """Every replica up and heartbeating before the first step, so all are in the first quorum."""
        go = self.out / "go"
        for r in range(self.replicas):
            self.procs[r] = self._spawn(r, self.out / f"r{r}", ["--start-file", str(go)])
        end = time.monotonic() + timeout
        while not all((self.out / f"r{r}" / f"ready-r{r}").exists() for r in range(self.replicas)):
            self.check(end)
            time.sleep(0.05)
        go.touch()

    def _spawn(self, r: int, d: Path, extra: list[str] = ()) -> subprocess.Popen:
        d.mkdir()
        with open(d / "log", "w") as log:
            return subprocess.Popen([*self.argv, "--replica", str(r), "--out", str(d), *extra], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def check(self, end: float) -> None:
        if time.monotonic() > end:
            raise TimeoutError(f"torchft job {self.out} did not finish in time")
        for r, p in self.procs.items():
            if p.poll() not in (None, 0, -signal.SIGKILL):
                raise RuntimeError(f"torchft replica {r} failed (exit {p.returncode}): "
                                   f"{(self.out / f'r{r}' / 'log').read_text()[-1500:]}")

    def committed(self, r: int, restarted: bool = False) -> list[dict]:
        """Replica `r`'s commits: step, commit wall time, participants."""
        return _commits(self.out / (f"r{r}-restarted" if restarted else f"r{r}") / f"steps-r{r}.jsonl")

    def log_of(self, victim: int) -> list[dict]:
        """The job's commits: those of the first replica that is not `victim`."""
        return self.committed(min(set(range(self.replicas)) - {victim}))

    def summary(self, victim: int) -> dict:
        back = self.committed(victim, restarted=True)
        fewer = [d for d in self.log_of(victim) if d["participants"] < self.replicas]
        return {"t_done": back[0]["wall"] if back else None, "replica_rejoined": bool(back),
                "steps_fewer_replicas": len(fewer),
                # a step with p of n replicas trains on p/n of the global batch
                "samples_lost_steps": round(sum(1 - d["participants"] / self.replicas for d in fewer), 2)}

    def interrupt(self, r: int, how: str, hang_s: float) -> float:
        """Interrupt replica `r` (kill, or hang until the collective timeout has passed, then
        kill), and let its supervisor start it again. Returns the interruption's wall time."""
        p = self.procs[r]
        t = _interrupt(lambda sig: os.killpg(p.pid, sig), how, hang_s)
        p.wait()
        self.restarted[r] = self._spawn(r, self.out / f"r{r}-restarted")
        return t

    def wait(self, timeout: float) -> None:
        """Until the replicas that were not interrupted have done every step. A restarted replica
        that has not rejoined by then is stopped: alone, it would start the job over."""
        end = time.monotonic() + timeout
        survivors = [p for r, p in self.procs.items() if r not in self.restarted]
        while any(p.poll() is None for p in survivors):
            self.check(end)
            time.sleep(0.05)
        bad = [p.returncode for p in survivors if p.returncode != 0]
        if bad:
            raise RuntimeError(f"torchft job {self.out}: replicas exited {bad}")
        for r, p in self.restarted.items():
            try:
                p.wait(timeout=10 if self.committed(r, restarted=True) else 0)
            except subprocess.TimeoutExpired:
                pass                        # close() kills it

    def close(self) -> None:
        for p in [*self.procs.values(), *self.restarted.values()]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.lighthouse.shutdown()

    def finals(self) -> list[dict]:
        return [json.loads(f.read_text()) for f in sorted(self.out.glob("r*/final-r*.json"))]


class NvrxJob:
    """`ft_launcher` with one worker per node (all on this machine), in `out`."""

    def __init__(self, out: Path, ranks: int, steps: int, script_args: list[str], collective_timeout: float,
                 checkpoint_every: int):
        self.out = out
        out.mkdir(parents=True)
        self.argv = [_ft_launcher(), "--standalone", "--nproc-per-node", str(ranks), "--max-restarts", "3",
                     str(SBATCH / "ddp_nvrx.py"), "--steps", str(steps), *script_args, "--out", str(out),
                     "--timeout", str(collective_timeout), "--checkpoint-every", str(checkpoint_every)]

    def start(self, timeout: float) -> None:
        with open(self.out / "launcher.log", "w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def check(self, end: float) -> None:
        if time.monotonic() > end:
            raise TimeoutError(f"ft_launcher job {self.out} did not finish in time")
        if self.proc.poll() not in (None, 0):
            raise RuntimeError(f"ft_launcher failed (exit {self.proc.returncode}): "
                               f"{(self.out / 'launcher.log').read_text()[-1500:]}")

    def committed(self, r: int) -> list[dict]:
        return _commits(self.out / f"steps-r{r}.jsonl")

    def log_of(self, victim: int) -> list[dict]:
        """The job's commits: rank 0's (every rank restarts, and redoes the same steps)."""
        return self.committed(0)

    def summary(self, victim: int) -> dict:
        back = [d for d in self.committed(0) if d["attempt"] > 0]
        return {"t_done": back[0]["wall"] if back else None, "restarts": max((d["attempt"] for d in back), default=0)}

    def interrupt(self, r: int, how: str, hang_s: float) -> float:
        """Interrupt rank `r`'s process (kill, or hang until the collective timeout has passed,
        then kill); the launcher restarts every worker. Returns the interruption's wall time."""
        pid = int((self.out / f"pid-r{r}").read_text())
        return _interrupt(lambda sig: os.kill(pid, sig), how, hang_s)

    def wait(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while self.proc.poll() is None:
            self.check(end)
            time.sleep(0.05)
        self.check(end)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def finals(self) -> list[dict]:
        return [json.loads(f.read_text()) for f in sorted(self.out.glob("final-r*.json"))]


JOBS = {"torchft": FtJob, "nvrx": NvrxJob}


def run(job: Path, scenario: str, strategy: str, steps: int, at_step: int, hang_timeout: float,
        script_args: list[str], timeout: float, ex: Example, checkpoint_every: int) -> tuple[float, dict]:
    """One sample of a peer; writes the job's commit log where the bench reads it."""
    victim = (ex.drain if scenario == "planned" else ex.kill)
    r = int(victim.removeprefix("node")) - 1           # node1 holds rank (replica) 0, node2 1
    reference = _undisturbed(strategy, job.parent, steps, tuple(script_args), hang_timeout, timeout, ex,
                             checkpoint_every)
    j = JOBS[strategy](job, ex.active, steps, script_args, hang_timeout, checkpoint_every)
    try:
        j.start(timeout)
        end = time.monotonic() + timeout
        while not (log := j.log_of(r)) or log[-1]["step"] < at_step:
            j.check(end)
            time.sleep(0.01)
        t_event = j.interrupt(r, "hang" if scenario == "hang" else "kill", hang_timeout)
        j.wait(timeout)
    finally:
        j.close()
    jobdir.steps_file(job).write_text("".join(json.dumps({k: d[k] for k in ("step", "wall", "dur_s")}) + "\n"
                                              for d in j.log_of(r)))
    digests = {d["digest"] for d in j.finals()}
    return t_event, {**j.summary(r), "bit_identical": digests == {reference}, "digests": sorted(digests)}


@cache
def _undisturbed(strategy: str, root: Path, steps: int, script_args: tuple[str, ...], collective_timeout: float,
                 timeout: float, ex: Example, checkpoint_every: int) -> str:
    """The final digest of the same job undisturbed: once per bench directory."""
    out = root / f"{strategy}-undisturbed-{time.strftime('%H%M%S')}"
    j = JOBS[strategy](out, ex.active, steps, list(script_args), collective_timeout, checkpoint_every)
    try:
        j.start(timeout)
        j.wait(timeout)
    finally:
        j.close()
    digests = {d["digest"] for d in j.finals()}
    if len(digests) != 1:
        raise RuntimeError(f"{strategy}'s undisturbed ranks ended with different states; see {out}")
    return digests.pop()
