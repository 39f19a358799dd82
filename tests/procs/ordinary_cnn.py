"""A training script in the ordinary style, ported by the README alone (not one of the bundled
examples): a BatchNorm CNN with dropout, a DataLoader over a map-style dataset whose
__getitem__ augments with Python `random`, numpy and torch, AdamW with OneCycleLR, gradient
clipping, two micro-batches a step with DDP's no_sync, a logging all-reduce, and its own
torch.save after the loop.

    tm-slurm run --local 2+2 --dp 2 --pp 1 -- python tests/procs/ordinary_cnn.py --out DIR

`--mistake` reproduces a porting mistake (tests/procs/test_ordinary.py): each must fail at once
with a clear error, and `--raise-at N` is the script's own bug at step N.
"""
import argparse
import contextlib
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import tm_slurm

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--workers", type=int, default=0)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--out", required=True)
p.add_argument("--mistake", choices=["sched-step", "distributed-sampler", "shuffle"])
p.add_argument("--raise-at", type=int)
args = p.parse_args()


class Shapes(Dataset):
    """Noisy 12x12 images of one of 4 classes (a bar's orientation), augmented on read."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(1234)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.base = torch.rand(n, 1, 12, 12, generator=g) * 0.3

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.base[i].clone()
        c = int(self.y[i])
        x[0, 3 + c, :] += 1.0                                      # the class's bar
        if random.random() < 0.5:                                  # Python random: a flip
            x = x.flip(-1)
        x = x + torch.from_numpy(np.random.normal(0, 0.05, x.shape).astype(np.float32))   # numpy noise
        x = x * (0.9 + 0.2 * torch.rand(()))                       # torch: brightness
        return x, self.y[i]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(16 * 3 * 3, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.head(self.drop(x.flatten(1)))


job = tm_slurm.init()
torch.manual_seed(0)
model = DDP(Net(), process_group=job.group("dp"))
raw = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
sched = torch.optim.lr_scheduler.OneCycleLR(raw, max_lr=1e-2, total_steps=args.steps)
opt = job.optimizer(model, raw, sched)

MICRO = 2
ds = Shapes(2048)
if args.mistake == "distributed-sampler":
    sampler = DistributedSampler(ds, num_replicas=job.dp_size, rank=job.dp_rank)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler)
elif args.mistake == "shuffle":
    loader = DataLoader(ds, batch_size=args.batch, shuffle=True)
else:
    loader = DataLoader(ds, batch_size=args.batch, num_workers=args.workers,
                        persistent_workers=args.workers > 0,
                        sampler=job.sampler(ds, args.batch, micro_batches=MICRO))

for step in job.steps(args.steps):
    model.train()
    for i, (x, y) in enumerate(loader):
        sync = contextlib.nullcontext() if i == MICRO - 1 else model.no_sync()
        with sync:
            loss = F.cross_entropy(model(x), y) / MICRO
            loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if args.mistake == "sched-step":
        sched.step()
    if args.raise_at is not None and step == args.raise_at:
        raise ValueError(f"the script's own bug at step {step}")
    logged = loss.detach().clone()
    dist.all_reduce(logged, group=job.group("dp"))                  # a logging collective
    if job.is_main and step % 10 == 0:
        print(f"step {step} loss {logged.item() / job.dp_size:.4f}", flush=True)
    if args.sleep:
        time.sleep(args.sleep)

# after the loop, as any script: save the model once
if job.is_main:
    os.makedirs(args.out, exist_ok=True)
    torch.save(model.module.state_dict(), os.path.join(args.out, "final.pt"))
    print("saved", os.path.join(args.out, "final.pt"), flush=True)
