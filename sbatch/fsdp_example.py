"""A stock FSDP2 loop under tm-slurm: `fully_shard` on the runtime's DeviceMesh.

    # FSDP: 2 shards, no replica (a lost shard comes back from the checkpoint)
    tm-slurm run --local 2+1 --config sbatch/example.yaml --dp 2 --dp-shard 2 --pp 1 -- python sbatch/fsdp_example.py
    # HSDP: 2 replicas x 2 shards, two ranks a node (a lost node's shards come from the other replica)
    tm-slurm run --local 2+1 --config sbatch/example.yaml --dp 4 --dp-shard 2 --ranks-per-node 2 --pp 1 -- python sbatch/fsdp_example.py

A drained node hands its shards to the joiner. The lines marked `# tm_slurm` are all that differ
from the same script under torchrun (where the mesh comes from init_device_mesh).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import tm_slurm                                                         # tm_slurm
from tm_slurm.data import SyntheticTokens

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--vocab", type=int, default=64)
p.add_argument("--dim", type=int, default=32)
p.add_argument("--seq", type=int, default=16)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step (a slower job)")
args = p.parse_args()
torch.set_num_threads(1)


class Net(nn.Module):
    """A small next-token model: embeddings, two residual MLP blocks, a head."""

    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                  nn.Linear(4 * d, d)) for _ in range(2))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(self.norm(h))


job = tm_slurm.init()                                                   # tm_slurm
mesh = job.mesh()      # tm_slurm: DeviceMesh.from_group(job.group("dp")), or (dp_rep, dp_shard) for HSDP
torch.manual_seed(0)
model = Net(args.vocab, args.dim).to(job.device)
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = job.optimizer(model, torch.optim.AdamW(model.parameters(), lr=args.lr))  # tm_slurm
data = SyntheticTokens(args.vocab, args.seq, args.batch, seed=1)

for step in job.steps(args.steps):                                      # tm_slurm
    x, y = data.batch(step, job.dp_rank)
    loss = F.cross_entropy(model(x.to(job.device)).flatten(0, 1), y.to(job.device).flatten())
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if args.sleep:
        time.sleep(args.sleep)
