"""SlurmBackend over Slurm's command line tools (developed against a real Slurm 22.05.8).

Queries:
- nodes: `sinfo --json -n <hostlist>` (openapi v0.0.38 in 22.05). Fields used: `name`, `state`
  (base state, lower case: "idle", "mixed", "allocated", "down", ...; a list of words from
  23.02 on, also handled), `state_flags` (["DRAIN", "REBOOT_REQUESTED", ...]), `reason`,
  `reason_changed_at` (epoch, 0 = none), `reason_set_by_user` (name or null), `boot_time`.
  NOTE: 22.05's `sinfo --json` ignores `-n` (and every other filter) and always returns all
  nodes, so the result is filtered here; `-n` is still passed for versions that honour it.
  Alternative `node_query="scontrol"`: `scontrol show node -o <hostlist>` (filtered by Slurm,
  authoritative `State=` string; the reason's text must not contain ` Word=`).
  Do not use sinfo's text `%T`: it can show `mixed*` for a node that is DOWN+NOT_RESPONDING.
- reservations: `scontrol show res -o`; jobs: `scontrol show job -o J`. Both run with
  SLURM_TIME_FORMAT=%s so times come back as epoch seconds whatever the user's
  SLURM_TIME_FORMAT/TZ (with `relative` the standard parser would silently misread them);
  the standard `2026-12-02T14:00:00` local-time format is parsed too.
- release_nodes: `scontrol update JobId=J NodeList=<keep>` (see its docstring for what 22.05
  does to the released nodes and their steps), notify/requeue/drain/resume: scontrol.

Every call runs with a timeout (constructor `timeout`, default 10 s) and raises SlurmError
with the command, exit status and stderr. `run` (default subprocess.run) is injectable, and
`env` (merged over os.environ) goes to every subprocess.
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import time
from typing import Any, Callable, Mapping, Sequence

from . import hostlist
from .backend import (JobInfo, NodeState, Reservation, SlurmError, check_release, resizes_once,
                      split_state)

Runner = Callable[..., Any]

_NOTHING = {"", "(null)", "none", "n/a", "unknown", "null"}


# ---------------------------------------------------------------------------------------------
# parsing (pure functions; unit-tested on golden output captured from the real cluster)

def parse_time(text: Any) -> float | None:
    """Slurm time -> epoch seconds. Accepts epoch numbers (SLURM_TIME_FORMAT=%s, JSON),
    `2026-12-02T14:00:00` (standard format, local time), and openapi's {"set", "number"}
    objects. Unknown/None/N/A/0 -> None."""
    if text is None or isinstance(text, bool):
        return None
    if isinstance(text, dict):          # openapi >= v0.0.39: {"set": true, "infinite": false, "number": N}
        if not text.get("set", True) or text.get("infinite"):
            return None
        text = text.get("number")
        return parse_time(text)
    if isinstance(text, (int, float)):
        return float(text) if text > 0 else None
    s = str(text).strip()
    if s.lower() in _NOTHING:
        return None
    if re.fullmatch(r"\d+(\.\d+)?", s):
        v = float(s)
        return v if v > 0 else None
    for fmt in ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M"):
        try:
            return time.mktime(time.strptime(s, fmt))
        except ValueError:
            pass
    return None


def parse_duration(text: Any) -> float | None:
    """Slurm time limit -> seconds. UNLIMITED/INFINITE/NONE/N/A/Partition_Limit -> None.
    Formats (scontrol prints the first two): D-HH:MM:SS, HH:MM:SS, MM:SS, MM, D-HH, D-HH:MM."""
    if text is None:
        return None
    if isinstance(text, (int, float)):
        return float(text) * 60.0             # openapi/pyslurm time_limit is in minutes
    s = str(text).strip()
    if not s or s.upper() in ("UNLIMITED", "INFINITE", "NONE", "N/A", "PARTITION_LIMIT", "(NULL)"):
        return None
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", s)
    if not m:
        raise ValueError(f"unrecognised Slurm time limit {s!r}")
    days, a, b, c = m.groups()
    if days is not None:                      # D-HH[:MM[:SS]]
        h, mi, se = int(a), int(b or 0), int(c or 0)
        return float(int(days) * 86400 + h * 3600 + mi * 60 + se)
    if c is not None:                         # HH:MM:SS
        return float(int(a) * 3600 + int(b) * 60 + int(c))
    if b is not None:                         # MM:SS
        return float(int(a) * 60 + int(b))
    return float(int(a) * 60)                 # MM


_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/]*)=")
_REASON_TAIL = re.compile(r"^(.*?)\s*\[([^\[\]@]*)@([^\[\]]*)\]\s*$")


def parse_kv_line(line: str, rest_of_line: Sequence[str] = ()) -> dict[str, str]:
    """One `scontrol show ... -o` line -> {key: value}. A value runs until the next ` Key=`, so
    values may contain spaces (OS=Linux 6.1 #1 SMP, WorkDir=/a b). Keys in `rest_of_line`
    take everything up to the end of the line (e.g. a node's Reason, which is free text)."""
    line = line.rstrip("\n")
    for key in rest_of_line:
        m = re.search(rf"(?:^|\s){re.escape(key)}=", line)
        if m:
            head, tail = line[:m.start()], line[m.end():]
            out = parse_kv_line(head)
            out[key] = tail.strip()
            return out
    out: dict[str, str] = {}
    matches = list(_KEY.finditer(line))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out.setdefault(m.group(1), line[m.end():end].strip())
    return out


def _lines(text: str) -> list[str]:
    return [ln for ln in (text or "").splitlines() if ln.strip()]


def _nodes_tuple(text: str | None) -> tuple[str, ...]:
    return tuple(hostlist.expand(text or ""))


def parse_reason(text: str) -> tuple[str, str, float | None]:
    """`maint [root@2026-12-02T14:10:50]` -> ("maint", "root", epoch)."""
    text = (text or "").strip()
    if text.lower() in _NOTHING:
        return "", "", None
    m = _REASON_TAIL.match(text)
    if not m:
        return text, "", None
    return m.group(1).strip(), m.group(2).strip(), parse_time(m.group(3))


def node_from_json(d: Mapping[str, Any]) -> NodeState:
    """One element of `sinfo --json`'s "nodes" (openapi v0.0.38; newer layouts tolerated)."""
    raw_state = d.get("state", "")
    if isinstance(raw_state, (list, tuple)):          # v0.0.39+: "state": ["IDLE", "DRAIN"]
        raw_state = "+".join(str(x) for x in raw_state)
    base, flags = split_state(str(raw_state))
    flags = set(flags) | {str(f).upper() for f in (d.get("state_flags") or [])}
    user = d.get("reason_set_by_user") or ""
    return NodeState(
        name=str(d["name"]), state=base, flags=frozenset(flags),
        reason=str(d.get("reason") or ""),
        reason_time=parse_time(d.get("reason_changed_at")),
        reason_user=str(user) if user else "",
        boot_time=parse_time(d.get("boot_time")))


def parse_sinfo_json(text: str, names: Sequence[str] | None = None) -> dict[str, NodeState]:
    """`sinfo --json` output -> {name: NodeState}, only `names` if given (22.05 ignores -n)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise SlurmError(f"`sinfo --json` printed something that is not JSON ({e}): "
                         f"{text[:200]!r}") from None
    errors = [e for e in (doc.get("errors") or []) if e]
    if errors and not doc.get("nodes"):
        raise SlurmError(f"`sinfo --json` reported errors: {errors}")
    wanted = set(names) if names is not None else None
    out: dict[str, NodeState] = {}
    for d in doc.get("nodes") or []:
        name = d.get("name")
        if name is None or (wanted is not None and name not in wanted):
            continue
        out[name] = node_from_json(d)
    return out


def node_from_kv(kv: Mapping[str, str]) -> NodeState:
    base, flags = split_state(kv.get("State", ""))
    reason, user, when = parse_reason(kv.get("Reason", ""))
    return NodeState(name=kv["NodeName"], state=base, flags=flags, reason=reason,
                     reason_time=when, reason_user=user, boot_time=parse_time(kv.get("BootTime")))


def parse_scontrol_nodes(text: str, names: Sequence[str] | None = None) -> dict[str, NodeState]:
    """`scontrol show node -o` output -> {name: NodeState}."""
    wanted = set(names) if names is not None else None
    out: dict[str, NodeState] = {}
    for line in _lines(text):
        if not line.startswith("NodeName="):
            continue
        kv = parse_kv_line(line, rest_of_line=("Reason",))
        if wanted is None or kv["NodeName"] in wanted:
            out[kv["NodeName"]] = node_from_kv(kv)
    return out


def reservation_from_kv(kv: Mapping[str, str]) -> Reservation:
    flags = frozenset(f.strip().upper() for f in kv.get("Flags", "").split(",")
                      if f.strip() and f.strip().lower() not in _NOTHING)
    start = parse_time(kv.get("StartTime"))
    end = parse_time(kv.get("EndTime"))
    return Reservation(name=kv["ReservationName"], nodes=_nodes_tuple(kv.get("Nodes")),
                       start=start if start is not None else 0.0,
                       end=end if end is not None else math.inf,
                       flags=flags, state=kv.get("State", "").upper())


def parse_scontrol_reservations(text: str) -> list[Reservation]:
    """`scontrol show res -o` output -> reservations ("No reservations in the system" -> [])."""
    return [reservation_from_kv(parse_kv_line(ln)) for ln in _lines(text)
            if ln.startswith("ReservationName=")]


def parse_scontrol_config(text: str) -> dict[str, str]:
    """`scontrol show config`: `Name<padding> = value` lines (the first of a name wins; the
    plugin sections after the main one repeat no name tm_slurm reads)."""
    conf: dict[str, str] = {}
    for line in _lines(text):
        name, sep, value = line.partition(" = ")
        if sep:
            conf.setdefault(name.strip(), value.strip())
    return conf


def _user(text: str) -> str:
    """`root(0)` -> "root"."""
    s = (text or "").strip()
    return s.split("(", 1)[0] if s.lower() not in _NOTHING else ""


def job_from_kv(kv: Mapping[str, str]) -> JobInfo:
    reason = kv.get("Reason", "")
    if reason.lower() in _NOTHING:
        reason = ""
    restarts = kv.get("Restarts", "0")
    requeue = kv.get("Requeue")
    return JobInfo(
        job_id=kv["JobId"], state=kv.get("JobState", "").upper(),
        nodes=_nodes_tuple(kv.get("NodeList")), user=_user(kv.get("UserId", "")),
        workdir=kv.get("WorkDir", "") if kv.get("WorkDir", "").lower() not in _NOTHING else "",
        batch_host=kv.get("BatchHost", "") if kv.get("BatchHost", "").lower() not in _NOTHING else "",
        time_limit_s=parse_duration(kv.get("TimeLimit")),
        restarts=int(restarts) if restarts.isdigit() else 0,
        reason=reason,
        start_time=parse_time(kv.get("StartTime")), end_time=parse_time(kv.get("EndTime")),
        requeue=None if requeue is None else requeue.strip() == "1")


def parse_scontrol_job(text: str, job_id: str | None = None) -> JobInfo | None:
    """`scontrol show job -o J` output -> JobInfo (the line whose JobId is J, else the first)."""
    kvs = [parse_kv_line(ln) for ln in _lines(text) if ln.startswith("JobId=")]
    if not kvs:
        return None
    for kv in kvs:
        if job_id is not None and kv.get("JobId") == str(job_id):
            return job_from_kv(kv)
    return job_from_kv(kvs[0])


# ---------------------------------------------------------------------------------------------

class CliBackend:
    """SlurmBackend over sinfo/scontrol. See the module docstring."""

    name = "cli"

    def __init__(self, *, run: Runner = subprocess.run, env: Mapping[str, str] | None = None,
                 timeout: float = 10.0, node_query: str = "sinfo-json"):
        if node_query not in ("sinfo-json", "scontrol"):
            raise ValueError(f"node_query must be 'sinfo-json' or 'scontrol', got {node_query!r}")
        self._run = run
        self.timeout = float(timeout)
        self.node_query = node_query
        merged = dict(os.environ)
        merged.update(env or {})
        merged["SLURM_TIME_FORMAT"] = "%s"     # epoch seconds: immune to TZ and user settings
        self.env = merged

    # -- plumbing
    def _call(self, argv: Sequence[str], *, ok_codes: Sequence[int] = (0,),
              timeout: float | None = None) -> Any:
        argv = [str(a) for a in argv]
        cmd = shlex.join(argv)
        t = self.timeout if timeout is None else timeout
        try:
            cp = self._run(argv, capture_output=True, text=True, timeout=t, env=self.env)
        except FileNotFoundError:
            raise SlurmError(f"Slurm CLI not found (is slurm-client installed / on PATH?): "
                             f"cannot run {argv[0]!r}", argv=argv) from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"`{cmd}` timed out after {t:g} s (slurmctld unreachable or "
                             f"overloaded?)", argv=argv) from None
        except OSError as e:
            raise SlurmError(f"`{cmd}` could not be started: {e}", argv=argv) from None
        if cp.returncode not in ok_codes:
            stderr = (cp.stderr or "").strip()
            raise SlurmError(f"`{cmd}` failed with exit code {cp.returncode}: "
                             f"{stderr or (cp.stdout or '').strip() or '(no output)'}",
                             argv=argv, returncode=cp.returncode, stderr=stderr)
        return cp

    # -- queries
    def nodes(self, names: Sequence[str]) -> dict[str, NodeState]:
        names = list(dict.fromkeys(names))
        if not names:
            return {}
        hl = hostlist.compress(names, sort=True)
        if self.node_query == "scontrol":
            cp = self._call(["scontrol", "show", "node", "-o", hl], ok_codes=(0, 1))
            out = parse_scontrol_nodes(cp.stdout, names)
            if cp.returncode != 0 and not out and "not found" not in (cp.stderr or "").lower():
                raise SlurmError(f"`scontrol show node -o {hl}` failed with exit code "
                                 f"{cp.returncode}: {(cp.stderr or '').strip()}",
                                 returncode=cp.returncode, stderr=cp.stderr or "")
            return out
        cp = self._call(["sinfo", "--json", "-n", hl])
        return parse_sinfo_json(cp.stdout, names)

    def reservations(self) -> list[Reservation]:
        cp = self._call(["scontrol", "show", "res", "-o"])
        return parse_scontrol_reservations(cp.stdout)

    def job(self, job_id: str) -> JobInfo | None:
        try:
            cp = self._call(["scontrol", "show", "job", "-o", str(job_id)])
        except SlurmError as e:
            if "invalid job id" in e.stderr.lower():
                return None
            raise
        return parse_scontrol_job(cp.stdout, str(job_id))

    def job_workdir(self, job_id: str) -> str | None:
        info = self.job(job_id)
        return (info.workdir or None) if info else None

    # -- actions
    def release_nodes(self, job_id: str, keep: Sequence[str]) -> None:
        """Shrink RUNNING job `job_id` to the nodes in `keep`.

        Runs `scontrol update JobId=J NodeList=<keep>`. Observed on Slurm 22.05.8:
        - synchronous; `squeue`/`scontrol show job` show the new NodeList/NumNodes at once;
        - steps still running on a removed node are SIGKILLed at once (slurmctld logs
          "Killing JobId=J StepId=S on failed node X"; the step's srun exits 137, no SIGTERM
          first), steps on kept nodes are untouched, the job stays RUNNING;
        - a removed node with a pending drain goes MIXED+DRAIN -> IDLE+DRAIN (drained) at
          once (seen by the next query, 0.1-0.2 s), so a maintenance waiting for it can start;
        - the batch script's SLURM_JOB_NODELIST / SLURM_NNODES / SLURM_JOB_NUM_NODES are NOT
          updated: a later plain `srun` warns "SLURM_JOB_NUM_NODES environment variable
          conflicts with allocated node count (3 != 2)" and uses the new allocation, an
          `srun -N<old count>` retries forever ("Requested nodes are busy"), an `srun -w` on a
          released node fails ("Requested node configuration is not available"). Launch new
          steps with explicit -N/-w from the current node list;
        - the batch host cannot be removed ("You cannot remove the batch host from a job when
          resizing"), NodeList must be a non-empty subset of the allocation; Slurm reports all
          of these only as "Invalid node name specified", so they are checked here first with
          a clear message. On a PENDING job the same command would instead replace the
          required node list (ReqNodeList), so non-running jobs are refused.
        """
        keep = check_release(job_id, self.job(job_id), keep)
        if keep is None:
            return
        self._call(["scontrol", "update", f"JobId={job_id}",
                    f"NodeList={hostlist.compress(keep, sort=True)}"])

    def resizes_once(self) -> bool:
        conf = parse_scontrol_config(self._call(["scontrol", "show", "config"]).stdout)
        return resizes_once(conf.get("SLURM_VERSION", ""), conf.get("AccountingStorageType", ""))

    def notify(self, job_id: str, message: str) -> None:
        self._call(["scontrol", "notify", str(job_id), message])

    def requeue(self, job_id: str) -> None:
        try:
            self._call(["scontrol", "requeue", str(job_id)])
        except SlurmError as e:
            if "disabled" in e.stderr.lower():
                raise SlurmError(f"{e} (the job is not requeueable: submit it with --requeue, "
                                 "or JobRequeue=1 in slurm.conf)", argv=e.argv,
                                 returncode=e.returncode, stderr=e.stderr) from None
            raise

    def drain(self, nodes: Sequence[str], reason: str) -> None:
        if not nodes:
            return
        if not reason or not reason.strip():
            raise SlurmError("drain: Slurm requires a reason to drain a node")
        self._call(["scontrol", "update", f"NodeName={hostlist.compress(nodes, sort=True)}",
                    "State=DRAIN", f"Reason={reason}"])

    def resume(self, nodes: Sequence[str]) -> None:
        if not nodes:
            return
        try:
            self._call(["scontrol", "update", f"NodeName={hostlist.compress(nodes, sort=True)}",
                        "State=RESUME"])
        except SlurmError as e:
            if "invalid node state" in e.stderr.lower():
                raise SlurmError(f"{e} (a node that is not drained, failed or down cannot be "
                                 "resumed; Slurm 22.05 still resumes the other listed nodes)", argv=e.argv,
                                 returncode=e.returncode, stderr=e.stderr) from None
            raise


__all__ = ["CliBackend", "parse_time", "parse_duration", "parse_kv_line", "parse_reason",
           "parse_sinfo_json", "parse_scontrol_nodes", "parse_scontrol_reservations",
           "parse_scontrol_job", "node_from_json"]
