"""How the model is cut into pipeline stages: a contract every process computes the same way.

The model is a list of layers (embedding, ``n_layers`` blocks, head); stage ``s`` of ``S`` holds the
contiguous range ``stage_bounds(model, pipeline)[s]`` of it. Peers build exactly those layers; the
coordinator cuts and joins checkpoints along the same bounds without ever importing model code.
"""

from __future__ import annotations

from potluck.protos.config import ModelConfig, PipelineConfig


def stage_bounds(model: ModelConfig, pipeline: PipelineConfig) -> list[tuple[int, int]]:
    """``[start, stop)`` in the model's layer list (embedding, blocks, head) for each stage.

    Explicit ``pipeline.layers`` counts win; otherwise the entries are split as evenly as possible,
    the extra ones going to the middle stages (the first and last also hold embedding and head).
    """
    entries, s = model.n_layers + 2, pipeline.stages
    counts = list(pipeline.layers) if pipeline.layers else [entries // s] * s
    if not pipeline.layers:
        extra = entries - sum(counts)
        order = sorted(range(s), key=lambda i: (i in (0, s - 1), abs(i - (s - 1) / 2)))
        for i in order[:extra]:
            counts[i] += 1
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds
