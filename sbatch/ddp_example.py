"""A stock DistributedDataParallel loop under tm-slurm: the README's porting example, runnable.

    tm-slurm run --local 2+1 --config sbatch/example.yaml --dp 2 --pp 1 -- python sbatch/ddp_example.py

The lines marked `# tm_slurm` are all that differ from the same script under torchrun with
init_process_group (README "Porting a stock DDP loop").
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import tm_slurm                                                         # tm_slurm
from tm_slurm.data import SyntheticTokens

from ddp_model import Net, options

args = options().parse_args()
torch.set_num_threads(1)

job = tm_slurm.init()                                                   # tm_slurm
torch.manual_seed(0)
model = DDP(Net(args.vocab, args.dim).to(job.device), process_group=job.group("dp"))  # tm_slurm
raw = torch.optim.AdamW(model.parameters(), lr=args.lr)
sched = torch.optim.lr_scheduler.LambdaLR(raw, lambda s: min(1.0, (s + 1) / 10))
opt = job.optimizer(model, raw, sched)                                  # tm_slurm
data = SyntheticTokens(args.vocab, args.seq, args.batch, seed=1)

for step in job.steps(args.steps):                                      # tm_slurm
    x, y = data.batch(step, job.dp_rank)
    loss = F.cross_entropy(model(x.to(job.device)).flatten(0, 1), y.to(job.device).flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    if args.sleep:
        time.sleep(args.sleep)
