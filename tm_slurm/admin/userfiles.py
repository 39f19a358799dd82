"""Root or the SlurmUser reading and writing in a user's job directory (docs/design.md §9): every
path below the job's working directory is opened without following a link, a read never blocks
(a FIFO is refused) and is bounded, and root writes a request as the job directory's owner, so
nothing a user plants there makes root read, wait on or write anything else."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir(job_dir: Path, *sub: str) -> int:
    """A descriptor of `job_dir/sub...`: the working directory as Slurm names it, then each of
    `tm_slurm_jobs/<id>/sub...` without following a link (OSError otherwise)."""
    job_dir = Path(job_dir)
    fd = os.open(job_dir.parents[1], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in (job_dir.parent.name, job_dir.name, *sub):
            nfd = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def read(job_dir: Path, rel: str, cap: int, offset: int = 0) -> bytes:
    """At most `cap` bytes of the regular file `job_dir/rel` from `offset`."""
    *dirs, name = rel.split("/")
    dfd = open_dir(job_dir, *dirs)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{rel} is not a regular file")
        return os.pread(fd, cap, offset)
    finally:
        os.close(fd)


def write_request(job_dir: Path, name: str, body: bytes) -> None:
    """Put a request file into the job's inbox: as the job directory's owner when root (in a
    child that drops to that user), else as this user; never through a link."""
    if os.geteuid() != 0:
        _write(job_dir, name, body)
        return
    pid = os.fork()
    if pid == 0:                                          # pragma: no cover - the child
        code = 1
        try:
            dfd = open_dir(job_dir)
            st = os.fstat(dfd)
            os.close(dfd)
            os.setgroups([])
            os.setgid(st.st_gid)
            os.setuid(st.st_uid)
            _write(job_dir, name, body)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError(errno.EACCES, f"could not write a request into {job_dir} as its owner")


def _write(job_dir: Path, name: str, body: bytes) -> None:
    dfd = open_dir(job_dir, "control", "requests")
    try:
        tmp = f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dfd)
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)
