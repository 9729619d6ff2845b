"""The model on a peer: the whole model as one module (:class:`TinyGPT`), and re-exports of the model
interface (:mod:`potluck.models`) that peers, tests and benchmarks use."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from potluck.models import build_stage, entries, lm_loss
from potluck.models import forward_layers as _forward
from potluck.protos.config.runconfig import ModelConfig

__all__ = ["Model", "TinyGPT", "load_named", "build_layers", "forward_layers", "lm_loss", "num_layers"]


def num_layers(cfg: ModelConfig) -> int:
    """Entries of the layer list: embedding, the blocks, the head."""
    return entries(cfg)


def forward_layers(layers: Iterable[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor,
                   checkpoint_activations: bool = False) -> torch.Tensor:
    """Run ``x`` through ``layers`` in order (:func:`potluck.models.forward_layers`).

    With ``checkpoint_activations``, each layer fed a float tensor (every block and the head; the
    embedding's token ids have nothing worth dropping) keeps only its input for the backward pass and
    runs its forward again there (``torch.utils.checkpoint``, non-reentrant, so it composes with
    autocast and with parameters that need gradients while the input does not). The recomputation is
    the same arithmetic on the same inputs, so the gradients are those of a plain run. Under
    ``torch.no_grad`` (evaluation) there is nothing to keep, and nothing is recomputed.
    """
    if not (checkpoint_activations and torch.is_grad_enabled()):
        return _forward(layers, x)  # type: ignore[arg-type]
    for layer in layers:
        x = checkpoint(layer, x, use_reentrant=False) if x.is_floating_point() else layer(x)
    return x


def build_layers(cfg: ModelConfig, seed: int, start: int = 0, stop: int | None = None) -> nn.ModuleList:
    """Layers ``[start, stop)`` of the model, built alone (see :func:`potluck.models.build_stage`)."""
    return build_stage(cfg, seed, start, stop)


class Model(nn.Module):
    """The whole model, of any family, as one module. ``forward`` returns logits."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, pretrained: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = build_stage(cfg, seed, pretrained=pretrained)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return forward_layers(self.layers, tokens)


def load_named(model: Model, named: dict[str, torch.Tensor]) -> None:
    """Load parameters named ``layers.<entry>.<name>`` (a checkpoint's layout); a tied head needs none."""
    missing, unexpected = model.load_state_dict(named, strict=False)
    tied = {n for n, p in model.state_dict(keep_vars=True).items()
            if any(p is q for m, q in model.state_dict(keep_vars=True).items() if m != n and m in named)}
    if unexpected or set(missing) - tied:
        raise ValueError(f"the checkpoint does not fit the model: missing {sorted(set(missing) - tied)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]}")


TinyGPT = Model  # the name it had when the built-in GPT was the only model
