"""Keeping the node pool healthy over a long run: standbys replenished after use, and a node
persistently slower than its peers (a straggler) migrated like a planned event."""
from __future__ import annotations

import os
import time
from ..planner import straggler
from ..roles import JobState, Role
from .requests import Request


class Pool:
    def __init__(self, ctl):
        """`ctl`: the controller (its nodes, launcher, progress and requests)."""
        self.ctl = ctl
        self.replenishing = 0                  # companion standbys asked for, not yet joined
        self._next_check = 0.0

    def replenish(self) -> None:
        """Keep `standby.replenish_target` standbys: ask the launcher for more (a companion job
        under Slurm, one more local node locally); they join like any agent and warm up."""
        ctl, cfg = self.ctl, self.ctl.cfg.standby
        if not cfg.replenish or ctl.ending is not None or ctl.job.state == JobState.STARTING:
            return
        pool = len(ctl.nodes.with_role(Role.STANDBY)) + self.replenishing
        if pool >= cfg.replenish_target:
            return
        name = ctl.launcher.replenish(ctl)
        if name is None:                          # Slurm: the node is known when it says hello
            self.replenishing += 1
        else:
            ctl.nodes.add(name, Role.STANDBY)
            ctl.launcher.start(name)
        ctl.log.emit("replenish_requested", node=name, pool=pool, target=cfg.replenish_target,
                     via=ctl.launcher.kind)

    def joined(self, node: str) -> bool:
        """An agent nobody launched said hello: one of the companions asked for?"""
        if self.replenishing <= 0:
            return False
        self.replenishing -= 1
        return True

    def check_stragglers(self, now: float) -> None:
        ctl, sc = self.ctl, self.ctl.cfg.straggler
        if (not sc.enabled or now < self._next_check or ctl.busy()
                or ctl.job.state != JobState.RUNNING or ctl.intake.wanted_drains):
            return
        self._next_check = now + 1.0
        found = straggler(self._busy_by_node(), sc.margin, sc.window_steps)
        if found:
            node, slower = found
            ctl.log.emit("straggler", node=node, slower_by=round(slower, 3), window=sc.window_steps)
            ctl.handle_request(Request("drain", node, f"straggler: {slower:.0%} slower than its peers",
                                      time.time(), os.getuid(), "", {"cause": "straggler"}))

    def _busy_by_node(self) -> dict[str, list[float]]:
        """Each holding node's own work per step (its slowest rank), since it holds its slot:
        a joiner is not judged by its predecessor's steps."""
        ctl, out = self.ctl, {}
        for n in ctl.holders.nodes():
            since = ctl.holders.since.get(n, 0)
            per_step: dict[int, float] = {}
            for r in ctl.topo.slot_ranks(ctl.nodes.nodes[n].slot):
                for s, busy in ctl.progress.busy_since(r, since).items():
                    per_step[s] = max(per_step.get(s, 0.0), busy)
            out[n] = [per_step[s] for s in sorted(per_step)]
        return out
