"""Interactive allocations on the real mini cluster (issue: salloc, srun, Ctrl-C): the commands of
sbatch/interactive.md, as a user types them, with the tests' smaller model and CI timeouts added.

One run from the submit host (the controller serves from there) takes a drain, a node crash and
`tm-slurm status` from another shell, then Ctrl-C; a second allocation runs the controller on
node1 inside the allocation and resumes from the first run's checkpoint; the result is held to an
undisturbed run's, bit for bit. A third one names an address the nodes cannot reach.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

from ..jobs import ROBUST, TINY, leftovers
from .test_slurm_job import CONTROLLER_TIMEOUT, REPO, Job

DOC = REPO / "sbatch" / "interactive.md"
STEPS = 250


def doc_commands() -> list[str]:
    """The `salloc ...` lines of interactive.md's bash blocks, in order."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    return [line for b in blocks for line in b.splitlines() if line.startswith("salloc ")]


def as_tested(line: str, **subst: str) -> list[str]:
    sets = " ".join(f"--set {s}" for s in [*ROBUST, f"timeouts.controller_timeout_s={CONTROLLER_TIMEOUT}"])
    steps = re.search(r"--steps \d+", line)
    assert "tm-slurm run " in line and steps, line
    line = line.replace("tm-slurm run ", f"tm-slurm run {sets} ")
    line = line.replace(steps.group(0), f"{steps.group(0)} {' '.join(TINY)}")
    for k, v in subst.items():
        line = line.replace(f"<{k}>", v)
    return shlex.split(line)


class Salloc:
    """One `salloc ...` as typed in a terminal: its own session, output to a file."""

    def __init__(self, mc, argv: list[str], out: Path):
        self.mc, self.out = mc, out
        with open(out, "w") as f:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=mc.env(), stdin=subprocess.DEVNULL,
                                         stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        end = time.monotonic() + 60
        while not (m := re.search(r"Granted job allocation (\d+)", out.read_text())):
            assert self.proc.poll() is None and time.monotonic() < end, out.read_text()
            time.sleep(0.2)
        self.job = Job(mc, m.group(1))

    def ctrl_c(self) -> None:
        """What the terminal does: SIGINT to its foreground process group, the one salloc gives
        its command (here `tm-slurm run` itself: `bash -c` execs a single command)."""
        front = next(pid for pid in _pids() if _argv(pid)[1:2] and _argv(pid)[1].endswith(b"tm-slurm")
                     and _argv(pid)[2:3] == [b"run"] and _env(pid).get(b"SLURM_JOB_ID") == self.job.id.encode())
        os.killpg(os.getpgid(front), signal.SIGINT)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"salloc of job {self.job.id} still running after {timeout}s: "
                                 f"{self.out.read_text()[-2000:]}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def none_left(job_dir: Path, timeout: float = 30) -> float:
    """No process of the job remains, on any node or here. The controller's fence of a crashed
    node (`scancel --signal=KILL` of its step, started and not waited for) is a Slurm client that
    can outlive the run until slurmctld gives up on the node: it may take this long."""
    t0 = time.monotonic()
    while left := leftovers(job_dir):
        assert time.monotonic() - t0 < timeout, left
        time.sleep(0.5)
    return time.monotonic() - t0


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _argv(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _env(pid: int) -> dict[bytes, bytes]:
    try:
        items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(i.split(b"=", 1) for i in items if b"=" in i)


def test_salloc_drain_crash_status_ctrl_c_then_resume_on_node1(healthy_cluster, reference, tmp_path):
    mc = healthy_cluster
    ref = reference(STEPS)
    first, resume, unreachable, _ = doc_commands()
    runs: list[Salloc] = []
    try:
        # 1. the controller on the submit host (the head's network namespace: no node name resolves)
        a = Salloc(mc, as_tested(first), tmp_path / "a.out")
        runs.append(a)
        job = a.job
        where = job.wait_event("controller_address", 60)
        assert (where["how"], where["allocation"], where["address"]) == ("route", "salloc", "10.198.0.1"), where
        job.wait_warm()
        st = mc.run(["tm-slurm", "status", "--job", job.id], cwd=tmp_path, capture_output=True, text=True,
                    timeout=60)
        assert st.returncode == 0 and "RUNNING" in st.stdout and "node6" in st.stdout, st.stdout + st.stderr
        mc.scontrol("update", "nodename=node3", "state=drain", "reason=tm-test maint")
        job.wait_event("swap_complete", 120, node="node3")
        assert job.wait_event("node_released", 30, node="node3")["result"].startswith("released")
        t = mc.fail("node4", "crash")
        job.wait_event("failure_detected", 60, node="node4")
        job.wait_event("recovery_complete", 90)
        assert not job.seen("job_end"), "the run ended before Ctrl-C: give it more steps"
        t_int = time.monotonic()
        a.ctrl_c()
        rc = a.wait(60)
        took = time.monotonic() - t_int
        assert rc == 75, a.out.read_text()[-2000:]
        end = job.seen("job_end")
        assert end["state"] == "REQUEUED" and end["exit_code"] == 75
        assert job.seen("signal", signal="SIGINT")["action"] == "checkpoint_exit"
        saved = job.seen("checkpoint_saved", reason="interrupted (SIGINT)")
        assert saved, "no checkpoint at the step boundary after Ctrl-C"
        assert not job.seen("requeue_failed"), "an interactive run is not requeued"
        gone_after = none_left(job.dir)
        print(f"\n[salloc] serves from {where['address']} ({where['detail']}); crash detected "
              f"{job.seen('failure_detected', node='node4')['ts'] - t:.2f}s; Ctrl-C -> exit 75 in {took:.2f}s, "
              f"checkpoint of step {saved['step']}; last process gone {gone_after:.1f}s after the exit")
        mc.heal()

        # 2. a new allocation, the controller on node1 (a step of its own), resumes bit-identical
        b = Salloc(mc, as_tested(resume, jobid=job.id), tmp_path / "b.out")
        runs.append(b)
        where = b.job.wait_event("controller_address", 60)
        assert (where["how"], where["allocation"], where["host"], where["address"]) == \
            ("route", "step", "node1", "10.198.0.11"), where
        assert b.wait(240) == 0, b.out.read_text()[-2000:]
        start = b.job.seen("job_start")
        assert start["start_step"] == saved["step"] and str(job.dir) in start["resume_from"]
        assert b.job.seen("job_end")["state"] == "FINISHED"
        assert b.job.result()["digests"] == ref
        none_left(b.job.dir)

        # 3. an address the nodes cannot reach: said at once, nothing started
        c = Salloc(mc, as_tested(unreachable), tmp_path / "c.out")
        runs.append(c)
        assert c.wait(60) == 2, c.out.read_text()[-2000:]
        why = c.job.seen("controller_unreachable")
        assert why and why["address"] == "127.0.0.1" and why["probe_s"] < 10, why
        assert "--controller-address" in c.out.read_text()
        assert not c.job.seen("job_start") and not (c.job.dir / "logs").exists()
        print(f"[unreachable] said so after {why['probe_s']}s: {why['why']}")
    finally:
        for r in runs:
            r.close()
        mc.cancel_jobs()
        for r in runs:
            shutil.rmtree(r.job.dir, ignore_errors=True)


def test_time_limit_sigterm_checkpoints_within_killwait(healthy_cluster, tmp_path):
    """No --signal: at the time limit Slurm SIGTERMs every step's processes and SIGKILLs them
    KillWait later (5 s here). The agents pass the SIGTERM on, the workers ignore it, and the
    controller (on the submit host, where no signal comes) has the current step checkpointed."""
    *_, limited = doc_commands()
    run = Salloc(healthy_cluster, as_tested(limited), tmp_path / "t.out")
    try:
        assert run.wait(150) == 75, run.out.read_text()[-2000:]
        job = run.job
        told = job.seen("node_signalled")
        assert told and told["signal"] == "SIGTERM"
        assert job.seen("signal", signal="SIGTERM")["action"] == "checkpoint_exit"
        saved = job.seen("checkpoint_saved", reason="time limit (SIGTERM)")
        assert saved, "no checkpoint in the KillWait window"
        assert job.seen("job_end")["state"] == "REQUEUED"
        print(f"\n[time limit] SIGTERM -> checkpoint of step {saved['step']} "
              f"{saved['ts'] - told['ts']:.2f}s later; last process gone {none_left(job.dir):.1f}s after the exit")
    finally:
        run.close()
        healthy_cluster.cancel_jobs()
        shutil.rmtree(run.job.dir, ignore_errors=True)
