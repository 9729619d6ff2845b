"""``family = "hf"``: Hugging Face ``transformers`` causal LMs, cut at decoder-layer boundaries.

Needs the optional extra (``pip install "potluck[hf]"``). ``model.hf_model`` is a model id on the Hub
or a local folder holding ``config.json`` (and, to start from pretrained weights, ``*.safetensors``).
The model's own modules do the math: entry 0 is its embedding, entries ``1..n`` wrap its decoder
layers (each computing its own rotary tables where the family has them), the last is its final
norm and ``lm_head``. Inside an entry, parameters keep the names they have in the model's own
checkpoint after a fixed prefix, so weights load per stage, lazily, from the model's safetensors
files, and ``potluck export`` writes them back under the same names.

Supported: the Llama family (``llama``, ``mistral``, ``qwen2``: RMSNorm, RoPE, SwiGLU, GQA) and
``gpt2``. Anything else is refused, naming its ``model_type``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from potluck.protos.config.hfconfig import hf_config, transformers_module
from potluck.protos.config.runconfig import ModelConfig
from potluck.protos.runtime.log import get_logger

log = get_logger(__name__)

LLAMA_LIKE = ("llama", "mistral", "qwen2")


def hf_name(model_type: str, n_layers: int, i: int, local: str, block_prefix: str = "layer.") -> str:
    """The name in the model's own checkpoint of parameter ``local`` of entry ``i``."""
    base = "transformer." if model_type == "gpt2" else "model."
    if i == 0:
        return base + local
    if i <= n_layers:
        layers = "transformer.h." if model_type == "gpt2" else "model.layers."
        return f"{layers}{i - 1}.{local.removeprefix(block_prefix)}"
    return local if local.startswith("lm_head.") else base + local


class LlamaEmbedding(nn.Module):
    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)


class LlamaBlock(nn.Module):
    """One decoder layer with its rotary tables (computed here: stages hold no model-wide module)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)[None]
        return self.layer(x, attention_mask=None, position_ids=positions,
                          position_embeddings=self.rotary(x, position_ids=positions))


class LlamaHead(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


class GPT2Embedding(nn.Module):
    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        return self.drop(self.wte(tokens) + self.wpe(positions))


class GPT2Block(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        return out[0] if isinstance(out, tuple) else out


class GPT2Head(nn.Module):
    def __init__(self, ln_f: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class HFSpec:
    family = "hf"

    def __init__(self, cfg: ModelConfig) -> None:
        assert cfg.hf_model
        tf = transformers_module()
        self.cfg, self.name, self.n_layers = cfg, cfg.hf_model, cfg.n_layers
        self.hf = hf_config(cfg.hf_model)
        self.model_type = self.hf.model_type
        if self.model_type == "gpt2" and cfg.seq_len > self.hf.n_positions:
            raise ValueError(f"model.seq_len = {cfg.seq_len} exceeds {self.name}'s {self.hf.n_positions} positions")
        with torch.device("meta"):  # the skeleton only: what each entry is made of, no memory
            self.skeleton = tf.AutoModelForCausalLM.from_config(self.hf)
        self.init_std = float(getattr(self.hf, "initializer_range", 0.02))
        # residual output projections, scaled at init (GPT-2's c_proj of attention and MLP)
        self.residual: tuple[str, ...] = (("attn.c_proj.weight", "mlp.c_proj.weight") if self.model_type == "gpt2"
                                          else ("o_proj.weight", "down_proj.weight"))

    def make_entry(self, i: int) -> nn.Module:
        sk, last = self.skeleton, i == self.n_layers + 1
        if self.model_type == "gpt2":
            t = sk.transformer
            if i == 0:
                return GPT2Embedding(copy.deepcopy(t.wte), copy.deepcopy(t.wpe), copy.deepcopy(t.drop))
            if last:
                return GPT2Head(copy.deepcopy(t.ln_f), nn.Linear(self.cfg.d_model, self.hf.vocab_size, bias=False))
            return GPT2Block(copy.deepcopy(t.h[i - 1]))
        m = sk.model
        if i == 0:
            return LlamaEmbedding(copy.deepcopy(m.embed_tokens))
        if last:
            return LlamaHead(copy.deepcopy(m.norm), nn.Linear(self.cfg.d_model, self.hf.vocab_size, bias=False))
        return LlamaBlock(copy.deepcopy(m.layers[i - 1]), copy.deepcopy(m.rotary_emb))

    def reset_buffers(self, entry: nn.Module, i: int) -> None:
        if isinstance(entry, LlamaBlock):  # rotary tables are non-persistent buffers: compute them for real
            entry.rotary = type(self.skeleton.model.rotary_emb)(config=self.hf)

    def names(self, i: int, entry: nn.Module) -> dict[str, str]:
        """Entry ``i``'s parameter names -> the names in the model's own checkpoint."""
        return {local: hf_name(self.model_type, self.n_layers, i, local) for local, _ in entry.named_parameters()}

    def load_pretrained(self, entries: dict[int, nn.Module]) -> bool:
        if not self.cfg.pretrained:
            return False
        files = weight_files(self.name)
        if not files:
            log.info("%s has no safetensors weights: starting from a seeded init", self.name)
            return False
        from safetensors import safe_open

        where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                where.update({k: f for k in st.keys()})
        tied = "transformer.wte.weight" if self.model_type == "gpt2" else "model.embed_tokens.weight"
        with torch.no_grad():
            for i, entry in entries.items():
                params = dict(entry.named_parameters())
                for local, name in self.names(i, entry).items():
                    if name not in where and name == "lm_head.weight" and tied in where:
                        name = tied  # a tied checkpoint stores the matrix once
                    if name not in where:
                        raise ValueError(f"{self.name}'s weights have no {name!r} (needed by layer {i})")
                    with safe_open(str(where[name]), framework="pt") as st:
                        t = st.get_tensor(name)
                    if tuple(t.shape) != tuple(params[local].shape):
                        raise ValueError(f"{self.name}: {name} has shape {list(t.shape)}, "
                                         f"the model needs {list(params[local].shape)}")
                    params[local].copy_(t)
        return True

    def tie(self, embed: nn.Module, head: nn.Module) -> None:
        source = embed.wte if self.model_type == "gpt2" else embed.embed_tokens  # type: ignore[union-attr]
        head.lm_head.weight = source.weight  # type: ignore[union-attr]


def weight_files(name: str) -> list[Path]:
    """The model's safetensors files: from its folder, or downloaded from the Hub (weights and configs only)."""
    folder = Path(name)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(name, allow_patterns=["*.safetensors", "*.json"]))
        except Exception as err:
            raise ValueError(f"cannot fetch the weights of {name!r}: {err}") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files and any(folder.glob("*.bin")):
        raise ValueError(f"{folder} holds only .bin weights; potluck reads safetensors (convert them with "
                         "transformers: model.save_pretrained(folder, safe_serialization=True))")
    return files
