"""What authentication costs one control-plane frame: seal + open (JSON codec, HMAC-SHA256, the
checks) against the pickle dumps + loads it replaced, for the frames a job sends most."""
from __future__ import annotations

import pickle
import statistics
import time

from .. import config as cfgmod
from ..control.auth import Keys, Sealer, mac
from ..messages import GroupBuild, Heartbeat, Launch, Ping, Switched, WorkerInfo, WorkerReport


def _samples() -> dict[str, object]:
    records = tuple(x for s in range(5) for x in (3, s, 0.05, 0.049, 2.31, 1.8e9, False, 0.01))
    return {
        "ping": Ping(7, 1.8e9),
        "heartbeat (1 worker, 5 steps)": Heartbeat("node1", 9, 1.8e9, (WorkerInfo(0, 1234, 3, 41, 40, True),),
                                                   True, (), records),
        "report": WorkerReport("node1", 0, Switched(2, 3, 41, plan=1, switch_s=0.0004, rebuilt=["dp0"],
                                                        identity={"dp0": [1, 2]})),
        "launch (config, 16 groups)": Launch("job", 0, "ACTIVE", 1, (2, 3), 1, ("python", "train.py"), "/w", (),
                                             cfgmod.to_dict(cfgmod.Config()), ("10.0.0.1", 29500),
                                             tuple(GroupBuild(f"g{i}", (i, i + 1), f"g0/g{i}") for i in range(16))),
    }


def _median_us(fn, n: int) -> float:
    per = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(per)


def frame_costs(n: int = 2000) -> dict:
    keys = Keys.derive(b"\x01" * 32)
    out = {}
    for name, msg in _samples().items():
        tx, rx = Sealer(keys, "job", "a"), Sealer(keys, "job", "b", peer="a")
        frame = tx.seal(msg)
        sealed = _median_us(lambda: rx.open(tx.seal(msg)), n)
        pickled = _median_us(lambda: pickle.loads(pickle.dumps(msg)), n)
        body = frame[32:]
        hmac_us = _median_us(lambda: mac(keys.frame, body), n)
        out[name] = {"bytes": len(frame), "seal_open_us": round(sealed, 1), "hmac_us": round(hmac_us, 2),
                     "pickle_us": round(pickled, 1), "ratio_vs_pickle": round(sealed / pickled, 1)}
    return out


def table(costs: dict) -> str:
    lines = [f"{'frame':32s} {'bytes':>6s} {'seal+open us':>13s} {'of which HMAC':>14s} {'pickle us':>10s} {'ratio':>6s}"]
    for name, c in costs.items():
        lines.append(f"{name:32s} {c['bytes']:>6d} {c['seal_open_us']:>13.1f} {c['hmac_us']:>14.2f} "
                     f"{c['pickle_us']:>10.1f} {c['ratio_vs_pickle']:>5.1f}x")
    return "\n".join(lines)
