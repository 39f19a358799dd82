"""The Slurm boundary of tm_slurm: one small backend interface (CLI or pyslurm), hostlists,
the allocation we run in, and the pure classification of node states into events.

    from tm_slurm.slurm import backend_for
    from tm_slurm.slurm.classify import classify
    be = backend_for("auto")                 # CliBackend or PyslurmBackend
    states = be.nodes(job_nodes)             # one batched query
    events = classify(states, be.reservations(), job_nodes, time.time(), horizon_s=600)

(`classify` the function is deliberately not re-exported here: it would shadow the
`tm_slurm.slurm.classify` module.)

Submodules are light (stdlib only); pyslurm is imported lazily and only by its backend.
"""
from .backend import JobInfo, NodeState, Reservation, SlurmBackend, SlurmError
from .choose import backend_for
from .classify import EventDebouncer, NodeEvent
from .hostlist import compress, expand

__all__ = ["backend_for", "SlurmBackend", "SlurmError", "NodeState",
           "Reservation", "JobInfo", "NodeEvent", "EventDebouncer", "expand",
           "compress"]
