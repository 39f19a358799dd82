"""Out-of-band control plane: MPI between controller and agents, a socketpair agent <-> worker."""
