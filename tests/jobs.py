"""Running the example job for tests: the real CLI, real processes, real signals; every run
checks that nothing it started is left behind."""
from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from tm_slurm import events as evlog
from tm_slurm import jobdir
from tm_slurm.demo import TINY_MODEL, JobRun

# steps are ~50 ms on this 2-core machine, paced with a short sleep so a standby's warm-up
# (~5 s here) fits well inside a run
PACING = ["--sleep", "0.06"]
TINY = [*TINY_MODEL, *PACING]
# a run with nothing injected into it (a reference, a resumed run) needs no pacing: the sleep
# changes no number, only how long the run takes
UNPACED = TINY_MODEL
# generous liveness on a loaded 2-core CI machine (a false "dead" would be a test failure)
ROBUST = ["timeouts.heartbeat_timeout_s=4", "timeouts.worker_heartbeat_timeout_s=4",
          "checkpoint.every_steps=10"]


@dataclass
class Ran:
    job_dir: Path
    rc: int
    result: dict
    events: list
    injected: list

    def kinds(self, kind):
        return [e for e in self.events if e["kind"] == kind]

    def interruption(self, kind):
        return [e for e in self.result["interruptions"] if e["kind"] == kind]


def leftovers(job_dir: Path, zombies: bool = False) -> list[str]:
    """Processes whose command line or environment names this job directory (running, stopped
    or zombie: their state letter says which), and with `zombies` this test process's unreaped
    children."""
    needle = str(job_dir).encode()
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            state, ppid = (p / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            cmd = (p / "cmdline").read_bytes()
            ours = needle in cmd or needle in (p / "environ").read_bytes()
        except (OSError, ValueError):
            continue
        if ours or (zombies and state == "Z" and int(ppid) == os.getpid()):
            out.append(f"{p.name} [{state}]: {cmd.replace(NUL, b' ')[:200]!r}")
    return out


def no_leftovers(job_dir: Path) -> None:
    """Fail if anything of the job is left, after killing it so the next test starts clean."""
    left = kill_leftovers(job_dir)
    assert not left, f"processes left behind (now killed): {left}"


def kill_leftovers(job_dir: Path) -> list[str]:
    """What of the job is left (see `leftovers`), SIGKILLed."""
    left = leftovers(job_dir, zombies=True)
    for entry in left:
        try:
            os.kill(int(entry.split(" ", 1)[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def run_job(tmp: Path, local: str, steps: int, actions=(), sets=(), script_args=(), layout=(),
            timeout: float = 420, faults: str = "", script: Path | None = None, paced: bool = True) -> Ran:
    """`faults`: TM_SLURM_FAULTS for the job (tm_slurm/faults.py), e.g. "join.ready@node5".
    `script`: another job than the example (with the same pacing, not its model arguments).
    `paced`: steps slowed down by PACING (False: only for a run without actions)."""
    assert paced or not actions, "an unpaced run can end before its actions are injected"
    pacing = PACING if paced else []
    r = JobRun(tmp / "job", local, steps, list(actions), extra_args=list(layout),
               script_args=[*(TINY_MODEL if script is None else []), *pacing, *script_args],
               sets=[*ROBUST, *sets], env={"TM_SLURM_FAULTS": faults} if faults else None,
               script=script)
    try:
        rc = r.run(timeout)
    except TimeoutError as e:          # the leak check runs on a timeout too
        raise TimeoutError(f"{e}; processes left behind (now killed): {kill_leftovers(r.job_dir)}") from None
    no_leftovers(r.job_dir)
    if rc == 0 and len(r.done) < len(r.actions):
        # the job ended before an interruption could be injected (standbys still warming on a
        # loaded machine, or the step passed): say so, rather than fail later on a missing record
        raise AssertionError(f"the job ended before {r.actions[len(r.done):]} were injected "
                             f"(injected: {r.done}); {r.job_dir}")
    res = json.loads(jobdir.result_file(r.job_dir).read_text()) if jobdir.result_file(r.job_dir).exists() else {}
    ran = Ran(r.job_dir, rc, res, list(evlog.read(jobdir.events_file(r.job_dir))), r.done)
    print(story(ran))               # pytest shows it when the test fails (CI keeps no job directory)
    return ran


ROUTINE = {"checkpoint_saved", "checkpoint_complete", "checkpoint_pruned", "agent_admitted", "worker_exit"}


def story(ran: Ran, last: int = 60) -> str:
    """The job's exit and its last events, routine ones left out, one short line each."""
    lines = [f"{ran.job_dir}: exit {ran.rc}, injected {ran.injected}"]
    for e in [e for e in ran.events if e["kind"] not in ROUTINE][-last:]:
        rest = {k: v for k, v in e.items() if k not in ("ts", "kind", "job") and v not in (None, "", [], {})}
        lines.append(f"  {e['kind']} " + " ".join(f"{k}={v}" for k, v in rest.items())[:300])
    return "\n".join(lines)


def same_state(a_dir: Path, b_dir: Path) -> None:
    """Two checkpoints hold the same state, bit for bit: the step and every tensor."""
    from tm_slurm.export import read_checkpoint, same_bits
    a, b = read_checkpoint(a_dir), read_checkpoint(b_dir)
    assert a.step == b.step and a.tensors.keys() == b.tensors.keys() and a.tensors, (a_dir, b_dir)
    differ = [n for n in a.tensors if not same_bits(a.tensors[n], b.tensors[n])]
    assert not differ, f"{a_dir} and {b_dir} differ in {differ[:5]}"


def rss_mb(pid: int) -> float | None:
    """A process's resident memory, None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


NUL = bytes(1)
