"""A small GPT-style byte-level language model whose attention is a pluggable function.

Pre-norm blocks (RMSNorm), rotary positions, GELU MLP, tied input/output embeddings. With ``qk_norm``
q and k are RMS-normalized per head (learned gain, before RoPE) — the QK-norm that bounds attention logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(seq: int, dim: int, base: float = 10000.0):
    inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv)  # [seq, dim/2]
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    """x [B, H, N, D]: rotate channel pairs (i, i + D/2) by position-dependent angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, qk_norm: bool, attend):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.attend = attend
        self.max_logit = None  # set by forward when track_logits is on (a diagnostic, outside autograd)
        self.track_logits = False

    def forward(self, x, cos, sin, attn_dtype):
        B, N, _ = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        if self.track_logits:
            with torch.no_grad():
                s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(self.head_dim)
                self.max_logit = s.masked_fill(torch.ones(N, N, dtype=torch.bool, device=x.device).triu(1),
                                               -math.inf).amax().item()
        dt = x.dtype
        y = self.attend(q.to(attn_dtype), k.to(attn_dtype), v.to(attn_dtype), is_causal=True).to(dt)
        return self.proj(y.transpose(1, 2).reshape(B, N, -1))


class Block(nn.Module):
    def __init__(self, width, heads, qk_norm, attend):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(width), RMSNorm(width)
        self.attn = Attention(width, heads, qk_norm, attend)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.GELU(),
                                 nn.Linear(4 * width, width, bias=False))

    def forward(self, x, cos, sin, attn_dtype):
        x = x + self.attn(self.norm1(x), cos, sin, attn_dtype)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, *, layers: int, width: int, heads: int, seq: int, qk_norm: bool, attend,
                 vocab: int = 256, attn_dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, qk_norm, attend) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.attn_dtype = attn_dtype
        cos, sin = rope_tables(seq, width // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # GPT-2 style init; residual output projections scaled down with depth
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, targets=None):
        N = idx.shape[1]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, self.cos[:N], self.sin[:N], self.attn_dtype)
        logits = self.norm(x) @ self.embed.weight.t()
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def set_track_logits(self, on: bool) -> list:
        for b in self.blocks:
            b.attn.track_logits = on
        return [b.attn.max_logit for b in self.blocks]
