"""`tm-slurm bench`: tm_slurm against the alternatives, measured side by side in one run."""
