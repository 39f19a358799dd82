"""What the controller leaves for people and tools to read, besides the event log:
`status.json` (a snapshot, for `tm-slurm status`), `steps.jsonl` (progress over time) and
`result.json` (how the job ended: digests of the final state, interruptions)."""
from __future__ import annotations

import json
import os
import time
from .. import jobdir
from ..events import Lines, fsync_write
from ..roles import Role
from ..worker import checkpoint as ckpt
from .episodes.recovery import Recovery
from .episodes.swap import PlannedSwap


class Records:
    def __init__(self, ctl):
        """`ctl`: the controller, read only (but for its finished checkpoints)."""
        self.ctl = ctl
        self._steps_logged: dict[int, float] = {}
        self._steps_f = Lines(jobdir.steps_file(ctl.job_dir))     # a full disk drops lines, never raises

    def steps(self, steps) -> None:
        """`steps.jsonl`: one line per step once every rank has committed it (again, after a
        rollback): progress over time, for users, `tm-slurm report` and the benchmark."""
        ctl = self.ctl
        for s in sorted(set(steps)):
            recs = [ctl.progress.record(r, s) for r in range(ctl.topo.world)]
            if None in recs:
                continue
            wall = max(r.wall for r in recs)
            if self._steps_logged.get(s, -1.0) >= wall:
                continue
            self._steps_logged[s] = wall
            loss = next((r.loss for r in recs if r.loss is not None), None)
            self._steps_f.write({"step": s, "wall": round(wall, 6), "gen": ctl.gen, "loss": loss,
                                 "dur_s": round(max(r.dur_s for r in recs), 6)})

    def snapshot(self) -> dict:
        ctl = self.ctl
        nodes = {}
        for name, n in sorted(ctl.nodes.nodes.items()):
            ranks = sorted(r for r, h in ctl.holders.ranks.items() if h == name) if n.role in (
                Role.ACTIVE, Role.LEAVING) else []
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
                "interruptions": ctl.interruptions, "updated": time.time()}

    def write_status(self) -> None:
        """Atomic (readers never see half a file) but not fsynced: a snapshot, rewritten twice
        a second, that is worth no disk flush."""
        p = jobdir.status_file(self.ctl.job_dir)
        tmp = p.with_name(".status.json.tmp")
        try:
            tmp.write_text(json.dumps(self.snapshot(), indent=1))
            os.replace(tmp, p)
        except OSError:
            tmp.unlink(missing_ok=True)     # a full disk: the last snapshot stays; the next may fit

    def write_result(self) -> None:
        ctl = self.ctl
        res = {"job": ctl.job_id, "state": ctl.job.state.value, "exit_code": ctl.exit_code,
               "digests": {str(r): d for r, d in sorted(ctl.finished.items())},
               "interruptions": ctl.interruptions, "steady_step_s": ctl.progress.steady(),
               "losses": ctl.progress.losses(), "generation": ctl.gen}
        try:
            fsync_write(jobdir.result_file(ctl.job_dir), json.dumps(res, indent=1).encode())
        except OSError as e:
            ctl.log.emit("result_not_written", error=str(e)[:300])

    def checkpoint_written(self, step: int) -> None:
        """A shard was written: once all are there, the checkpoint is complete; keep the newest."""
        ctl = self.ctl
        root = ckpt.root(ctl.cfg, ctl.job_dir)
        d = ckpt.step_dir(root, step)
        if step not in ctl.checkpoints_done and d.exists() and not ckpt.bad_shards(d, ctl.topo):
            ctl.checkpoints_done.add(step)
            ctl.log.emit("checkpoint_complete", step=step, path=str(d))
            gone = ckpt.prune(root, ctl.topo, ctl.cfg.checkpoint.keep)
            if gone:
                ctl.log.emit("checkpoint_pruned", steps=gone)
