"""``family = "tiny"``: the built-in GPT (learned positions, pre-norm LayerNorm blocks, GELU MLP).

Entry 0 embeds tokens plus learned positions, entries ``1..n_layers`` are pre-norm blocks (causal
self-attention, GELU MLP), the last is the final norm and the output head. With ``tie_embeddings``
the head reuses the embedding matrix (single-stage runs only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from potluck.models.native import NativeSpec
from potluck.protos.config.runconfig import ModelConfig


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions)[None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.ff_width)
        self.out = nn.Linear(cfg.ff_width, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln(x))


class TinySpec(NativeSpec):
    family = "tiny"
    init_std = 0.02
    residual: tuple[str, ...] = ("attn.proj.weight", "out.weight")

    embedding, block, head = Embedding, Block, Head

    def tie(self, embed: nn.Module, head: nn.Module) -> None:
        head.proj.weight = embed.tok.weight  # type: ignore[union-attr]
