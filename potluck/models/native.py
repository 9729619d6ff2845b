"""What the built-in families share: entries made of three module classes, seeded init only."""

from __future__ import annotations

from torch import nn

from potluck.protos.config.runconfig import ModelConfig


class NativeSpec:
    """A family written in potluck: ``embedding``, ``block`` and ``head`` classes taking the config."""

    embedding: type[nn.Module]
    block: type[nn.Module]
    head: type[nn.Module]

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg, self.n_layers = cfg, cfg.n_layers

    def make_entry(self, i: int) -> nn.Module:
        if i == 0:
            return self.embedding(self.cfg)
        return self.block(self.cfg) if i <= self.n_layers else self.head(self.cfg)

    def reset_buffers(self, entry: nn.Module, i: int) -> None:
        pass  # no buffers: position tables are computed in forward

    def load_pretrained(self, entries: dict[int, nn.Module]) -> bool:
        return False  # a native run starts from its seed, or from a checkpoint of its own
