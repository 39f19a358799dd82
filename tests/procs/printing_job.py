"""A stock DDP loop that prints a marker line each step, on stdout and stderr (tests/procs/test_output.py)."""
import argparse
import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import tm_slurm

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=3)
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()

job = tm_slurm.init()
model = DDP(torch.nn.Linear(4, 1), process_group=job.group("dp"))
opt = job.optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
for step in job.steps(args.steps):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    where = f"rank={job.rank} step={step} sandbox={job.sandbox}"
    print(f"marker-out {where} omp={os.environ.get('OMP_NUM_THREADS')}")
    print(f"marker-err {where}", file=sys.stderr)
