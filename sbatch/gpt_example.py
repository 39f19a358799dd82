"""Example training job: a small GPT on generated tokens, DP x PP, run under tm-slurm.

    tm-slurm run --local 4+1 --config sbatch/example.yaml -- python sbatch/gpt_example.py
    sbatch sbatch/train.sbatch                  # the same on a Slurm cluster

Each pipeline stage holds a slice of the blocks (the first adds the embeddings, the last the
head); a step runs GPipe-style over a few micro-batches and averages gradients over DP.
Everything the runtime needs is in `build` (the rank's model and optimizer) and `step` (one
training step, no optimizer.step(): the runtime applies it after the commit vote).
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import tm_slurm
from tm_slurm.data import SyntheticTokens

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=int(os.environ.get("GPT_STEPS", 60)))
p.add_argument("--vocab", type=int, default=512)
p.add_argument("--dim", type=int, default=128)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--seq", type=int, default=64)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--micro", type=int, default=2, help="micro-batches per step (pipeline)")
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--compile", action="store_true", help="torch.compile each stage")
p.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step (a slower job)")
p.add_argument("--slow-node", default="", help="make this node a straggler: --slow-s more a step")
p.add_argument("--slow-s", type=float, default=0.1)
args = p.parse_args()
torch.set_num_threads(1)   # 2-core machine, 5 processes; also keeps numerics identical across runs


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Stage(nn.Module):
    """Blocks [lo, hi) of the model; embeddings on the first stage, head on the last."""

    def __init__(self, pp_rank: int, pp_size: int):
        super().__init__()
        per = math.ceil(args.layers / pp_size)
        self.first, self.last = pp_rank == 0, pp_rank == pp_size - 1
        if self.first:
            self.tok = nn.Embedding(args.vocab, args.dim)
            self.pos = nn.Embedding(args.seq, args.dim)
        self.blocks = nn.ModuleList(Block(args.dim, args.heads)
                                    for _ in range(pp_rank * per, min(args.layers, (pp_rank + 1) * per)))
        if self.last:
            self.ln = nn.LayerNorm(args.dim)
            self.head = nn.Linear(args.dim, args.vocab, bias=False)

    def forward(self, x):
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x)) if self.last else x


data = SyntheticTokens(args.vocab, args.seq, args.batch, seed=1234)


def build(ctx: tm_slurm.Context) -> tm_slurm.TrainState:
    torch.manual_seed(1000 + ctx.pp_rank)      # same init on every DP replica of a stage
    model = Stage(ctx.pp_rank, ctx.pp_size)
    if args.compile:
        model.compile()                         # in place: state_dict names stay the same
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    return tm_slurm.TrainState(model, opt)


def step(ctx: tm_slurm.Context, st: tm_slurm.TrainState, i: int):
    tokens, targets = data.batch(i, ctx.dp_rank)
    mb = args.batch // args.micro
    ins, outs, losses = [], [], []
    for m in range(args.micro):
        if ctx.is_first_stage:
            x = tokens[m * mb:(m + 1) * mb]
        else:
            x = ctx.pp.recv_prev(torch.empty(mb, args.seq, args.dim)).requires_grad_()
        y = st.model(x)
        if ctx.is_last_stage:
            tgt = targets[m * mb:(m + 1) * mb]
            losses.append(F.cross_entropy(y.flatten(0, 1), tgt.flatten()) / args.micro)
        else:
            ctx.pp.send_next(y.detach())
        ins.append(x)
        outs.append(y)
    for m in range(args.micro):
        if ctx.is_last_stage:
            losses[m].backward()
        else:
            outs[m].backward(ctx.pp.recv_next(torch.empty_like(outs[m])))
        if not ctx.is_first_stage:
            ctx.pp.send_prev(ins[m].grad)
    ctx.dp.all_reduce_grads(st.model)
    if args.sleep:
        time.sleep(args.sleep)
    if args.slow_node and os.environ.get("TM_SLURM_NODE") == args.slow_node:
        time.sleep(args.slow_s)           # a sick node: thermal throttling, a noisy neighbour
    return sum(l.item() for l in losses) if losses else None


if __name__ == "__main__":
    tm_slurm.run(build, step, steps=args.steps)
