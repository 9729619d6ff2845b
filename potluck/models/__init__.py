"""Models as potluck trains them: a config plus a builder of named stage parts.

Every model family is the same shape to the rest of potluck: a flat list of *entries* (embedding,
``n_layers`` decoder blocks, final norm + head), each an ``nn.Module`` from one tensor to the next
(tokens -> hidden -> ... -> logits). A pipeline stage holds a contiguous range of entries; a
parameter is named ``layers.<entry>.<name inside the entry>`` whichever stage holds it, which is
what makes checkpoints independent of the split (the way torchtitan keeps a model apart from how it
is parallelised).

Families (``model.family``):

* ``tiny``: the built-in GPT (learned positions, LayerNorm, GELU MLP), :mod:`.tiny`;
* ``llama``: a native Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) with
  named presets from ~20M to ~1B parameters, :mod:`.llama`;
* ``hf``: a Hugging Face ``transformers`` causal LM (Llama, Qwen2, Mistral, GPT-2 families) from a
  model id or a local folder, built from its config and loaded from its weights when present, :mod:`.hf`.

A stage is built alone (:func:`build_stage`): its entries are constructed on the ``meta`` device and
only they are materialised, each initialised from its own generator seeded by ``(seed, entry)``, so
every peer of a stage starts bit-identical and no peer ever allocates the rest of the model.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from potluck.protos.config.runconfig import ModelConfig, PipelineConfig


class ModelSpec(Protocol):
    """What a family tells potluck about one model config."""

    family: str
    n_layers: int  # decoder blocks; the model has n_layers + 2 entries
    init_std: float
    residual: tuple[str, ...]  # parameter-name endings of residual output projections (scaled init)

    def make_entry(self, i: int) -> nn.Module:
        """Entry ``i`` (0: embedding, 1..n_layers: blocks, n_layers + 1: head), on the default device."""
        ...

    def reset_buffers(self, entry: nn.Module, i: int) -> None:
        """Recompute entry ``i``'s non-parameter buffers after it was materialised from ``meta``."""
        ...

    def load_pretrained(self, entries: dict[int, nn.Module]) -> bool:
        """Copy weights into ``entries`` from the model's own checkpoint; False when it has none."""
        ...

    def tie(self, embed: nn.Module, head: nn.Module) -> None:
        """Make ``head`` reuse ``embed``'s matrix (tied embeddings, single-stage runs)."""
        ...


def entries(cfg: ModelConfig) -> int:
    """How many entries (embedding, blocks, head) the model's layer list has."""
    return cfg.n_layers + 2


@functools.lru_cache(maxsize=16)
def _spec(key: str) -> ModelSpec:
    from potluck.protos.config.runconfig import ModelConfig

    cfg = ModelConfig.model_validate_json(key)
    if cfg.family == "tiny":
        from potluck.models.tiny import TinySpec

        return TinySpec(cfg)
    if cfg.family == "llama":
        from potluck.models.llama import LlamaSpec

        return LlamaSpec(cfg)
    from potluck.models.hf import HFSpec

    return HFSpec(cfg)


@contextlib.contextmanager
def _skeleton() -> Iterator[None]:
    """Construct modules on ``meta`` without running their initialisers: a meta tensor's first
    random fill loads torch's reference decompositions, 1.4 s a process here, for values nobody keeps."""
    import torch
    from torch.nn import init

    names = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
             "trunc_normal_", "ones_", "zeros_", "constant_")
    saved = {n: getattr(init, n) for n in names}
    try:
        for n in names:
            setattr(init, n, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            yield
    finally:
        for n, fn in saved.items():
            setattr(init, n, fn)


def spec_for(cfg: ModelConfig) -> ModelSpec:
    """The :class:`ModelSpec` of ``cfg`` (cached: building an ``hf`` spec reads its config)."""
    return _spec(cfg.model_dump_json())


def entry_seed(seed: int, i: int) -> int:
    """The generator seed of entry ``i``: independent of every other entry, so any subset builds alone."""
    digest = hashlib.blake2b(f"potluck-init:{seed}:{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def init_entry(spec: ModelSpec, entry: nn.Module, seed: int, i: int) -> None:
    """Deterministic init of entry ``i``: matrices N(0, std) (residual projections scaled by
    1 / sqrt(2 * n_layers), GPT-2's rule), biases zero, norm scales one; on the CPU, in name order."""
    import torch

    gen = torch.Generator().manual_seed(entry_seed(seed, i))
    residual_std = spec.init_std / math.sqrt(2 * max(1, spec.n_layers))
    with torch.no_grad():
        for name, p in entry.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, residual_std if name.endswith(spec.residual) else spec.init_std, generator=gen)


def build_stage(cfg: ModelConfig, seed: int, start: int = 0, stop: int | None = None,
                device: str | torch.device = "cpu", pretrained: bool = True) -> nn.ModuleList:
    """Entries ``[start, stop)`` of the model, built alone: constructed on ``meta``, then only these
    are materialised, initialised from ``seed`` (or loaded from the model's own pretrained weights
    when ``pretrained`` and the family has them), and moved to ``device``.

    The result is bit-identical to the same slice of the whole model built from the same seed.
    """
    from torch import nn

    spec, total = spec_for(cfg), entries(cfg)
    stop = total if stop is None else stop
    if not 0 <= start < stop <= total:
        raise ValueError(f"layer slice [{start}, {stop}) is outside the model's {total} layers")
    if cfg.tie_embeddings and (start != 0 or stop != total):
        raise ValueError("tie_embeddings needs embedding and head in one stage; set model.tie_embeddings = false")
    with _skeleton():
        parts = {i: spec.make_entry(i) for i in range(start, stop)}
    for i, part in parts.items():
        part.to_empty(device="cpu")
        init_entry(spec, part, seed, i)
        spec.reset_buffers(part, i)
    if pretrained:
        spec.load_pretrained(parts)
    if cfg.tie_embeddings:
        spec.tie(parts[0], parts[total - 1])
    return nn.ModuleList([parts[i] for i in range(start, stop)]).to(device)


def forward_layers(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """Run ``x`` through ``layers`` in order: the whole model, or one pipeline stage of it."""
    for layer in layers:
        x = layer(x)
    return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats (computed in fp32)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


# ---------------------------------------------------------------------------------------------- splitting


@functools.lru_cache(maxsize=16)
def _costs(key: str, by: str) -> tuple[float, ...]:
    from potluck.protos.config.runconfig import ModelConfig

    cfg = ModelConfig.model_validate_json(key)
    spec, out = spec_for(cfg), []
    for i in range(entries(cfg)):
        with _skeleton():
            part = spec.make_entry(i)
        if by == "params":
            out.append(float(sum(p.numel() for p in part.parameters())))
        else:
            out.append(_flops(part, i, cfg))
    return tuple(out)


def _flops(part: nn.Module, i: int, cfg: ModelConfig) -> float:
    """Forward + backward FLOPs of one sample through entry ``i``, counted on the meta device."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        inp = (torch.zeros(1, cfg.seq_len, dtype=torch.long) if i == 0
               else torch.zeros(1, cfg.seq_len, cfg.d_model, requires_grad=True))
        counter = FlopCounterMode(display=False)
        with counter:
            part(inp).float().sum().backward()
    return float(counter.get_total_flops())


def entry_costs(cfg: ModelConfig, by: str = "params") -> list[float]:
    """Per entry: its parameter count (``by="params"``) or the FLOPs of one sample's forward and
    backward, counted by torch's FlopCounterMode on the ``meta`` device (``by="flops"``)."""
    if by not in ("params", "flops"):
        raise ValueError(f"unknown cost {by!r}: 'params' or 'flops'")
    return list(_costs(cfg.model_dump_json(), by))


def partition(costs: Sequence[float], stages: int) -> list[int]:
    """Entries per stage for contiguous stages minimising the largest stage's cost (exact, O(S n^2));
    ties go to the split with the most even entry counts."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = (math.inf, math.inf)
    # best[s][j]: (max stage cost, max entries) of cutting the first j entries into s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0)
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                prev = best[s - 1][i]
                cand = (max(prev[0], prefix[j] - prefix[i]), max(prev[1], j - i))
                if cand < best[s][j]:
                    best[s][j], cut[s][j] = cand, i
    counts, j = [], n
    for s in range(stages, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def stage_bounds(model: ModelConfig, pipeline: PipelineConfig) -> list[tuple[int, int]]:
    """``[start, stop)`` in the model's entry list (embedding, blocks, head) for each stage.

    Explicit ``pipeline.layers`` counts win. ``pipeline.balance = "layers"`` splits the entries as
    evenly as possible, the extra ones going to the middle stages (the first and last also hold
    embedding and head); ``"params"`` / ``"flops"`` minimise the largest stage's parameter count /
    forward-and-backward FLOPs (:func:`entry_costs`).
    """
    n, s = entries(model), pipeline.stages
    if pipeline.layers:
        counts = list(pipeline.layers)
    elif pipeline.balance == "layers":
        counts = [n // s] * s
        extra = n - sum(counts)
        order = sorted(range(s), key=lambda i: (i in (0, s - 1), abs(i - (s - 1) / 2)))
        for i in order[:extra]:
            counts[i] += 1
    else:
        counts = partition(entry_costs(model, pipeline.balance), s)
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds
