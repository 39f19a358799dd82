"""`tm-slurm status`: a job's nodes, roles, generation, standby readiness and last events."""
from __future__ import annotations

import json
import time
from pathlib import Path

from . import events, jobdir


def load(job: Path) -> dict:
    try:
        st = json.loads(jobdir.status_file(job).read_text())
    except (OSError, json.JSONDecodeError):
        st = {"state": "UNKNOWN", "generation": None, "nodes": {}}
    return st


def show(job: Path, as_json: bool = False, events: int = 10) -> int:
    n = events
    st = load(job)
    evs = list(_events(job))[-n:] if n else []
    if as_json:
        out = {"job": st.get("job", job.name), "state": st["state"], "generation": st["generation"],
               "committed_step": st.get("committed_step"),
               "nodes": {k: {"role": v["role"], "ready": v["ready"], "ranks": v["ranks"],
                             "host": v.get("host", "")} for k, v in st["nodes"].items()},
               "events": evs, "job_dir": str(job)}
        print(json.dumps(out, indent=1))
        return 0
    age = time.time() - st.get("updated", time.time())
    print(f"job {st.get('job', job.name)}: {st['state']}  generation {st['generation']}  "
          f"committed step {st.get('committed_step')}  (status {age:.1f}s old)  {job}")
    print(f"  {'node':<10} {'role':<9} {'ready':<6} {'ranks':<12} host")
    for name, v in st["nodes"].items():
        print(f"  {name:<10} {v['role']:<9} {str(v['ready']).lower():<6} "
              f"{','.join(map(str, v['ranks'])) or '-':<12} {v.get('host', '')}")
    if evs:
        print("  last events:")
        t0 = evs[0]["ts"]
        for e in evs:
            extra = {k: v for k, v in e.items() if k not in ("ts", "job", "gen", "node", "rank", "step", "kind")
                     and v not in (None, "", [], {})}
            print(f"   +{e['ts'] - t0:8.3f}s g{e['gen']} {e['kind']:<18} node={e['node']} rank={e['rank']} "
                  f"step={e['step']} {json.dumps(extra, default=str)[:140]}")
    return 0


def _events(job: Path):
    return events.read(jobdir.events_file(job))
