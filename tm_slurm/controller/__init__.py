"""The controller (`tm-slurm run`): one per job, owns the truth about nodes, ranks and generations."""
