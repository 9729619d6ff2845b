"""Hugging Face folders: a trained run written as ``config.json`` + ``model.safetensors``, and read back.

:func:`write_folder` turns potluck's parameter names (``layers.<entry>.<name>``) into the model's
own (``model.layers.<i>.self_attn.q_proj.weight``, ``transformer.h.<i>.attn.c_attn.weight``...),
so ``AutoModelForCausalLM.from_pretrained(folder)`` loads a ``llama`` or ``hf`` run without potluck.
Beside them, ``potluck.json`` records the run's model config, version and data source, which is how
:func:`read_folder` (and ``potluck generate``) rebuilds the model and its tokenizer.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from potluck.models import entries, spec_for
from potluck.models.hf import hf_name
from potluck.protos.config.runconfig import ModelConfig

WEIGHTS, CONFIG, POTLUCK = "model.safetensors", "config.json", "potluck.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json")


def _model_type(cfg: ModelConfig) -> tuple[str, str]:
    """(model_type, block prefix inside an entry) of ``cfg``'s parameter names."""
    if cfg.family == "llama":
        return "llama", ""
    if cfg.family == "hf":
        return spec_for(cfg).model_type, "layer."  # type: ignore[attr-defined]
    raise ValueError("the built-in model (family 'tiny') has no Hugging Face format: export it to a .pt or "
                     ".safetensors file, or train a family = 'llama' model")


def to_hf_name(cfg: ModelConfig, name: str) -> str:
    """``layers.<entry>.<local>`` -> the parameter's name in a Hugging Face checkpoint."""
    model_type, prefix = _model_type(cfg)
    head, entry, local = name.split(".", 2)
    if head != "layers":
        raise ValueError(f"parameter {name!r} does not name its layer")
    return hf_name(model_type, cfg.n_layers, int(entry), local, prefix)


def from_hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Hugging Face name -> potluck name, for every parameter of the model (read off the meta skeleton)."""
    spec, out = spec_for(cfg), {}
    with torch.device("meta"):
        for i in range(entries(cfg)):
            for local, _ in spec.make_entry(i).named_parameters():
                out[to_hf_name(cfg, f"layers.{i}.{local}")] = f"layers.{i}.{local}"
    return out


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """``config.json`` of the exported model."""
    if cfg.family == "hf":
        from potluck.models.hf import hf_config as source

        out = source(cfg.hf_model).to_dict()
        out.pop("_attn_implementation", None)
        out["tie_word_embeddings"] = cfg.tie_embeddings
        out["architectures"] = [type(spec_for(cfg).skeleton).__name__]  # type: ignore[attr-defined]
        return out
    _model_type(cfg)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ff_width, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.d_model // cfg.n_heads, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.seq_len, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02, "dtype": "float32", "bos_token_id": None, "eos_token_id": None,
    }


def write_folder(out: Path, cfg: ModelConfig, named: Iterable[tuple[str, torch.Tensor]], info: dict[str, Any],
                 tokenizer: Path | None = None) -> int:
    """Write the model (``named``: potluck names and tensors) as a Hugging Face folder; returns the
    parameter count. Tied runs store the embedding once, as ``from_pretrained`` expects. The tokenizer
    files of an ``hf`` model's folder, or of ``tokenizer`` (the run's shards'), are copied beside it."""
    from safetensors.torch import save_file

    tensors = {to_hf_name(cfg, n): t.contiguous() for n, t in named}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(hf_config(cfg), indent=1) + "\n")
    model = cfg.model_dump(mode="json")
    if cfg.family == "hf":  # read back from this folder's own config.json, wherever the run's model came from
        model.update(hf_model=".", pretrained=False)
    (out / POTLUCK).write_text(json.dumps({**info, "model": model}, indent=1) + "\n")
    source = tokenizer or (Path(cfg.hf_model or "") if cfg.family == "hf" else None)
    if source is not None and source.is_dir():
        for name in TOKENIZER_FILES:
            if (source / name).exists() and name != CONFIG:
                shutil.copy(source / name, out / name)
    return int(sum(t.numel() for t in tensors.values()))


def read_folder(folder: Path) -> tuple[ModelConfig, dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:
    """(model config, run info, potluck-named tensors) of a folder :func:`write_folder` wrote."""
    from safetensors import safe_open

    meta = folder / POTLUCK
    if not meta.exists():
        raise ValueError(f"{folder} has no {POTLUCK}: not written by potluck export")
    info = json.loads(meta.read_text())
    model = dict(info["model"])
    if model.get("family") == "hf":
        model["hf_model"] = str(folder)
    cfg = ModelConfig.model_validate(model)
    names = from_hf_names(cfg)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        with safe_open(str(folder / WEIGHTS), framework="pt") as f:
            for key in f.keys():
                if key not in names:
                    raise ValueError(f"{folder / WEIGHTS} holds {key!r}, which the model does not have")
                yield names[key], f.get_tensor(key)

    return cfg, info, tensors()
