"""A dense GPT block (nanoGPT-style, pre-LayerNorm): the reference the parallel versions are built from.

`TensorParallel*.from_dense` and `*3D.from_dense` slice these modules' weights, so a parallel
model starts from exactly the dense one and its results do not depend on the tensor-parallel size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the usual name
from torch import nn


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal self-attention of `heads` heads: q, k, v [b, s, heads·d] → [b, s, heads·d]."""
    b, s, hd = q.shape

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(b, s, heads, hd // heads).transpose(1, 2)  # [b, heads, s, d]

    y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)  # [b, heads, s, d]
    return y.transpose(1, 2).reshape(b, s, hd)


class SelfAttention(nn.Module):
    """qkv = x Wqkv (one [h, 3h] linear, columns q | k | v), causal attention, output projection."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h]
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # [b, s, h] each
        return self.proj(causal_attention(q, k, v, self.heads))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, ffn or 4 * hidden)
        self.proj = nn.Linear(ffn or 4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """x + attn(ln1(x)), then + mlp(ln2(·))."""

    def __init__(self, hidden: int, heads: int, ffn: int | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def randomize_(module: nn.Module, generator: torch.Generator | None = None) -> nn.Module:
    """Random values for every parameter, LayerNorm and biases included (tests must see them all move)."""
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, nn.LayerNorm):
                sub.weight.copy_(1 + 0.2 * torch.randn(sub.weight.shape, generator=generator))
                sub.bias.copy_(0.2 * torch.randn(sub.bias.shape, generator=generator))
            elif isinstance(sub, (nn.Linear, nn.Embedding)):
                fan_in = sub.weight.shape[1] if isinstance(sub, nn.Linear) else 1
                sub.weight.copy_(torch.randn(sub.weight.shape, generator=generator) / fan_in ** 0.5)
                if getattr(sub, "bias", None) is not None:
                    sub.bias.copy_(0.2 * torch.randn(sub.bias.shape, generator=generator))
    return module
