"""Hugging Face model configs, read for ``model.family = "hf"`` runs (needs ``potluck[hf]``).

The run config takes a Hugging Face model's sizes from its ``config.json`` (:func:`describe`); the
model code (:mod:`potluck.models.hf`) builds its stages from the same config (:func:`hf_config`).
"""

from __future__ import annotations

import functools
from typing import Any

SUPPORTED = ("llama", "mistral", "qwen2", "gpt2")


def transformers_module() -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError('model.family = "hf" needs Hugging Face transformers: pip install "potluck[hf]"') from None
    return transformers


@functools.lru_cache(maxsize=8)
def hf_config(name: str) -> Any:
    """The model's ``transformers`` config (read from its folder, or fetched from the Hub), with SDPA
    attention (causal without a mask tensor)."""
    tf = transformers_module()
    try:
        cfg = tf.AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read the config of {name!r}: {err}") from None
    if cfg.model_type not in SUPPORTED:
        raise ValueError(f"{name!r} is a {cfg.model_type!r} model; supported model types: {', '.join(SUPPORTED)}")
    cfg._attn_implementation = "sdpa"
    return cfg


def describe(name: str) -> dict[str, Any]:
    """The sizes ``model.*`` takes from the Hugging Face config of ``name``."""
    c = hf_config(name)
    if c.model_type == "gpt2":
        return {"vocab_size": c.vocab_size, "d_model": c.n_embd, "n_layers": c.n_layer, "n_heads": c.n_head,
                "n_kv_heads": c.n_head, "d_ff": c.n_inner or 4 * c.n_embd, "tie_embeddings": bool(c.tie_word_embeddings)}
    return {"vocab_size": c.vocab_size, "d_model": c.hidden_size, "n_layers": c.num_hidden_layers,
            "n_heads": c.num_attention_heads, "n_kv_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            "d_ff": c.intermediate_size, "tie_embeddings": bool(getattr(c, "tie_word_embeddings", False))}
