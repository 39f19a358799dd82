"""Starting and killing agents: locally (process groups) or under Slurm (one srun step each)."""
