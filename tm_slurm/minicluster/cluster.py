"""`MiniCluster`: the Python handle on the minicluster that the shell scripts next to
this file build, fail, restore and tear down. See README.md in this directory."""
from __future__ import annotations

import os
import pwd
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

HERE = Path(__file__).parent
DEFAULT_DIR = "/var/tmp/tm-slurm-minicluster"
ENV_PREFIX = "TM_SLURM_MINICLUSTER_"
MODES = ("crash", "kill", "netcut", "slurmd", "hang")
DEFAULT_NODES = 5
DEFAULT_PREFIX = "tmslurm"


class MiniClusterError(RuntimeError):
    """A minicluster script failed; the message says why."""


class MiniCluster:
    """A real Slurm cluster on this machine: slurmctld in a head network namespace,
    node1..nodeN each a slurmd in its own namespaces. Everything needs root.

    `settings` overrides the TM_SLURM_MINICLUSTER_* environment for up():
    e.g. {"slurmd_timeout": 5, "message_timeout": 2, "extra_conf": "..."}.
    `echo=True` lets the scripts' progress messages through to stderr (the CLI);
    otherwise they are captured and only shown in a MiniClusterError.
    """

    def __init__(self, run_dir: str | os.PathLike | None = None, *,
                 settings: Mapping[str, object] | None = None, echo: bool = False):
        self.run_dir = Path(run_dir or os.environ.get(ENV_PREFIX + "DIR") or DEFAULT_DIR)
        self.state_dir = self.run_dir / "cluster"  # removed by down()
        self.bin_dir = self.run_dir / "bin"
        self.conf_path = self.state_dir / "etc" / "slurm" / "slurm.conf"
        self.settings = {ENV_PREFIX + k.upper(): str(v) for k, v in (settings or {}).items()}
        self.echo = echo

    # ------------------------------------------------------------ lifecycle

    def up(self, nodes: int | None = None, fresh: bool = False) -> float:
        """Start the cluster (default TM_SLURM_MINICLUSTER_NODES, else 5 nodes) and wait
        until every node is IDLE. A healthy cluster with the same settings is left as it
        is. Returns the seconds it took; raises MiniClusterError if it cannot start."""
        extra = {}
        if nodes is not None:
            extra[ENV_PREFIX + "NODES"] = str(nodes)
        if fresh:
            extra[ENV_PREFIX + "FRESH"] = "1"
        t = time.monotonic()
        self._script("up.sh", env=extra)
        return time.monotonic() - t

    def down(self, purge: bool = False) -> float:
        """Stop everything up() started and remove its namespaces and state (logs are
        kept in run_dir/last-logs unless purge). Returns the seconds it took."""
        t = time.monotonic()
        self._script("down.sh", *(["--purge"] if purge else []))
        return time.monotonic() - t

    def is_up(self) -> bool:
        """Is the head machine (slurmctld's PID 1) running?"""
        return _is_nodeinit(_read_pid(self.state_dir / "pids" / "init.head.pid"))

    # ------------------------------------------------------------ failures

    def fail(self, node: str, mode: str = "crash") -> float:
        """Make NODE fail for real (see fail.sh for the modes); returns the epoch time
        of the failure."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        return float(self._script("fail.sh", node, mode).stdout.split()[-1])

    def restore(self, node: str, wait: bool = True) -> None:
        """Undo fail(); with wait, return once slurmctld has NODE back in service."""
        self._script("restore.sh", node, *(["--wait"] if wait else []))

    def heal(self, timeout: float = 60) -> None:
        """Make the cluster usable for the next test: failed or DOWN nodes restored, all
        jobs cancelled, drains resumed, every node IDLE. Restarts a dead controller."""
        states = self.status()
        if len(states) != len(self.nodes):
            self.up(nodes=len(self.nodes), fresh=True)
            return
        failed = [node for node, state in states.items()
                  if (self.state_dir / "pids" / f"failed.{node}").exists() or _unreachable(state)]
        if failed and self._jobs():
            # a job that ended while a failed node was still in it stays COMPLETING until slurmctld
            # hears from that node; one that comes back before slurmctld has declared it DOWN is
            # sent the job's terminate again only a minute or more later (73 s seen). DOWN takes the
            # node out of every job at once (ReturnToService=2 lets it back on registering)
            for node in failed:
                self.scontrol("update", f"nodename={node}", "state=down", "reason=tm-slurm minicluster heal")
        for node in failed:
            self.restore(node, wait=True)
        self.cancel_jobs(timeout)
        for node, state in self.status().items():
            if "DRAIN" in state or "DOWN" in state:
                self.scontrol("update", f"nodename={node}", "state=resume")
        for node in self.nodes:
            self.wait_state(node, lambda s: s == "IDLE", timeout)

    def cancel_jobs(self, timeout: float = 30) -> None:
        """Cancel every job (the cluster belongs to its tests) and wait until none is left."""
        ids = self._jobs()
        if ids:
            self.run(["scancel", *ids], capture_output=True)
        end = time.monotonic() + timeout
        while (ids := self._jobs()) and time.monotonic() < end:
            time.sleep(0.2)
        if ids:
            raise MiniClusterError(f"jobs still in the queue {timeout:.0f} s after scancel: {ids}")

    # ------------------------------------------------------------ state

    @property
    def prefix(self) -> str:
        return self._saved().get("PREFIX") or self._setting("PREFIX", DEFAULT_PREFIX)

    @property
    def nodes(self) -> list[str]:
        n = int(self._saved().get("NODES") or self._setting("NODES", DEFAULT_NODES))
        return [f"node{i}" for i in range(1, n + 1)]

    def status(self) -> dict[str, str]:
        """Node name -> slurmctld's state (`scontrol show node -o` State=), e.g. IDLE,
        MIXED+DRAIN, DOWN+NOT_RESPONDING. Empty if the controller cannot be reached."""
        if not self.is_up():
            return {}
        out = self.scontrol("show", "node", "-o", check=False).stdout
        return dict(_parse_node_line(line) for line in out.splitlines() if line.startswith("NodeName="))

    def node_state(self, node: str) -> str:
        """slurmctld's state of NODE; "" if unknown or the controller is unreachable."""
        if not self.is_up():
            return ""
        line = self.scontrol("show", "node", node, "-o", check=False).stdout
        return _parse_node_line(line)[1] if line.startswith("NodeName=") else ""

    def wait_state(self, node: str, want: str | Callable[[str], bool], timeout: float = 60,
                   interval: float = 0.1) -> float:
        """Wait until NODE's state contains the substring `want` (or `want(state)` is
        true); returns the seconds waited, raises TimeoutError after `timeout`."""
        ok = want if callable(want) else (lambda s: want in s)
        t0 = time.monotonic()
        while not ok(state := self.node_state(node)):
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{node} is {state or 'unknown'} after {timeout:.0f} s, wanted {want}")
            time.sleep(interval)
        return time.monotonic() - t0

    def pids(self) -> dict[int, str]:
        """Every live process of the cluster (pid -> command line): munged, each
        machine's init and `unshare` parent, and all processes in its namespaces."""
        found = [_read_pid(f) for f in (self.state_dir / "pids").glob("*.pid")]
        for ns in self.namespaces():
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
            found += [int(p) for p in out.split()]
        return {p: c for p in found if p and (c := _cmdline(p))}

    def namespaces(self) -> list[str]:
        """Network namespaces of this cluster ($PREFIX-head, $PREFIX-nodeK)."""
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        pat = re.compile(rf"{re.escape(self.prefix)}-(head|node\d+)")
        return [w[0] for line in out.splitlines() if (w := line.split()) and pat.fullmatch(w[0])]

    # ------------------------------------------------------------ running commands

    def env(self) -> dict[str, str]:
        """A complete environment for subprocesses that use the cluster from the host:
        the current one plus PATH with the wrapper dir first (sbatch, srun, scontrol, ...
        reach the cluster through it) and SLURM_CONF. Jobs inherit this environment, so
        the running venv's bin dir comes next on PATH (python and tm-slurm on the nodes
        are this venv's: the filesystem is shared) and HOME is set."""
        env = dict(os.environ)
        path = [str(self.bin_dir)]
        if sys.prefix != sys.base_prefix:  # running in a venv
            path.append(str(Path(sys.prefix) / "bin"))
        rest = [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and p not in path]
        env["PATH"] = os.pathsep.join(path + rest)
        env["SLURM_CONF"] = str(self.conf_path)
        env.setdefault("HOME", pwd.getpwuid(os.getuid()).pw_dir)
        return env

    def run(self, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """subprocess.run(argv) inside the head netns, with env(): any Slurm client, or
        anything that talks to slurmctld itself."""
        return self._helper("tm-slurm-minicluster-exec", list(argv), kw)

    def run_on(self, node: str, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """subprocess.run(argv) "on" NODE: in its network, UTS, IPC, mount, PID and time
        namespaces."""
        return self._helper("tm-slurm-minicluster-node", [node, *argv], kw)

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run(["scontrol", *args], capture_output=True, text=True, check=check)

    # ------------------------------------------------------------ internals

    def _helper(self, name: str, argv: list[str], kw: dict) -> subprocess.CompletedProcess:
        helper = self.bin_dir / name
        if not helper.exists():
            raise MiniClusterError(f"the minicluster in {self.run_dir} is not up (no {helper})")
        kw.setdefault("env", self.env())
        return subprocess.run([str(helper), *argv], **kw)

    def _script(self, name: str, *args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        full_env = {**os.environ, **self.settings, **(env or {}), ENV_PREFIX + "DIR": str(self.run_dir)}
        p = subprocess.run(["bash", str(HERE / name), *args], env=full_env, text=True,
                           stdout=subprocess.PIPE, stderr=None if self.echo else subprocess.PIPE)
        if p.returncode != 0:
            detail = "see the messages above" if self.echo else (p.stderr or "").strip()[-3000:]
            raise MiniClusterError(f"minicluster {' '.join([name, *args])} failed (exit {p.returncode}): {detail}")
        return p

    def _saved(self) -> dict[str, str]:
        """The settings up.sh saved for the running cluster (TM_SLURM_MINICLUSTER_ dropped)."""
        try:
            lines = (self.state_dir / "settings.env").read_text().splitlines()
        except FileNotFoundError:
            return {}
        return {k.removeprefix(ENV_PREFIX): v for k, _, v in (line.partition("=") for line in lines)}

    def _setting(self, key: str, default: object) -> str:
        return self.settings.get(ENV_PREFIX + key) or os.environ.get(ENV_PREFIX + key) or str(default)

    def _jobs(self) -> list[str]:
        return self.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()


def _parse_node_line(line: str) -> tuple[str, str]:
    name = re.match(r"NodeName=(\S+)", line)
    state = re.search(r"(?:^|\s)State=(\S+)", line)
    return (name.group(1) if name else "", state.group(1) if state else "")


def _unreachable(state: str) -> bool:
    return "DOWN" in state or "NOT_RESPONDING" in state


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _is_nodeinit(pid: int | None) -> bool:
    return bool(pid) and "nodeinit.py" in _cmdline(pid)
