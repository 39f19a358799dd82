#!/usr/bin/env python3
"""PID 1 of one simulated minicluster machine: a compute node or the head.

start_machine (common.sh) runs it, from a clean environment, as

    nsenter --net=/run/netns/<ns> unshare --uts --ipc --mount --pid --fork \
        --mount-proc --propagation private python3 nodeinit.py {node|head} NAME RUNDIR

so it starts in the machine's own network, UTS, IPC, mount and PID namespaces. It

* sets the hostname and bind-mounts RUNDIR/etc/slurm on /etc/slurm and
  RUNDIR/etc/hosts on /etc/hosts (a private mount namespace: the host is untouched);
* gives the machine its own /dev/shm and boot_id;
* "boots": its future children live in a fresh time namespace whose CLOCK_BOOTTIME
  starts at 0.2 s, so slurmd reports a new boot time after every simulated
  reboot, which is what `scontrol reboot` waits for;
* runs the daemon (slurmd -D, or slurmctld -D on the head) and reaps every orphan
  (slurmstepd, job processes), like a real init.

Signals, sent from the host to the pid in RUNDIR/pids/init.NAME.pid:

    SIGKILL  the kernel kills every process of the machine at once (power loss)
    SIGTERM  clean halt: the daemon first, then everything else
    SIGUSR1  reboot: kill everything, wait REBOOT_DELAY s, new boot, start the daemon
             (Slurm's RebootProgram is `kill -USR1 1` inside the node)
    SIGUSR2  restart the daemon only (like `systemctl restart slurmd`)
    SIGHUP   start the daemon if it is not running

Standard library only: it runs under the system python, whatever venv the caller uses.
"""
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

CLONE_NEWTIME = 0x00000080
REBOOT_DELAY = float(os.environ.get("TM_SLURM_MINICLUSTER_REBOOT_DELAY", "2"))
BOOT_UPTIME = 0.2


class Machine:
    def __init__(self, role: str, name: str, run: str):
        self.role, self.name, self.run = role, name, run
        self.boot_id = os.path.join(run, "run", f"boot_id.{name}")
        self.logf = open(os.path.join(run, "log", f"init.{name}.log"), "a", buffering=1)
        self.daemon = None  # pid of slurmd / slurmctld
        self.pending = set()  # signals received, handled in the main loop

    def log(self, msg: str) -> None:
        self.logf.write(f"{time.strftime('%H:%M:%S')} {self.name}: {msg}\n")

    def setup(self) -> None:
        socket.sethostname(self.name)
        if os.path.isdir("/etc/slurm"):
            _sh("mount", "--bind", os.path.join(self.run, "etc", "slurm"), "/etc/slurm")
        _sh("mount", "--bind", os.path.join(self.run, "etc", "hosts"), "/etc/hosts")
        # UCX/MPICH decide "same machine, use shared memory" by boot_id; with the
        # host's boot_id shared by all nodes, ranks on different nodes try SysV shm
        # and fail. Hence a per-node boot_id, IPC namespace and /dev/shm.
        _sh("mount", "-t", "tmpfs", "-o", "mode=1777,size=2g", f"shm-{self.name}", "/dev/shm")
        with open(self.boot_id, "w") as f:
            f.write(f"{uuid.uuid4()}\n")
        _sh("mount", "--bind", self.boot_id, "/proc/sys/kernel/random/boot_id")
        _sh("ip", "link", "set", "lo", "up")

    def new_boot(self) -> None:
        """From now on children see a freshly booted machine: uptime 0.2 s, a new
        boot_id and an empty /dev/shm."""
        with open(self.boot_id, "r+") as f:  # in place: the bind mount holds the inode
            f.write(f"{uuid.uuid4()}\n")
        for entry in os.listdir("/dev/shm"):
            subprocess.run(["rm", "-rf", os.path.join("/dev/shm", entry)])
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWTIME) != 0:
            self.log(f"unshare(CLONE_NEWTIME) failed, errno={ctypes.get_errno()}: boot time unchanged")
            return
        # Children's uptime starts at BOOT_UPTIME s. slurmctld accepts a reboot once the
        # boot time it derives, its whole-second clock minus the uptime slurmd reports
        # (sysinfo rounds that up), is not before the second it issued the reboot in. An
        # uptime that starts near 2 s (REBOOT_DELAY) left a zero margin: one registration
        # in a few came out a second early and the node stayed REBOOT_ISSUED.
        offset = BOOT_UPTIME - time.clock_gettime(time.CLOCK_BOOTTIME)
        sec = int(offset // 1)
        try:
            with open("/proc/self/timens_offsets", "w") as f:
                f.write(f"boottime {sec} {int((offset - sec) * 1e9)}\n")
        except OSError as e:
            self.log(f"cannot set time namespace offsets: {e}")

    def start_daemon(self) -> None:
        conf = ("/etc/slurm/slurm.conf" if os.path.isdir("/etc/slurm")
                else os.path.join(self.run, "etc", "slurm", "slurm.conf"))
        if self.role == "head":
            cmd = ["slurmctld", "-D", "-i", "-f", conf]
        else:
            cmd = ["slurmd", "-D", "-N", self.name, "-f", conf]
        out = os.path.join(self.run, "log", f"{self.role}.{self.name}.stdout")
        # posix_spawn, not subprocess.Popen: Popen's bookkeeping races with the
        # waitpid(-1) reaper below.
        self.daemon = os.posix_spawnp(cmd[0], cmd, dict(os.environ, SLURM_CONF=conf), file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
            (os.POSIX_SPAWN_DUP2, 1, 2)],
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ), setsid=True)
        self.log(f"started {' '.join(cmd)} pid={self.daemon}")

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.daemon:
                self.log(f"daemon exited, status={status}")
                self.daemon = None

    def wait_empty(self, timeout: float) -> bool:
        end = time.time() + timeout
        while time.time() < end:
            self.reap()
            if not [p for p in os.listdir("/proc") if p.isdigit() and p != "1"]:
                return True
            time.sleep(0.05)
        return False

    def stop_daemon(self, timeout: float = 10) -> None:
        if self.daemon is None:
            return
        os.kill(self.daemon, signal.SIGTERM)
        end = time.time() + timeout
        while self.daemon is not None and time.time() < end:
            self.reap()
            time.sleep(0.1)
        if self.daemon is not None:
            os.kill(self.daemon, signal.SIGKILL)
            while self.daemon is not None:
                self.reap()
                time.sleep(0.05)

    def halt(self) -> None:
        self.log("shutdown requested")
        self.stop_daemon()
        _kill_all(signal.SIGTERM)
        if not self.wait_empty(3):
            _kill_all(signal.SIGKILL)
            self.wait_empty(5)
        self.log("halted")

    def reboot(self) -> None:
        self.log("reboot requested: killing everything")
        _kill_all(signal.SIGKILL)
        self.wait_empty(10)
        time.sleep(REBOOT_DELAY)
        self.new_boot()
        self.start_daemon()

    def loop(self) -> int:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
            signal.signal(s, lambda n, _f: self.pending.add(n))
        os.chdir("/")
        self.setup()
        self.new_boot()
        self.start_daemon()
        while True:
            time.sleep(0.2)
            self.reap()
            if self.pending & {signal.SIGTERM, signal.SIGINT}:
                self.halt()
                return 0
            if self._take(signal.SIGUSR1):
                self.reboot()
            if self._take(signal.SIGUSR2):
                self.log("daemon restart requested")
                self.stop_daemon()
                self.start_daemon()
            if self._take(signal.SIGHUP) and self.daemon is None:
                self.start_daemon()

    def _take(self, sig: int) -> bool:
        if sig in self.pending:
            self.pending.discard(sig)
            return True
        return False


def _sh(*args: str) -> None:
    subprocess.run(args, check=True)


def _kill_all(sig: int) -> None:
    try:
        os.kill(-1, sig)  # every process of this PID namespace except PID 1 itself
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    role, name, run = sys.argv[1:4]
    sys.exit(Machine(role, name, run).loop())
