"""The controller deletes the vote keys of steps that no rank will read again (comm/vote.py), so
the store holds a bounded number of them whatever the number of steps, and no rank spends its
step on the job's housekeeping: when rank 0 deleted them, on its vote thread while it applied the
step, it came to the next collective ~0.3 ms late and every rank waited for it (README "Steady-
state overhead").

When a step's keys are dead is read from the store, not from the controller's picture of progress
(which lags behind the ranks, and does not go down when a recovery rolls them back to a
checkpoint): a commit of step t in generation g means every rank voted on it, and a generation's
ranks vote on its steps in order, so no rank reads (g, s) for s < t again. Keys are deleted
KEYS_KEPT steps behind such a commit. An older generation's keys are dead once the current one
has a commit: its steps are walked until the first that has no decision (every step that had
votes has one: a commit, an abort, or the abort of a voter that waited in vain).
"""
from __future__ import annotations

from ..comm import vote as votes

# steps whose keys one tick deletes at most (three keys each; the current generation's in one
# round trip): more than one step of the fastest job between two idle ticks, so a backlog never grows
PER_TICK = 8


class VoteKeys:
    def __init__(self, store, gen: int, first_step: int):
        self.store = store
        # [generation, the first of its steps whose keys may still be there], oldest first; the
        # last is the one the ranks are in
        self.gens: list[list[int]] = [[gen, max(first_step, 0)]]
        self.ops = 0          # store operations, for the control-plane benchmark
        self._seen = self._not_yet = (-1, -1)     # (generation, step) found committed / not yet

    def enter(self, gen: int, first_step: int) -> None:
        self.gens.append([gen, max(first_step, 0)])

    def sweep(self, committed: int | None) -> int:
        """`committed`: the job's committed step as the controller sees it (which commit to look
        for). Deletes the keys of at most PER_TICK steps; returns how many."""
        cur = self.gens[-1]
        if committed is None or (len(self.gens) == 1 and committed - votes.KEYS_KEPT < cur[1]):
            return 0
        if (cur[0], committed) != self._seen:
            if (cur[0], committed) == self._not_yet or not self._committed(cur[0], committed):
                self._not_yet = (cur[0], committed)    # asked once: a stalled job costs no more
                return 0
            self._seen = (cur[0], committed)
        done = 0
        while len(self.gens) > 1 and done < PER_TICK:
            old = self.gens[0]
            self.ops += 1
            if not self.store.check([votes.dkey(*old)]):
                self.gens.pop(0)
                continue
            self._forget(*old)
            old[1] += 1
            done += 1
        n = min(PER_TICK - done, committed - votes.KEYS_KEPT - cur[1] + 1)
        if n > 0:                 # the current generation's dead steps: one round trip for all
            self._forget(cur[0], cur[1], n)
            cur[1] += n
            done += n
        return done

    def _committed(self, gen: int, step: int) -> bool:
        self.ops += 1
        raw = self.store.peek(votes.dkey(gen, step))
        return raw is not None and votes.Decision.decode(raw).commit

    def _forget(self, gen: int, step: int, count: int = 1) -> None:
        votes.forget(self.store, gen, step, count)
        self.ops += 3 * count
