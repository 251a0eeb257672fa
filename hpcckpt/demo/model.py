"""A small but real transformer language model and deterministic synthetic data.

Pure torch, nothing downloaded. The data is a seeded order-2 Markov chain over the
vocabulary, so the loss really falls as the model learns its transitions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab: int = 128
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 64
    dropout: float = 0.1


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = nn.MultiheadAttention(cfg.d_model, cfg.n_heads, dropout=cfg.dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * 0.02)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied weights: saving must keep them one tensor
        self.mask: torch.Tensor
        self.register_buffer("mask", torch.triu(torch.full((cfg.seq_len, cfg.seq_len), -math.inf), 1),
                             persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos[:t])
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


class MarkovTokens(Dataset[torch.Tensor]):
    """``n`` sequences of ``seq_len + 1`` tokens from a seeded order-2 Markov chain."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        # each (a, b) context prefers a few successors: learnable structure
        logits = torch.randn(vocab, vocab, vocab, generator=g) * 3.0
        probs = torch.softmax(logits, dim=-1)
        seqs = torch.empty(n, seq_len + 1, dtype=torch.long)
        seqs[:, :2] = torch.randint(vocab, (n, 2), generator=g)
        for i in range(2, seq_len + 1):
            p = probs[seqs[:, i - 2], seqs[:, i - 1]]
            seqs[:, i] = torch.multinomial(p, 1, generator=g).squeeze(1)
        self.data = seqs

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def param_digest(model: nn.Module) -> str:
    import hashlib
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
    return h.hexdigest()
