"""``family = "llama"``: a native Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention).

The math and the parameter names inside each entry are those of Hugging Face's ``LlamaForCausalLM``
(``embed_tokens``; ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``input_layernorm``,
``post_attention_layernorm``; ``norm``, ``lm_head``), so ``potluck export`` writes a folder that
``AutoModelForCausalLM.from_pretrained`` loads as is (see :mod:`potluck.models.hub`).

Presets (``model.preset``) fix the body; the embedding and head add ``2 * vocab_size * d_model``
(untied). Parameters at the byte-level vocab (256):

=========== ======= ======== ======= ========== ====== ===========
preset      d_model n_layers n_heads n_kv_heads d_ff   parameters
=========== ======= ======== ======= ========== ====== ===========
llama-20m   384     12       6       2          1024   19.1M
llama-50m   512     16       8       4          1408   47.5M
llama-150m  768     24       12      4          2048   151.4M
llama-400m  1024    32       16      8          2816   378.1M
llama-1b    2048    16       32      8          8192   974.2M
llama-7b    4096    32       32      32         11008  6,476.8M
=========== ======= ======== ======= ========== ====== ===========
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from potluck.models.native import NativeSpec
from potluck.protos.config.runconfig import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(seq: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[seq, head_dim]`` of rotary position embeddings (Hugging Face's half-split layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    freqs = torch.arange(seq, device=device).float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.kv_heads
        self.head_dim, self.theta = cfg.d_model // cfg.n_heads, cfg.rope_theta
        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = rope(t, self.head_dim, self.theta, x.device)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if self.n_kv != self.n_heads:  # grouped-query attention: each k/v head serves n_heads / n_kv heads
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ff_width, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ff_width, bias=False)
        self.down_proj = nn.Linear(cfg.ff_width, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


class LlamaSpec(NativeSpec):
    family = "llama"
    init_std = 0.02
    residual: tuple[str, ...] = ("o_proj.weight", "down_proj.weight")

    embedding, block, head = Embedding, Block, Head

    def tie(self, embed: nn.Module, head: nn.Module) -> None:
        head.lm_head.weight = embed.embed_tokens.weight  # type: ignore[union-attr]
