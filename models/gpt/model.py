"""A small GPT (nanoGPT-style) built to be cut into pipeline stages: embedding, blocks, head.

Shapes in comments: B batch (micro-batch), T sequence, C embedding, H heads, V vocabulary.
Used by `pipedsl train` and examples/nanogpt.py; `GPT.tp_stages` slices it into tensor-parallel
stages (models/gpt/parallelize.py, examples/parallel_3d.py), and its `Block` is the dense reference every
tensor-parallel block is built from (parallel/tp1d.py's `ParallelBlock`, parallel/tp3d.py's `Block3D`:
they read ln1, attn.qkv/proj/n_head, ln2, mlp.fc/proj).  The head does not tie its weight to the
token embedding (examples/hf_llama.py trains a tied model: see runtime/ties.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 - the usual name
from torch import nn

from pipedsl.models.gpt.moe import Experts, MoE, Router
from pipedsl.models.split import split_gpt


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64  # longest sequence
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    # Mixture-of-Experts (models/gpt/moe.py): n_experts > 0 puts a router and experts in every block's MLP
    n_experts: int = 0
    top_k: int = 2
    expert_ffn: int = 0  # each expert's hidden size (0: 4 n_embd, the dense MLP's)
    capacity_factor: float | None = None  # None: dropless
    aux_loss_coef: float = 0.01  # the router's load-balancing loss (Mixtral's default)
    z_loss_coef: float = 0.0

    @property
    def moe(self) -> bool:
        return self.n_experts > 0


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx [B, T] int64
        pos = torch.arange(idx.shape[1], device=idx.device)  # [T]
        return self.drop(self.wte(idx) + self.wpe(pos))  # [B, T, C]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, C]
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # each [B, T, C]
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # [B, H, T, C/H]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)  # [B, H, T, C/H]
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # [B, T, C]


class MLP(nn.Sequential):
    """fc [C, 4C], GELU, proj [4C, C], dropout; a Sequential, so checkpoints name its weights mlp.0 and mlp.2."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd),
                         nn.Dropout(cfg.dropout))

    @property
    def fc(self) -> nn.Linear:
        return self[0]

    @property
    def proj(self) -> nn.Linear:
        return self[2]


class Block(nn.Module):
    """Attention and an MLP, or with `cfg.moe` a mixture of experts: then it takes x and the routers' loss sum so
    far (none in the first block) and returns both (models/gpt/moe.py)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp: nn.Module = (MoE(cfg.n_embd, cfg.n_experts, cfg.top_k, cfg.expert_ffn or 4 * cfg.n_embd,
                                   cfg.capacity_factor, cfg.aux_loss_coef, cfg.z_loss_coef)
                               if cfg.moe else MLP(cfg))

    def forward(self, x: torch.Tensor, loss_sum: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # x [B, T, C]
        if not isinstance(self.mlp, MoE):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))  # [B, T, C]
        if loss_sum is None:
            loss_sum = torch.zeros((), device=x.device)
        x = x + self.attn(self.ln1(x))
        y, loss_sum = self.mlp(self.ln2(x), loss_sum)
        return x + y, loss_sum


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, loss_sum: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # x [B, T, C]
        logits = self.lm_head(self.ln_f(x))  # [B, T, V]
        return logits if loss_sum is None else (logits, loss_sum)  # an MoE model's: the routers' loss sum too


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = Head(cfg)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight") or name.endswith("experts.proj"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.Embedding, Router, Experts)):
            for p in m.parameters(recurse=False):
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """idx [B, T] → logits [B, T, V]; with experts (logits, the routers' loss sum), which `gpt_loss` adds."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(*x) if isinstance(x, tuple) else block(x)
        return self.head(*x) if isinstance(x, tuple) else self.head(x)

    def stages(self, num_stages: int, by: str = "count", points: Sequence[int] | None = None) -> list[nn.Sequential]:
        """This model as `num_stages` pipeline stages (sharing its modules); `points`: where stages 1 … n−1 begin
        among the units [embedding, blocks…, head]."""
        return split_gpt(self.embed, list(self.blocks), self.head, num_stages, by=by, points=points)

    def tp_stages(self, num_stages: int, mesh, by: str = "count", sequence_parallel: bool = False,
                  points: Sequence[int] | None = None) -> list[nn.Sequential]:
        """This model as `num_stages` tensor-parallel stages for this rank of a `ParallelMesh` (1-D or 3-D).

        The weights are slices of this dense model, so it is the one-process reference; pair the
        stages with `pipedsl.models.gpt.parallelize.tp_gpt_loss(mesh)` (see that module).  With
        `sequence_parallel` (1-D) the stages exchange sequence shards [mb, T/t, C].  An MoE model's experts
        stay whole on every tp rank, which runs them on its share of the tokens (1-D, dropless).
        """
        from pipedsl.models.gpt.parallelize import tp_gpt_stages

        return tp_gpt_stages(self, num_stages, mesh, by=by, sequence_parallel=sequence_parallel, points=points)


def randomize_(module: nn.Module, generator: torch.Generator | None = None) -> nn.Module:
    """Random values for every parameter, LayerNorm and biases included (checks must see them all move)."""
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
            elif isinstance(sub, (Router, Experts)):
                for p in sub.parameters(recurse=False):  # [.., in]: fan-in last
                    p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
    return module


def gpt_loss(logits: torch.Tensor | tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: logits [B, T, V], targets [B, T]; an MoE model's (logits, routers' loss sum) adds
    the sum (models/gpt/moe.py)."""
    if isinstance(logits, tuple):
        logits, router_loss = logits
        return gpt_loss(logits, targets) + router_loss
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(batch: int, seq: int, vocab: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences with a learnable rule (each next token = a·token + b mod V, per sequence)."""
    start = torch.randint(vocab, (batch, 1), generator=generator)
    a = torch.randint(1, 4, (batch, 1), generator=generator)
    b = torch.randint(vocab, (batch, 1), generator=generator)
    toks = [start]
    for _ in range(seq):
        toks.append((toks[-1] * a + b) % vocab)
    seqs = torch.cat(toks, dim=1)  # [B, T+1]
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()  # inputs, targets [B, T]
