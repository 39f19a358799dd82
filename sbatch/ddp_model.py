"""The stock DDP example's model (ddp_example.py, and the same job as a torchft job: ddp_torchft.py)."""
import torch.nn as nn


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
