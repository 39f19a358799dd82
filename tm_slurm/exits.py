"""Exit codes of the controller, agents and workers: what each process's status means to the
process (or Slurm) that reads it."""
from __future__ import annotations

import enum


class Exit(enum.IntEnum):
    OK = 0
    FAILED = 1             # the job failed, or the process crashed
    USAGE = 2              # bad command line or arguments; an agent that could not join
    GAVE_UP = 3            # a worker waited for the controller's word in vain (recovery, store)
    AGENT_GONE = 70        # a worker's agent disappeared
    FENCED = 71            # a worker's slot was given away: it must not come back
    REQUEUE = 75           # EX_TEMPFAIL: checkpointed (or the controller is gone); run me again
