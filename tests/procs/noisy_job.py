"""A stock DDP loop with the divergence `tm-slurm rehearse` must catch (tests/procs/test_rehearse.py):
the noise added to each step's input comes from the script's own generator, seeded from the
clock, so no two runs (and no joiner) draw the same noise. The data itself is keyed by step."""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import tm_slurm

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()
torch.set_num_threads(1)

job = tm_slurm.init()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1).to(job.device), process_group=job.group("dp"))
opt = job.optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
noise = torch.Generator().manual_seed(time.time_ns())          # the mistake
for step in job.steps(args.steps):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 1000 + job.dp_rank))
    loss = F.mse_loss(model((x + 0.1 * torch.randn(x.shape, generator=noise)).to(job.device)),
                      x.sum(1, keepdim=True).to(job.device))
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(args.sleep)
