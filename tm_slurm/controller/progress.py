"""Step progress of every rank, as the workers report it, and the figures derived from it:
steady step time, stall of a swap, first completed step after a recovery."""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    step: int
    dur_s: float          # commit to commit (what progress looks like from outside)
    compute_s: float      # this step's own work (step function + vote + optimizer)
    loss: float | None
    wall: float           # wall clock at commit
    first: bool           # first step after the rank (re)started
    busy_s: float = 0.0   # the step function's time outside collectives: its own work


# steps kept per rank: more than any measuring window (a swap's, the straggler check's, the
# steady step time's), so memory and per-tick work do not grow with the job's length
KEEP = 512


class Progress:
    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self.by_rank: dict[int, dict[int, StepRecord]] = defaultdict(dict)
        self._top: dict[int, int] = {}
        # step -> how many ranks hold a record of it: whether a step is complete is then one
        # look-up, not a pass over every rank per heartbeat (which grew with nodes x ranks)
        self._have: dict[int, int] = {}
        self.cleared = 0
        self.moved: set[int] = set()      # ranks whose latest step changed (CommittedMin empties it)

    def clear(self) -> None:
        self.cleared += 1
        self.moved.clear()
        self.by_rank.clear()
        self._top.clear()
        self._have.clear()

    def add(self, rank: int, entries) -> None:
        d = self.by_rank[rank]
        for e in entries:
            r = StepRecord(*e)
            if r.step not in d:
                self._have[r.step] = self._have.get(r.step, 0) + 1
            d[r.step] = r
            if r.step > self._top.get(rank, r.step - 1):
                self._top[rank] = r.step
                self.moved.add(rank)
        while len(d) > self.keep:
            old = next(iter(d))           # the oldest reported
            del d[old]
            if (left := self._have[old] - 1) > 0:
                self._have[old] = left
            else:
                del self._have[old]

    def reported(self, step: int) -> int:
        """How many ranks have a record of `step`."""
        return self._have.get(step, 0)

    def committed(self, rank: int) -> int | None:
        return self._top.get(rank)

    def min_committed(self, ranks) -> int | None:
        vals = [self.committed(r) for r in ranks]
        return None if not vals or None in vals else min(vals)

    def record(self, rank: int, step: int) -> StepRecord | None:
        return self.by_rank.get(rank, {}).get(step)

    def steady(self, before: int | None = None, window: int = 20, ranks=None) -> float | None:
        """Median over recent steps of the slowest rank's step time (steps after a restart and
        the first two of the job excluded: they include warm-up)."""
        ranks = list(self.by_rank) if ranks is None else list(ranks)
        steps = sorted({s for r in ranks for s in self.by_rank.get(r, {})})
        if before is not None:
            steps = [s for s in steps if s < before]
        per_step = []
        for s in steps[2:][-window:]:
            recs = [self.by_rank[r].get(s) for r in ranks]
            if all(x is not None and not x.first for x in recs):
                per_step.append(max(x.dur_s for x in recs))
        return statistics.median(per_step) if per_step else None

    def steady_between(self, lo: int, hi: int, ranks=None) -> float | None:
        """Median over steps lo..hi (inclusive) of the slowest rank's step time."""
        ranks = list(self.by_rank) if ranks is None else list(ranks)
        per_step = []
        for s in range(lo, hi + 1):
            recs = [self.by_rank.get(r, {}).get(s) for r in ranks]
            if all(x is not None and not x.first for x in recs):
                per_step.append(max(x.dur_s for x in recs))
        return statistics.median(per_step) if per_step else None

    def slowest(self, step: int, ranks) -> StepRecord | None:
        recs = [self.record(r, step) for r in ranks]
        if any(x is None for x in recs):
            return None
        return max(recs, key=lambda x: x.dur_s)

    def all_at(self, step: int, ranks) -> bool:
        return all(self.record(r, step) is not None for r in ranks)

    def busy(self, rank: int, last: int) -> list[float]:
        """Own-work times of the rank's last `last` committed steps (oldest first)."""
        d = self.by_rank.get(rank, {})
        return [d[s].busy_s for s in sorted(d)[-last:]]

    def losses(self) -> dict[int, float]:
        """Loss per step, for the steps still kept (the last KEEP)."""
        out = {}
        for recs in self.by_rank.values():
            for s, r in recs.items():
                if r.loss is not None:
                    out[s] = r.loss
        return dict(sorted(out.items()))


class CommittedMin:
    """The job's committed step (the least of its ranks' latest), asked every controller tick.
    A pass over every rank (8,192 at 1,024 x 8) happens once a step, when the last rank at the
    old minimum moves on; in between a tick looks only at the ranks that reported since the last
    one. A rank's latest step never goes down until `Progress.clear`."""

    def __init__(self, progress: Progress):
        self.p = progress
        self._key = None
        self._min: int | None = None
        self._behind: set[int] = set()     # the holders' ranks still at the minimum

    def get(self, holders) -> int | None:
        key = (holders.version, self.p.cleared)
        moved, self.p.moved = self.p.moved, set()
        if key != self._key:
            self._key, self._behind = key, set()
        else:
            self._behind -= moved
        if not self._behind:
            self._min = self.p.min_committed(holders.ranks)
            self._behind = {r for r in holders.ranks if self.p.committed(r) == self._min}
        return self._min
