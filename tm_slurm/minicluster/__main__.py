"""`python -m tm_slurm.minicluster VERB ...`: the same verbs as `tm-slurm minicluster`."""
import sys

from .cli import main

sys.exit(main())
