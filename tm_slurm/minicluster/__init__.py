"""`tm-slurm minicluster`: a real multi-node Slurm cluster on one machine, for tests
and demos (see README.md in this directory)."""
from .cluster import MODES, MiniCluster, MiniClusterError

__all__ = ["MODES", "MiniCluster", "MiniClusterError"]
