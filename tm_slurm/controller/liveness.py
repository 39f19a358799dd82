"""Who is cut off when heartbeats stop: a node, or the controller itself.

Every agent and the controller decide alone, from what each can see, and the rule makes them
agree without talking:
- an agent that hears nothing from the controller for `controller_timeout_s` looks at
  status.json (agent.controller_alive): still touched, so the controller lives and this node
  is the one cut off; it ends its workers (FENCED) and leaves the job alone;
- the controller that stops hearing from most of its agents at once is the one cut off (its
  batch host lost the network): it stops touching status.json and ends, so the agents see it
  gone and run the lost-controller protocol (checkpoint of the last committed step, the lowest
  survivor requeues the job). A minority going silent is a node failure, recovered as usual.
heartbeat_timeout_s < controller_timeout_s (config.Timeouts) puts the controller's verdict
first, so its status.json is already still when the agents look.
"""
from __future__ import annotations


def controller_cut_off(silence_s: dict[str, float], timeout_s: float) -> list[str]:
    """The agents the controller has lost, if it is the one cut off, else [].

    `silence_s`: seconds since each live agent's last heartbeat. Once any agent is past the
    timeout, agents past half of it count too (a cut loses them all within a heartbeat or two
    of one another); more than half of them lost means the controller, not they, is cut off."""
    if not any(s > timeout_s for s in silence_s.values()):
        return []
    lost = sorted(n for n, s in silence_s.items() if s > timeout_s / 2)
    return lost if 2 * len(lost) > len(silence_s) and len(silence_s) >= 2 else []
