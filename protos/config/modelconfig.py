"""``[model]`` of a run file: the family (built-in GPT, native Llama-style, Hugging Face), its sizes or
a preset, and what a Hugging Face model's own config decides (:mod:`potluck.protos.config.hfconfig`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from potluck.protos.config.section import Section

LLAMA_PRESETS: dict[str, dict[str, int]] = {  # body sizes; see potluck.models.llama for parameter counts
    "llama-20m": {"d_model": 384, "n_layers": 12, "n_heads": 6, "n_kv_heads": 2, "d_ff": 1024},
    "llama-50m": {"d_model": 512, "n_layers": 16, "n_heads": 8, "n_kv_heads": 4, "d_ff": 1408},
    "llama-150m": {"d_model": 768, "n_layers": 24, "n_heads": 12, "n_kv_heads": 4, "d_ff": 2048},
    "llama-400m": {"d_model": 1024, "n_layers": 32, "n_heads": 16, "n_kv_heads": 8, "d_ff": 2816},
    "llama-1b": {"d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "d_ff": 8192},
    "llama-7b": {"d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32, "d_ff": 11008},  # Llama 2 7B's body
}
HF_DECIDES = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "tie_embeddings")


class ModelConfig(Section):
    """The model: the built-in GPT ('tiny'), a native Llama-style decoder ('llama', sizes or a preset),
    or a Hugging Face causal LM ('hf', from a model id or folder, which decides the sizes)."""

    family: Literal["tiny", "llama", "hf"] = Field(
        "tiny", description="'tiny' (built-in GPT), 'llama' (native Llama-style) or 'hf' (transformers, needs potluck[hf])"
    )
    preset: str | None = Field(
        None, description=f"named Llama-style size ({', '.join(LLAMA_PRESETS)}); sets family = 'llama' and the sizes "
        "this file leaves out"
    )
    hf_model: str | None = Field(
        None, description="family 'hf': a Hugging Face model id or a local folder with config.json (and weights)"
    )
    pretrained: bool = Field(
        True, description="family 'hf': start from the model's own weights when it has them (else a seeded init)"
    )
    vocab_size: int = Field(
        64, ge=2, le=1 << 20, description="tokens; byte-level data (data.source='bytes') needs 256 and sets it when unset"
    )
    d_model: int = Field(64, ge=8, description="residual width")
    n_layers: int = Field(2, ge=0, description="transformer blocks (0: an embedding and a head, a bigram model)")
    n_heads: int = Field(4, ge=1, description="attention heads; must divide d_model")
    n_kv_heads: int = Field(0, ge=0, description="llama: key/value heads (grouped-query attention); 0 means n_heads")
    d_ff: int = Field(0, ge=0, description="MLP hidden width; 0 means 4 * d_model (tiny) or 8/3 * d_model (llama)")
    seq_len: int = Field(64, ge=2, description="tokens per training sample")
    rope_theta: float = Field(10000.0, gt=0, description="llama: RoPE base")
    norm_eps: float = Field(1e-5, gt=0, description="llama: RMSNorm epsilon")
    tie_embeddings: bool = Field(
        False, description="share the input embedding with the output head (single-stage runs only)"
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not data.get("preset"):
            return data
        preset = data["preset"]
        if preset not in LLAMA_PRESETS:
            raise ValueError(f"unknown model.preset {preset!r}; known: {', '.join(LLAMA_PRESETS)}")
        if data.get("family", "llama") != "llama":
            raise ValueError(f"model.preset {preset!r} is a Llama-style size; it needs family = 'llama'")
        return {**data, "family": "llama"}  # (its sizes are filled in after: decided by the preset, not set)

    @model_validator(mode="after")
    def _preset_sizes(self) -> ModelConfig:
        """A preset's sizes, where the file sets none itself: not marked as set, so an override of the preset (a
        ``--set model.preset=...`` over a file that names another) decides them again instead of keeping the old."""
        for key, value in LLAMA_PRESETS.get(self.preset or "", {}).items():
            if key not in self.model_fields_set:
                self.__dict__[key] = value
        return self

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.family == "hf":
            if not self.hf_model:
                raise ValueError("family = 'hf' needs model.hf_model (a Hugging Face model id or a local folder)")
            from potluck.protos.config.hfconfig import describe  # imports transformers: only for hf runs

            decided = describe(self.hf_model)
            for key in HF_DECIDES:  # decided by the model, not set by the user: not marked as set
                if key in self.model_fields_set and getattr(self, key) != decided[key] and key != "tie_embeddings":
                    raise ValueError(f"model.{key} = {getattr(self, key)}, but {self.hf_model} has {decided[key]}; "
                                     f"leave model.{key} out")
                if key not in self.model_fields_set:
                    self.__dict__[key] = decided[key]
        elif self.hf_model:
            raise ValueError(f"model.hf_model is for family = 'hf' (this is family = {self.family!r})")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")
        if self.family == "llama":
            if self.n_heads % self.kv_heads:
                raise ValueError(f"n_kv_heads ({self.kv_heads}) must divide n_heads ({self.n_heads})")
            if (self.d_model // self.n_heads) % 2:
                raise ValueError(f"RoPE needs an even head width; d_model / n_heads = {self.d_model // self.n_heads}")
        return self

    @property
    def ff_width(self) -> int:
        if self.d_ff:
            return self.d_ff
        return 4 * self.d_model if self.family == "tiny" else 256 * ((8 * self.d_model // 3 + 255) // 256)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads
