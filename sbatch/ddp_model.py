"""The stock DDP example's model and options (ddp_example.py, and the same job as a torchft job:
ddp_torchft.py)."""
import argparse

import torch.nn as nn


def options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step (a slower job)")
    return p


class Net(nn.Module):
    """A small next-token model: embeddings, two residual MLP blocks, a tied head."""

    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                  nn.Linear(4 * d, d)) for _ in range(2))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.norm(h) @ self.emb.weight.t()
