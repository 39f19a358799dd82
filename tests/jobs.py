"""Running the example job for tests: the real CLI, real processes, real signals; every run
checks that nothing it started is left behind."""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from tm_slurm import events as evlog
from tm_slurm import jobdir
from tm_slurm.demo import JobRun

# a small model: startup (imports) dominates, steps are ~50 ms on this 2-core machine
# (paced with a short sleep so a standby's warm-up, ~5 s here, fits well inside a run)
TINY = ["--vocab", "64", "--dim", "32", "--layers", "4", "--heads", "2", "--seq", "16", "--batch", "4",
        "--sleep", "0.06"]
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


def leftovers(job_dir: Path) -> list[str]:
    """Processes whose command line or environment names this job directory."""
    needle = str(job_dir).encode()
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmd = (p / "cmdline").read_bytes()
            if needle in cmd or needle in (p / "environ").read_bytes():
                out.append(f"{p.name}: {cmd.replace(NUL, b' ')[:200]!r}")
        except OSError:
            continue
    return out


def run_job(tmp: Path, local: str, steps: int, actions=(), sets=(), script_args=(), layout=(),
            timeout: float = 420) -> Ran:
    threads = _threads()
    r = JobRun(tmp / "job", local, steps, list(actions), extra_args=list(layout),
               script_args=[*TINY, *script_args], sets=[*ROBUST, *sets])
    rc = r.run(timeout)
    left = leftovers(r.job_dir)
    assert not left, f"processes left behind: {left}"
    assert _threads() == threads
    res = json.loads(jobdir.result_file(r.job_dir).read_text()) if jobdir.result_file(r.job_dir).exists() else {}
    return Ran(r.job_dir, rc, res, list(evlog.read(jobdir.events_file(r.job_dir))), r.done)


NUL = bytes(1)
SIDE = "test-side"       # a test's own helper thread (an attacker, a watcher), not the job's


def _threads() -> int:
    return sum(1 for t in threading.enumerate() if not t.name.startswith(SIDE))
