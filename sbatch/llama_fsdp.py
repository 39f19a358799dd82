"""A small Llama-style decoder trained with FSDP2 HSDP under tm-slurm (sbatch/llama_fsdp.sbatch).

    # 2 replicas x 2 shards, two ranks a node, one standby node
    tm-slurm run --local 2+1 --config sbatch/example.yaml --dp 4 --dp-shard 2 --ranks-per-node 2 \\
        --pp 1 -- python sbatch/llama_fsdp.py
    tm-slurm demo --example llama          # the same with a drain and a node kill, checked bit for bit
    # HSDP x TP: 2 replicas x 2 shards x TP 2, four ranks a node
    tm-slurm run --local 2+1 --config sbatch/example.yaml --dp 4 --dp-shard 2 --tp 2 --ranks-per-node 4 \
        --pp 1 -- python sbatch/llama_fsdp.py

RMSNorm, rotary position embeddings, SwiGLU feed-forward, causal attention and tied
input/output embeddings; each block is its own FSDP2 unit (and, with --compile, compiled on its
own), the root holds the embeddings. With --tp 2 (layout.tp) each block is also tensor parallel
inside a node (Megatron-style, `parallelize_module` on the runtime's tp group). The loop is a stock one: the lines marked `# tm_slurm` are
what differs from the same script under torchrun.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import tm_slurm                                                         # tm_slurm
from tm_slurm.data import SyntheticTokens

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=400)
p.add_argument("--vocab", type=int, default=128)
p.add_argument("--dim", type=int, default=64)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--seq", type=int, default=32)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--compile", action="store_true", help="torch.compile each block")
p.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step (a slower job)")
args = p.parse_args()
torch.set_num_threads(1)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(seq: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = torch.outer(torch.arange(seq).float(), inv)
    return ang.cos(), ang.sin()


def rope(x, cos, sin):
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.h, self.hd = heads, d // heads
        self.attn_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        hidden = int(8 * d / 3 / 16 + 1) * 16
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        h = self.attn_norm(x)
        # -1 heads: with tensor parallel a rank holds h / tp of them (its column shard)
        q, k, v = (w(h).view(b, s, -1, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = RMSNorm(d)
        cos, sin = rotary(seq, d // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        nn.init.normal_(self.emb.weight, std=1 / math.sqrt(d))

    def forward(self, tokens):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        return self.norm(x) @ self.emb.weight.t()          # tied output embedding


# Megatron-style tensor parallel inside a block: q, k, v and the SwiGLU's w1, w3 split by columns
# (heads), wo and w2 by rows; norms and the tied embeddings stay replicated over TP
TP_PLAN = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
           "wo": RowwiseParallel(), "w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}

def clip_grad_norm(params, max_norm: float) -> None:
    """clip_grad_norm_ over parameters on different meshes (with TP: the blocks' on dp x tp, the
    norms' and embeddings' on dp only), which torch's cannot stack: one norm per mesh, combined."""
    params = [p for p in params if p.grad is not None]
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(getattr(p, "device_mesh", None), []).append(p.grad)
    norms = [torch.nn.utils.get_total_norm(g) for g in by_mesh.values()]
    total = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm()
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1:
        for p in params:
            p.grad.mul_(coef)


job = tm_slurm.init()                                                   # tm_slurm
mesh = job.mesh()       # tm_slurm: dims (dp_rep, dp_shard) for HSDP, then tp with --tp
torch.manual_seed(0)
model = Llama(args.vocab, args.dim, args.layers, args.heads, args.seq).to(job.device)
for blk in model.blocks:
    if job.tp_size > 1:
        parallelize_module(blk, mesh["tp"], TP_PLAN)
    if args.compile:
        blk.compile()
    fully_shard(blk, mesh=mesh[job.dp_dims])
fully_shard(model, mesh=mesh[job.dp_dims])  # the root: embeddings (tied) and the final norm
opt = job.optimizer(model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1))  # tm_slurm
data = SyntheticTokens(args.vocab, args.seq, args.batch, seed=1)

for step in job.steps(args.steps):                                      # tm_slurm
    x, y = data.batch(step, job.dp_rank)
    loss = F.cross_entropy(model(x.to(job.device)).flatten(0, 1), y.to(job.device).flatten())
    opt.zero_grad()
    loss.backward()
    clip_grad_norm(model.parameters(), 1.0)
    opt.step()
    if args.sleep:
        time.sleep(args.sleep)
