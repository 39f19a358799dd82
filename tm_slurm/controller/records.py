"""What the controller leaves for people and tools to read, besides the event log:
`status.json` (a snapshot, for `tm-slurm status`), `steps.jsonl` (progress over time) and
`result.json` (how the job ended: digests of the final state, interruptions)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from concurrent.futures import Future, ThreadPoolExecutor
from .. import checkpoints as ckpt
from .. import jobdir
from ..events import Lines, fsync_write
from ..roles import Role
from .episodes.recovery import Recovery
from .progress import KEEP
from .episodes.swap import PlannedSwap


class Records:
    def __init__(self, ctl):
        """`ctl`: the controller, read only (but for its finished checkpoints)."""
        self.ctl = ctl
        self._steps_logged: dict[int, float] = {}
        self._steps_f = Lines(jobdir.steps_file(ctl.job_dir))     # a full disk drops lines, never raises
        self._shards_in: dict[int, set[str]] = {}
        self._verifying: dict[int, Future] = {}
        self._rewritten: set[int] = set()
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="tm-ckpt-verify")
        self.status_frozen = False      # a cut-off controller (liveness.py) stops its heartbeat file
        self._snapshot_due, self._snapshot_events = 0.0, -1

    def steps(self, steps) -> None:
        """`steps.jsonl`: one line per step once every rank has committed it (again, after a
        rollback): progress over time, for users, `tm-slurm report` and the benchmark."""
        ctl = self.ctl
        for s in sorted(set(steps)):
            if ctl.progress.reported(s) < ctl.topo.world:
                continue
            line = ctl.progress.step_line(s, range(ctl.topo.world))
            if line is None:
                continue
            wall, loss, dur = line
            if self._steps_logged.get(s, -1.0) >= wall:
                continue
            self._steps_logged[s] = wall
            if len(self._steps_logged) > 2 * KEEP:
                for old in sorted(self._steps_logged)[:KEEP]:
                    del self._steps_logged[old]
            self._steps_f.write({"step": s, "wall": round(wall, 6), "gen": ctl.gen, "loss": loss,
                                 "dur_s": round(dur, 6)})

    def snapshot(self) -> dict:
        ctl = self.ctl
        nodes, held = {}, {}
        for r, h in ctl.holders.ranks.items():
            held.setdefault(h, []).append(r)
        for name, n in sorted(ctl.nodes.nodes.items()):
            ranks = sorted(held.get(name, ())) if n.role in (Role.ACTIVE, Role.LEAVING) else []
            ws = [{"local": w.local, "pid": w.pid, "rank": w.rank, "step": w.step, "alive": w.alive}
                  for w in ctl.workers.get(name, {}).values()]
            nodes[name] = {"role": n.role.value, "ready": n.ready, "ranks": ranks, "slot": n.slot,
                           "host": n.host, "workers": ws}
        swap, recovery = ctl.find(PlannedSwap), ctl.find(Recovery)
        return {"job": ctl.job_id, "state": ctl.job.state.value, "generation": ctl.gen,
                "committed_step": ctl.committed_step(), "nodes": nodes, "pid": os.getpid(),
                "swap": None if swap is None else {"plan": swap.plan.id, "state": swap.state.value},
                "recovery": None if recovery is None else {"state": recovery.state.value,
                                                            "step": recovery.step},
                "interruptions": ctl.interruptions, "updated": time.time(), **self.footprint()}

    def footprint(self) -> dict:
        """What the controller holds, for operators and the soak test: keys in its store and its
        resident memory (neither grows with the number of steps)."""
        store = getattr(self.ctl, "store", None)      # None before the store is open
        try:
            keys = store.num_keys() if store is not None else None
        except Exception:
            keys = None
        rss = next((int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")), 0)
        return {"store_keys": keys, "rss_mb": round(rss / 1024, 1)}

    def write_status(self, now: float | None = None) -> None:
        """Touched every STATUS_EVERY_S (`now`: the loop's monotonic time), its content rewritten
        when something was logged since or `snapshot_every_s` passed, and always without `now`.
        Atomic (readers never see half a file) but not fsynced: a snapshot that is worth no disk
        flush."""
        if self.status_frozen:
            return
        p = jobdir.status_file(self.ctl.job_dir)
        events = self.ctl.log.emitted
        if now is not None and now < self._snapshot_due and events == self._snapshot_events:
            try:
                os.utime(p)
                return
            except OSError:
                pass                # not written yet: write it
        if now is not None:
            self._snapshot_due = now + jobdir.snapshot_every_s(len(self.ctl.nodes.nodes))
        self._snapshot_events = events
        tmp = p.with_name(".status.json.tmp")
        try:
            tmp.write_text(json.dumps(self.snapshot()))    # no indent: C's encoder, 10x faster at 1,024 nodes
            os.replace(tmp, p)
        except OSError:
            tmp.unlink(missing_ok=True)     # a full disk: the last snapshot stays; the next may fit

    def write_result(self) -> None:
        ctl = self.ctl
        res = {"job": ctl.job_id, "state": ctl.job.state.value, "exit_code": ctl.exit_code,
               "digests": {str(r): d for r, d in sorted(ctl.finished.items())},
               "interruptions": ctl.interruptions, "steady_step_s": ctl.progress.steady(),
               "losses": ctl.progress.losses(), "generation": ctl.gen, **self.footprint()}
        try:
            fsync_write(jobdir.result_file(ctl.job_dir), json.dumps(res, indent=1).encode())
        except OSError as e:
            ctl.log.emit("result_not_written", error=str(e)[:300])

    def checkpoint_written(self, step: int, rank: int) -> None:
        """A rank wrote its shard of `step`: once every shard is in, they are verified (read and
        hashed: gigabytes for a large model) on a thread of their own, never on the loop."""
        ctl = self.ctl
        got = self._shards_in.setdefault(step, set())
        got.add(ckpt.shard_name(ctl.topo, rank))
        if step in self._verifying:
            self._rewritten.add(step)      # a shard written again while being read: read it again
        if (len(got) == len(ckpt.shards(ctl.topo)) and step not in ctl.checkpoints_done
                and step not in self._verifying):
            self._verify(step)

    def _verify(self, step: int) -> None:
        self._verifying[step] = self._verifier.submit(ckpt.bad_shards, Path(self.ctl.checkpoint_path(step)),
                                                      self.ctl.topo)

    def poll_checkpoints(self) -> None:
        """Checkpoints whose verification ended: complete (keep the newest `keep`) or not."""
        ctl = self.ctl
        for step, fut in list(self._verifying.items()):
            if not fut.done():
                continue
            del self._verifying[step]
            try:
                bad = fut.result()
            except Exception as e:             # an unreadable directory: not a checkpoint
                bad = [f"{type(e).__name__}: {e}"]
            if bad and step in self._rewritten:
                self._rewritten.discard(step)
                self._verify(step)
                continue
            self._rewritten.discard(step)
            self._shards_in.pop(step, None)
            if bad:
                ctl.log.emit("checkpoint_invalid", step=step, bad=bad[:8])
                continue
            ctl.checkpoints_done.add(step)
            ctl.log.emit("checkpoint_complete", step=step, path=ctl.checkpoint_path(step))
            gone = ckpt.prune(ckpt.root(ctl.cfg, ctl.job_dir), ctl.topo, ctl.cfg.checkpoint.keep)
            if gone:
                ctl.log.emit("checkpoint_pruned", steps=gone)
            for old in [s for s in self._shards_in if s < step]:     # failed ones: never complete
                del self._shards_in[old]

    def close(self) -> None:
        self._verifier.shutdown(wait=True)
