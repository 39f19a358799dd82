"""Requests to a running job (drain a node, checkpoint now, stop): small JSON files dropped into
the job's requests directory, which anyone may write into but only the owner can list (1733).

A request is authenticated by the kernel: the controller acts only on files owned by the job's
user, root, or the SlurmUser; anything else is refused, logged, and removed."""
from __future__ import annotations

import json
import math
import os
import pwd
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from .. import jobdir

VERBS = ("drain", "checkpoint", "stop", "fail")


@dataclass(frozen=True)
class Request:
    verb: str
    node: str | None
    reason: str
    t: float                # wall clock when it was made
    uid: int
    path: str
    extra: dict


def request_file(verb: str, node: str | None = None, reason: str = "", **extra) -> tuple[str, bytes]:
    """(file name, body) of a request; the name sorts by creation time."""
    if verb not in VERBS:
        raise ValueError(f"unknown request {verb!r}; valid: {', '.join(VERBS)}")
    body = json.dumps({"verb": verb, "node": node, "reason": reason, "t": time.time(), **extra})
    return f"{time.time_ns()}-{os.getpid()}-{verb}.json", body.encode()


def submit(job_dir: Path, verb: str, node: str | None = None, reason: str = "", **extra) -> Path:
    """A request from the job's own user (admin tools write theirs with admin/userfiles.py)."""
    name, body = request_file(verb, node, reason, **extra)
    d = jobdir.requests_dir(job_dir)
    tmp = d / f".{name}.tmp"
    tmp.write_bytes(body)
    os.replace(tmp, d / name)
    return d / name


def slurm_user_uid() -> int | None:
    """SlurmUser from the Slurm config (trigger programs run as it)."""
    conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    try:
        for line in Path(conf).read_text().splitlines():
            k, _, v = line.partition("=")
            if k.strip().lower() == "slurmuser":
                return pwd.getpwnam(v.split("#")[0].strip()).pw_uid
    except (OSError, KeyError):
        pass
    return None


class Refusal(NamedTuple):
    """A refused request file, or (`count` > 1) a summary of a uid's refusals since its last line."""
    file: str
    uid: int
    why: str
    count: int = 1


# bounds: a request is a few hundred bytes; a tick reads a few files; a flood is a summary
MAX_BYTES = 4096
MAX_TEXT = 1000                 # reason, node, source
PER_POLL = 32
QUIET_S = 10.0                  # one refusal line per uid per this; the rest are summed up
KEEP_REFUSED = 64               # files kept in control/refused/ for the owner to look at
FIELDS: dict[str, tuple[type, ...]] = {"verb": (str,), "node": (str, type(None)), "reason": (str,),
                                       "t": (int, float), "exit": (bool,), "source": (str, type(None))}


class Refused(Exception):
    pass


def parse(raw: bytes, uid: int, path: str) -> Request:
    """A request from a file's bytes, or Refused with a reason its sender can act on."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise Refused(f"not JSON: {str(e)[:120]}") from None
    if not isinstance(data, dict):
        raise Refused(f"not a JSON object but {type(data).__name__}")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise Refused(f"unknown keys {unknown}; valid: {', '.join(FIELDS)}")
    for k, v in data.items():
        if not isinstance(v, FIELDS[k]) or (k != "exit" and isinstance(v, bool)):
            raise Refused(f"{k!r} is {type(v).__name__}, not {' or '.join(t.__name__ for t in FIELDS[k])}")
        if isinstance(v, str) and len(v) > MAX_TEXT:
            raise Refused(f"{k!r} longer than {MAX_TEXT} characters")
    verb = data.get("verb")
    if verb not in VERBS:
        raise Refused(f"unknown verb {verb!r}; valid: {', '.join(VERBS)}")
    if verb in ("drain", "fail") and not data.get("node"):
        raise Refused(f"{verb} needs a node")
    t = float(data.get("t", time.time()))
    if not math.isfinite(t):
        raise Refused("'t' is not a finite number")
    extra = {k: data[k] for k in ("exit", "source") if k in data}
    return Request(verb, data.get("node"), data.get("reason", ""), t, uid, path, extra)


class Inbox:
    """Reads requests as hostile input (docs/design.md §9): never follows a link, never blocks
    on a FIFO, reads at most MAX_BYTES of a regular file owned by an allowed user, a bounded
    number per tick. A refused file is moved to control/refused/ (the newest KEEP_REFUSED stay),
    so a `--resume` does not meet it again."""

    def __init__(self, job_dir: Path, allowed_uids: set[int], clock=time.monotonic):
        self.dir = jobdir.requests_dir(job_dir)
        os.chmod(self.dir, 0o1733)
        self.aside = jobdir.refused_dir(job_dir)
        self.allowed = set(allowed_uids)
        self.clock = clock
        self._quiet: dict[int, tuple[float, int, str]] = {}      # uid -> (line at, since, last why)

    def poll(self) -> tuple[list[Request], list[Refusal]]:
        """(accepted requests in arrival order, refusals to log)."""
        ok, refused = [], []
        try:
            names = sorted(n for n in os.listdir(self.dir) if n.endswith(".json") and not n.startswith("."))
        except OSError:
            names = []          # the owner removed it: nothing to read (a request recreates it)
        for name in names[:PER_POLL]:
            try:
                ok.append(self._read(name))
            except Refused as e:
                uid = e.args[1] if len(e.args) > 1 else -1
                self._aside(name)
                refused += self._limit(Refusal(name, uid, e.args[0]))
        return ok, refused + self._summaries()

    def _read(self, name: str) -> Request:
        path = self.dir / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            try:
                uid = os.lstat(path).st_uid
            except OSError:
                uid = -1
            raise Refused(f"cannot open it without following a link: {e.strerror}", uid) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Refused("not a regular file", st.st_uid)
            if st.st_uid not in self.allowed:
                raise Refused("not the job owner, root or SlurmUser", st.st_uid)
            if st.st_size > MAX_BYTES:
                raise Refused(f"{st.st_size} bytes, more than {MAX_BYTES}", st.st_uid)
            raw = os.read(fd, MAX_BYTES + 1)
        finally:
            os.close(fd)
        try:
            req = parse(raw, st.st_uid, str(path))
        except Refused as e:
            raise Refused(e.args[0], st.st_uid) from None
        path.unlink(missing_ok=True)
        return req

    def _aside(self, name: str) -> None:
        try:
            os.rename(self.dir / name, self.aside / name)
        except OSError:
            _remove(self.dir / name)
        for old in sorted(os.listdir(self.aside))[:-KEEP_REFUSED]:
            _remove(self.aside / old)

    def _limit(self, r: Refusal) -> list[Refusal]:
        now = self.clock()
        at, since, _ = self._quiet.get(r.uid, (None, 0, ""))
        if at is None or now - at >= QUIET_S:
            self._quiet[r.uid] = (now, 0, r.why)
            return [r]
        self._quiet[r.uid] = (at, since + 1, r.why)
        return []

    def _summaries(self) -> list[Refusal]:
        """A uid quiet for QUIET_S gets one line for what it sent meanwhile."""
        now, out = self.clock(), []
        for uid, (at, since, why) in list(self._quiet.items()):
            if now - at >= QUIET_S:
                if since:
                    out.append(Refusal("(more)", uid, why, since))
                del self._quiet[uid]
        return out


def _remove(p: Path) -> None:
    """A file, link, FIFO or directory (rmtree does not follow links)."""
    try:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    except OSError:
        pass
