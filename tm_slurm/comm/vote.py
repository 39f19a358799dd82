"""The per-step commit vote and the agreed switch point, both through the job's store (store/).

Every node votes before its optimizer step (its ranks agree first: comm/nodevote.py): it appends
its vote (its rank) to the step's vote key, then adds to the shared count. The voter that
brings the count to the number of nodes decides: it reads the step's votes, one key whatever the
number of nodes (the count only says who checks: commit needs every node's own vote, and the
append and the add travel on one connection, so every vote is in before its count), and the
controller's pending switch, and writes the decision
with compare_set, so exactly one decision per (generation, step) exists and every rank reads the
same one. Everyone else waits for the decision key, so an
abort written by a rank that saw a failure, by the controller, or by a voter whose wait timed
out wakes them all at once; it wins only if nobody committed first. The pending switch rides in
the decision, so a planned swap happens at the same step boundary everywhere; the decider claims
it on the pending key first, so that the controller taking it back (`take_back`) and the
decision cannot disagree. Nobody applies a partial update: a step is applied only under a commit
decision.

What a healthy step costs, in store round trips: every voter sends its append (the store does
not answer it) and its add in one batch (1), then a get that waits for the decision (1); the
deciding voter instead reads the votes and the pending switch (1: in the same batch as its add in
a job of up to SPECULATE_NODES voters, where every voter reads them in case its count is the
last) and writes the decision (1), and at the one boundary that carries a switch claims it (1):
two round trips from the last vote to the decision in a small job, three in a large one. A
decider that waited for the votes themselves would not hear an abort.
"""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    commit: bool
    switch: int | None = None     # plan id to switch to at this boundary
    gen_to: int | None = None
    checkpoint: str | None = None  # write a checkpoint at this boundary (the reason)
    exit: bool = False            # ... and end the job after it
    why: str = ""

    def encode(self) -> str:
        d: dict = {"c": int(self.commit)}
        if self.switch is not None:
            d.update(sw=self.switch, gen=self.gen_to)
        if self.checkpoint:
            d.update(ck=self.checkpoint, x=int(self.exit))
        if self.why:
            d["why"] = self.why
        return json.dumps(d)

    @staticmethod
    def decode(raw: bytes | str) -> "Decision":
        d = json.loads(raw)
        return Decision(bool(d["c"]), d.get("sw"), d.get("gen"), d.get("ck"), bool(d.get("x", 0)),
                        d.get("why", ""))


def nkey(gen: int, step: int) -> str:
    return f"vote/g{gen}/s{step}/n"


def vkey(gen: int, step: int) -> str:
    return f"vote/g{gen}/s{step}/v"


def dkey(gen: int, step: int) -> str:
    return f"vote/g{gen}/s{step}/d"


def pending_key(gen: int) -> str:
    return f"vote/g{gen}/pending"


def switch_key(plan_id: int) -> str:
    return f"plan{plan_id}/switch_step"


# a step's vote keys are deleted this many steps behind a commit (by the controller:
# controller/votekeys.py): every rank is past it by then, and the controller's abort_in_flight
# only looks at the steps the ranks report they are working on
KEYS_KEPT = 64

_RANK = 4      # bytes of a vote: the voting rank

# up to this many voters, each reads what a decider reads in the batch of its vote, in case its
# count is the last: the decision then takes two round trips after the last vote (three beyond,
# four before batches; README "Steady-state overhead"). Each voter that is not the last makes the
# store's thread serve two reads for nothing: (voters - 1) x 2 requests a step for one round trip
SPECULATE_NODES = 4


def voters(store, gen: int, step: int) -> list[int]:
    """The ranks whose votes for (gen, step) are in; ValueError if the key is not a run of votes."""
    return [int.from_bytes(v, "big") for v in store.pieces(vkey(gen, step), _RANK)]


def forget(store, gen: int, step: int, count: int = 1) -> None:
    """Controller: delete the keys of `count` old steps from `step` on, so the store holds a
    bounded number of keys whatever the number of steps (controller/votekeys.py says when). In
    one round trip where the store takes batches: each one is a wake-up of the store's thread
    and the controller's, on the cores the ranks train on."""
    keys = [k for s in range(step, step + count) for k in (vkey(gen, s), nkey(gen, s), dkey(gen, s))]
    if hasattr(store, "pipeline"):
        store.pipeline(*(("delete", k) for k in keys))
    else:
        for k in keys:
            store.delete_key(k)


def abort(store, gen: int, step: int, why: str) -> Decision:
    """Try to abort (gen, step); returns the decision that stands (a commit may have won)."""
    raw = store.compare_set(dkey(gen, step), "", Decision(False, why=why).encode())
    return Decision.decode(raw)


def vote(store, gen: int, step: int, world: int, ok: bool, timeout: float, rank: int,
         per_node: int = 1) -> Decision:
    """`per_node` > 1: the first rank of each node of that many votes for its node
    (comm/nodevote.py); the count then reaches world // per_node."""
    if not ok:
        return abort(store, gen, step, "a rank saw a failure")
    nodes = world // per_node
    vote_b = rank.to_bytes(_RANK, "big")
    pipe = getattr(store, "pipeline", None)
    if pipe is None:        # a store without batches (torch's): a round trip a call
        store.append(vkey(gen, step), vote_b)
        if store.add(nkey(gen, step), 1) == nodes:
            return _decide(store, gen, step, world, per_node)
    else:
        # the vote, its count and (a small job) what the decider reads, in one round trip: read
        # after this voter's add, on its link, the votes are all in when its count is the last
        calls = [("append", vkey(gen, step), vote_b), ("add", nkey(gen, step), 1)]
        if nodes <= SPECULATE_NODES:
            calls += [("peek", vkey(gen, step)), ("peek", pending_key(gen))]
        got = pipe(*calls)
        if got[1] == nodes:
            return _decide(store, gen, step, world, per_node, *got[2:])
    try:
        raw = store.wait_get(dkey(gen, step), timeout)
    except Exception:
        return abort(store, gen, step, f"no decision within {timeout}s")
    return Decision.decode(raw)


def _decide(store, gen: int, step: int, world: int, per_node: int, *read) -> Decision:
    """`read`: (the votes, the pending switch) as read after the count reached the world, if they
    were (else read here, in one round trip where the store takes batches)."""
    pk = pending_key(gen)
    if not read:
        read = (store.pipeline(("peek", vkey(gen, step)), ("peek", pk)) if hasattr(store, "pipeline")
                else (store.peek(vkey(gen, step)), store.peek(pk)))
    raw_v, raw_p = read[0] or b"", read[1] or b""
    # not a run of votes (a length that is not one) counts as a vote missing
    every = not len(raw_v) % _RANK and sorted({int.from_bytes(raw_v[i:i + _RANK], "big") for i in
                                              range(0, len(raw_v), _RANK)}) == list(range(0, world, per_node))
    if not every:
        return abort(store, gen, step, "the count reached the world without every node's vote")
    p = json.loads(raw_p) if raw_p else {}
    if p.get("plan") is not None:
        # claim the switch for this step before deciding, so that the controller's take_back
        # and this decision agree on one outcome (a claim left by an earlier step is spent)
        claim = json.dumps({**p, "at": step})
        if "at" in p or store.compare_set(pk, raw_p, claim) != claim.encode():
            p = {}                                  # taken back meanwhile: not at this boundary
    dec = Decision(True, p.get("plan"), p.get("gen"), p.get("ckpt"), bool(p.get("exit", False)))
    got = Decision.decode(store.compare_set(dkey(gen, step), "", dec.encode()))
    if got == dec and dec.checkpoint:
        store.compare_set(pk, raw_p, "")            # consumed, unless the controller changed it
    if got.commit and got.switch is not None:
        store.set(switch_key(got.switch), str(step))
    return got


def take_back(store, gen: int, plan_id: int, why: str) -> int | None:
    """Controller: withdraw the pending switch to `plan_id`. Returns the step whose commit
    carried it, if one did (the switch stands), else None: no boundary of `gen` will. A decider
    claims the switch for its step before it writes its decision; a claimed step is settled by
    aborting it, which leaves a commit already written standing (a decider is one round trip
    from writing it; an abort there costs a recovery, in a window of that round trip)."""
    pk = pending_key(gen)
    while True:
        raw = store.peek(pk) or b""
        p = json.loads(raw) if raw else {}
        if p.get("plan") != plan_id:
            return None
        if "at" in p:
            d = abort(store, gen, p["at"], why)
            return p["at"] if d.commit and d.switch == plan_id else None
        if store.compare_set(pk, raw, "") == b"":
            return None


def abort_in_flight(store, gen: int, lo: int, hi: int, why: str) -> tuple[int, int]:
    """Controller: make sure no step in flight can commit. Aborts every undecided step lo..hi
    of `gen`, following a committed switch into the next generation (a generation's steps do
    not start at a known number, so the range is what the ranks report they are working on,
    plus one). Steps are decided in order, so once one is aborted nothing after it can commit;
    aborting steps nobody reaches is harmless (a recovery always moves to a new generation).
    What the ranks report reaches the controller with their heartbeats, so the ranks may be
    further on: the walk goes on through committed steps until it has aborted one.
    Returns (generation, first aborted step) where the ranks are."""
    first = None
    step = max(lo, 0)
    while step <= max(hi, lo) or first is None:
        d = abort(store, gen, step, why)
        if d.commit:
            if d.switch is not None:
                gen, first = d.gen_to, None
                hi = max(hi, step + 1)
        elif first is None:
            first = step
        step += 1
    return gen, first


def set_pending(store, gen: int, *, plan_id: int | None = None, gen_to: int | None = None,
                checkpoint: str | None = None, exit: bool = False) -> None:
    """Controller: act at the next committed boundary of `gen` (every rank sees the same one)."""
    p: dict = {}
    if plan_id is not None:
        p.update(plan=plan_id, gen=gen_to)
    if checkpoint:
        p.update(ckpt=checkpoint, exit=exit)
    store.set(pending_key(gen), json.dumps(p))
