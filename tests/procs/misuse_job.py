"""A stock DDP script that makes one of the porting mistakes the README lists (--misuse)."""
import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import tm_slurm

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--misuse", required=True,
               choices=["new-group", "default-group", "raw-step", "no-step", "init-twice"])
args = p.parse_args()

job = tm_slurm.init()
if args.misuse == "init-twice":
    torch.distributed.init_process_group("gloo")
if args.misuse == "new-group":
    torch.distributed.new_group([0, 1])
net = torch.nn.Linear(4, 1)
model = DDP(net) if args.misuse == "default-group" else DDP(net, process_group=job.group("dp"))
raw = torch.optim.SGD(model.parameters(), lr=0.1)
opt = job.optimizer(model, raw)
for step in job.steps(args.steps):
    model(torch.ones(2, 4)).sum().backward()
    if args.misuse == "raw-step":
        raw.step()
    elif args.misuse != "no-step":
        opt.step()
