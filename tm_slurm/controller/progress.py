"""Step progress of every rank, as the workers report it, and the figures derived from it:
steady step time, stall of a swap, first completed step after a recovery."""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from ..messages import RECORD_FIELDS


@dataclass(frozen=True)
class StepRecord:
    step: int
    dur_s: float          # commit to commit (what progress looks like from outside)
    compute_s: float      # this step's own work (step function + vote + optimizer)
    loss: float | None
    wall: float           # wall clock at commit
    first: bool           # first step after the rank (re)started
    busy_s: float = 0.0   # the step function's time outside collectives: its own work


# the fields of a record, as it is kept: a plain tuple of numbers, which Python's collector stops
# tracking (at 1,024 x 8 ranks a window of records is millions of objects: as dataclasses they
# were most of what its full collections walked)
STEP, DUR, COMPUTE, LOSS, WALL, FIRST, BUSY = range(7)

# steps kept per rank: more than any measuring window (a swap's, the straggler check's, the
# steady step time's), so memory and per-tick work do not grow with the job's length; a large
# job keeps fewer, down to MIN_KEEP, so the window stays within about RECORDS_KEPT records
KEEP = 512
MIN_KEEP = 64
RECORDS_KEPT = 1 << 18


def keep_for(world: int) -> int:
    return max(MIN_KEEP, min(KEEP, RECORDS_KEPT // max(world, 1)))


class Progress:
    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self.by_rank: dict[int, dict[int, tuple]] = defaultdict(dict)
        self._top: dict[int, int] = {}
        # step -> how many ranks hold a record of it: whether a step is complete is then one
        # look-up, not a pass over every rank per heartbeat (which grew with nodes x ranks)
        self._have: dict[int, int] = {}
        # step -> (rank, loss) of the lowest rank that reported a loss, the last KEEP steps
        # (result.json): a window of its own, as long at any size of job
        self._loss: dict[int, tuple[int, float]] = {}
        self.cleared = 0
        self.moved: set[int] = set()      # ranks whose latest step changed (CommittedMin empties it)

    def clear(self) -> None:
        self.cleared += 1
        self.moved.clear()
        self.by_rank.clear()
        self._top.clear()
        self._have.clear()

    def add_rows(self, rows: tuple, world: int) -> set[int]:
        """`rows`: a heartbeat's flat records (messages.Heartbeat.records; the agent fills in a
        busy_s the worker left out). Returns the steps they were of. A row whose rank is not
        one of `world` is left out: a beat is sealed by this job's agent, so such a row is a
        fault, not an attack, and costs nothing else."""
        steps, n = set(), RECORD_FIELDS
        for i in range(0, len(rows) - n + 1, n):
            rank = rows[i]
            if type(rank) is not int or not 0 <= rank < world:
                continue
            r = rows[i + 1:i + n]
            step = r[STEP]
            steps.add(step)
            d = self.by_rank[rank]
            if step not in d:
                self._have[step] = self._have.get(step, 0) + 1
            d[step] = r
            if r[LOSS] is not None and rank <= self._loss.get(step, (rank, None))[0]:
                self._loss[step] = (rank, r[LOSS])
                if len(self._loss) > KEEP:
                    del self._loss[min(self._loss)]
            if step > self._top.get(rank, step - 1):
                self._top[rank] = step
                self.moved.add(rank)
            if len(d) > self.keep:
                old = next(iter(d))           # the oldest reported
                del d[old]
                if (left := self._have[old] - 1) > 0:
                    self._have[old] = left
                else:
                    del self._have[old]
        return steps

    def reported(self, step: int) -> int:
        """How many ranks have a record of `step`."""
        return self._have.get(step, 0)

    def committed(self, rank: int) -> int | None:
        return self._top.get(rank)

    def min_committed(self, ranks) -> int | None:
        vals = [self.committed(r) for r in ranks]
        return None if not vals or None in vals else min(vals)

    def record(self, rank: int, step: int) -> StepRecord | None:
        r = self.by_rank.get(rank, {}).get(step)
        return None if r is None else StepRecord(*r)

    def _slowest(self, step: int, ranks) -> float | None:
        """The slowest of `ranks`' step time of `step` if each has committed it and none of
        them had just (re)started."""
        worst = 0.0
        for rk in ranks:
            x = self.by_rank.get(rk, {}).get(step)
            if x is None or x[FIRST]:
                return None
            worst = max(worst, x[DUR])
        return worst

    def steady(self, before: int | None = None, window: int = 20, ranks=None) -> float | None:
        """Median over recent steps of the slowest rank's step time (steps after a restart and
        the first two of the job excluded: they include warm-up)."""
        ranks = list(self.by_rank) if ranks is None else list(ranks)
        steps = sorted({s for r in ranks for s in self.by_rank.get(r, {})})
        if before is not None:
            steps = [s for s in steps if s < before]
        per_step = [x for s in steps[2:][-window:] if (x := self._slowest(s, ranks)) is not None]
        return statistics.median(per_step) if per_step else None

    def steady_between(self, lo: int, hi: int, ranks=None) -> float | None:
        """Median over steps lo..hi (inclusive) of the slowest rank's step time."""
        ranks = list(self.by_rank) if ranks is None else list(ranks)
        per_step = [x for s in range(lo, hi + 1) if (x := self._slowest(s, ranks)) is not None]
        return statistics.median(per_step) if per_step else None

    def slowest(self, step: int, ranks) -> StepRecord | None:
        recs = [self.by_rank.get(r, {}).get(step) for r in ranks]
        if not recs or any(x is None for x in recs):
            return None
        return StepRecord(*max(recs, key=lambda x: x[DUR]))

    def all_at(self, step: int, ranks) -> bool:
        return all(step in self.by_rank.get(r, {}) for r in ranks)

    def step_line(self, step: int, ranks) -> tuple[float, float | None, float] | None:
        """(latest commit wall time, a loss, slowest step time) of `step` over `ranks`, once
        every one of them has committed it."""
        recs = [self.by_rank.get(r, {}).get(step) for r in ranks]
        if any(x is None for x in recs):
            return None
        return (max(x[WALL] for x in recs), next((x[LOSS] for x in recs if x[LOSS] is not None), None),
                max(x[DUR] for x in recs))

    def busy(self, rank: int, last: int) -> list[float]:
        """Own-work times of the rank's last `last` committed steps (oldest first)."""
        d = self.by_rank.get(rank, {})
        return [d[s][BUSY] for s in sorted(d)[-last:]]

    def busy_since(self, rank: int, since: int) -> dict[int, float]:
        """Own-work time of each of the rank's kept steps from `since` on."""
        return {s: x[BUSY] for s, x in self.by_rank.get(rank, {}).items() if s >= since}

    def losses(self) -> dict[int, float]:
        """Loss per step (the lowest rank's that has one), for the last KEEP steps."""
        return {s: x[1] for s, x in sorted(self._loss.items())}


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
