"""Requests to a running job (drain a node, checkpoint now, stop): small JSON files dropped into
the job's requests directory, which anyone may write into but only the owner can list (1733).

A request is authenticated by the kernel: the controller acts only on files owned by the job's
user, root, or the SlurmUser; anything else is refused, logged, and removed."""
from __future__ import annotations

import json
import os
import pwd
import time
from dataclasses import dataclass
from pathlib import Path

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


def submit(job_dir: Path, verb: str, node: str | None = None, reason: str = "", **extra) -> Path:
    if verb not in VERBS:
        raise ValueError(f"unknown request {verb!r}; valid: {', '.join(VERBS)}")
    d = jobdir.requests_dir(job_dir)
    body = json.dumps({"verb": verb, "node": node, "reason": reason, "t": time.time(), **extra})
    name = f"{time.time_ns()}-{os.getpid()}-{verb}"
    tmp = d / f".{name}.tmp"
    tmp.write_text(body)
    os.replace(tmp, d / f"{name}.json")
    return d / f"{name}.json"


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


class Inbox:
    def __init__(self, job_dir: Path, allowed_uids: set[int]):
        self.dir = jobdir.requests_dir(job_dir)
        os.chmod(self.dir, 0o1733)
        self.allowed = set(allowed_uids)

    def poll(self) -> tuple[list[Request], list[tuple[str, int, str]]]:
        """(accepted requests in arrival order, [(file, uid, why)] refused)."""
        ok, refused = [], []
        for p in sorted(self.dir.glob("*.json")):
            try:
                st = p.stat()
                data = json.loads(p.read_text())
            except (OSError, json.JSONDecodeError) as e:
                refused.append((p.name, -1, f"unreadable: {e}"))
                p.unlink(missing_ok=True)
                continue
            p.unlink(missing_ok=True)
            if st.st_uid not in self.allowed:
                refused.append((p.name, st.st_uid, "not the job owner, root or SlurmUser"))
                continue
            if data.get("verb") not in VERBS:
                refused.append((p.name, st.st_uid, f"unknown verb {data.get('verb')!r}"))
                continue
            extra = {k: v for k, v in data.items() if k not in ("verb", "node", "reason", "t")}
            ok.append(Request(data["verb"], data.get("node"), data.get("reason", ""),
                              float(data.get("t", time.time())), st.st_uid, str(p), extra))
        return ok, refused
