"""The built-in decoder-only transformer, written as a flat list of layers so it can be cut into stages.

``layers[0]`` embeds tokens (plus learned positions), ``layers[1..n_layers]`` are pre-norm blocks
(causal self-attention, GELU MLP), and ``layers[-1]`` is the final norm and the output head. A
pipeline stage owns a contiguous slice of this list; parameter names (``layers.3.attn.qkv.weight``)
are the same whichever stage holds them, which is what makes checkpoints independent of the split.

With ``tie_embeddings`` the head reuses the embedding matrix; that only works when embedding and
head live in the same process (one stage).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from potluck.protos.config import ModelConfig


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


def num_layers(cfg: ModelConfig) -> int:
    """Entries of the layer list: embedding, the blocks, the head."""
    return cfg.n_layers + 2


def build_layers(cfg: ModelConfig, seed: int, start: int = 0, stop: int | None = None) -> nn.ModuleList:
    """Layers ``[start, stop)`` of the model, initialised exactly as the full model would be.

    The whole model is always initialised from ``seed`` in the same order on CPU, then sliced, so
    every peer holding a given layer starts with bit-identical weights, however the model is split.
    """
    total = num_layers(cfg)
    stop = total if stop is None else stop
    if not 0 <= start < stop <= total:
        raise ValueError(f"layer slice [{start}, {stop}) is outside the model's {total} layers")
    gen = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = [Embedding(cfg)] + [Block(cfg) for _ in range(cfg.n_layers)] + [Head(cfg)]
    for layer in layers:
        _init(layer, gen)
        if isinstance(layer, Block):
            # GPT-2: residual projections scaled by 1/sqrt(2 * n_layers)
            std = 0.02 / math.sqrt(2 * cfg.n_layers)
            for p in (layer.attn.proj.weight, layer.out.weight):
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
    if cfg.tie_embeddings:
        if start != 0 or stop != total:
            raise ValueError("tie_embeddings needs embedding and head in one stage; set model.tie_embeddings = false")
        layers[-1].proj.weight = layers[0].tok.weight  # type: ignore[union-attr]
    return nn.ModuleList(layers[start:stop])


def _init(module: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * 0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.LayerNorm):
                m.weight.fill_(1.0)
                m.bias.zero_()


class TinyGPT(nn.Module):
    """The whole model as one module (one stage). ``forward`` returns logits."""

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = build_layers(cfg, seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return forward_layers(self.layers, tokens)


def forward_layers(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """Run ``x`` through ``layers`` in order: the whole model, or one pipeline stage of it."""
    for layer in layers:
        x = layer(x)
    return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
