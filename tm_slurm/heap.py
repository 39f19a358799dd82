"""The controller's heap once the job runs: what exists then (imports, config, topology, every
node's and link's state) lives as long as the job, so it is moved out of the collector's sight.

Python's full collections walk every tracked object; the controller's heap is mostly start-up
objects, and at 1,024 nodes those walks cost it ~0.12 s a second (bench --control-plane,
README "Control plane at scale"). Frozen objects are never walked again; garbage made later is
collected as before (refcounting first, the young generations for cycles).
"""
from __future__ import annotations

import gc


def freeze_startup() -> int:
    """Collect once, then freeze what is left; returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
