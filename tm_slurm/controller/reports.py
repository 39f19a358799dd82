"""What the controller does with each kind of worker report, whatever episode is in flight:
readiness, the job's start and end, and the report's line in the event log. Episodes see every
report too (Episode.on_report)."""
from __future__ import annotations

import time
from typing import Callable

from .. import heap
from ..exits import Exit
from ..messages import (CheckpointDone, CommError, CommsAborted, Stalled, Crashed, Exiting, Finished, Joined, Left, Recovered,
                        RecoveryTimeout, Report, StandbyReady, Started, Stopped, Switched)
from ..roles import JobState, Role
from .episodes.restart import FullRestart


def on_started(ctl, node: str, local: int, rep: Started) -> None:
    ctl.started.add(rep.rank)
    ctl.total_steps = rep.steps or ctl.total_steps
    if ctl.job.state == JobState.STARTING and len(ctl.started) == ctl.topo.world:
        ctl.job.set(JobState.RUNNING, since_start_s=round(time.monotonic() - ctl.t_start, 3))
        heap.freeze_startup()
    if all(r in ctl.started for r in ctl.topo.slot_ranks(ctl.nodes.nodes[node].slot)):
        ctl.nodes.set_ready(node)


def on_standby_ready(ctl, node: str, local: int, rep: StandbyReady) -> None:
    up = ctl.standby_up.setdefault(node, set())
    up.add(local)
    if len(up) == ctl.cfg.layout.ranks_per_node and ctl.nodes.nodes[node].role == Role.STANDBY:
        ctl.nodes.set_ready(node, warm=bool(rep.warm), sandbox=rep.sandbox)


def on_comm_error(ctl, node: str, local: int, rep: CommError) -> None:
    ctl.log.emit("comm_error", node=node, rank=rep.rank, step=rep.step, group=rep.group, error=rep.error)


def on_comms_aborted(ctl, node: str, local: int, rep: CommsAborted) -> None:
    ctl.log.emit("comms_aborted", node=node, rank=rep.rank, step=rep.step, groups=rep.groups, why=rep.why,
                 t=rep.t)


def on_stalled(ctl, node: str, local: int, rep: Stalled) -> None:
    ctl.log.emit("collective_stalled", node=node, rank=rep.rank, step=rep.step, group=rep.group,
                 waited_s=round(rep.waited_s, 3))
    if rep.gen == ctl.gen and rep.rank is not None:
        members = [m for m in rep.members if isinstance(m, int)][:ctl.topo.world]
        ctl.hangs.note(rep.gen, rep.group, members, rep.rank, ctl.now())


def on_checkpoint(ctl, node: str, local: int, rep: CheckpointDone) -> None:
    if rep.error:
        # the rank trains on; this step's checkpoint never completes, the previous one stays
        ctl.log.emit("checkpoint_failed", node=node, rank=rep.rank, step=rep.step, reason=rep.reason,
                     error=rep.error)
        if ctl.ending is not None:
            ctl.ending.checkpoint_failed(rep.step, f"rank {rep.rank}: {rep.error}"[:300])
        return
    if rep.path:
        ctl.log.emit("checkpoint_saved", node=node, rank=rep.rank, step=rep.step, reason=rep.reason,
                     save_s=round(rep.save_s, 4))
        ctl.records.checkpoint_written(rep.step, rep.rank)


def on_finished(ctl, node: str, local: int, rep: Finished) -> None:
    ctl.finished[rep.rank] = rep.digest
    if len(ctl.finished) == ctl.topo.world:
        ctl.stop("finished", JobState.FINISHED, code=Exit.OK)


def on_crashed(ctl, node: str, local: int, rep: Crashed) -> None:
    ctl.log.emit("worker_crashed", node=node, rank=rep.rank, error=rep.error[-1500:],
                 script_error=rep.script_error)
    if rep.script_error:      # a standby or a requeued run would fail the same way: not a node's fault
        ctl.console.script_error(node, rep.rank, rep.step, rep.error)
        last = rep.error.strip().splitlines()[-1] if rep.error.strip() else "?"
        ctl.stop(f"the training script is at fault, not {node}: {last}", JobState.FAILED, code=Exit.FAILED)


def on_rank_change(ctl, node: str, local: int, rep: Report) -> None:
    ctl.log.emit(f"rank_{rep.KIND}", node=node, rank=rep.rank, step=rep.step, **rep.data())


def on_worker_news(ctl, node: str, local: int, rep: Report) -> None:
    if isinstance(rep, Exiting) and ctl.find(FullRestart) is not None:
        return                 # the restart's own checkpoint-and-exit: it reads the step
    ctl.log.emit(f"worker_{rep.KIND}", node=node, rank=rep.rank, step=rep.step, **rep.data())


ON_REPORT: dict[type, Callable] = {
    Started: on_started,
    StandbyReady: on_standby_ready,
    CommError: on_comm_error,
    CommsAborted: on_comms_aborted,
    Stalled: on_stalled,
    CheckpointDone: on_checkpoint,
    Finished: on_finished,
    Crashed: on_crashed,
    Switched: on_rank_change,
    Recovered: on_rank_change,
    Joined: on_rank_change,
    Left: on_rank_change,
    Exiting: on_worker_news,
    Stopped: on_worker_news,
    RecoveryTimeout: on_worker_news,
}
