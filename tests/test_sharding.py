"""Where a sharded peer's rows sit in the stage's flat vector (:mod:`potluck.peer.devices.sharding`), and the runs it refuses.

The real-process tests (two ranks over gloo, FSDP2) are in ``tests/test_multidevice.py``; these check
the arithmetic they rely on against torch's own split, without processes."""

from __future__ import annotations

import pytest
import torch
from swarm import run_config

from potluck.peer.devices import sharding
from potluck.protos.config.section import ConfigError


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 64, 97])
def test_a_ranks_rows_are_torch_chunks(rows: int, world: int) -> None:
    """FSDP2 splits dim 0 as torch.chunk does: the same rows, the last ranks short or empty."""
    chunks = torch.arange(rows).chunk(world)
    for r in range(world):
        start, stop = sharding.rows_of(rows, r, world)
        expect = chunks[r].tolist() if r < len(chunks) else []
        assert list(range(start, stop)) == expect


class FakeShard:
    """Stands in for a DTensor parameter: its global shape, and the attributes that mark it sharded."""

    def __init__(self, *shape: int) -> None:
        self.shape = torch.Size(shape)
        self.device_mesh = None

    def numel(self) -> int:
        return self.shape.numel()

    def to_local(self) -> torch.Tensor:  # (not called by pieces)
        raise AssertionError


@pytest.mark.parametrize("world", [2, 3])
def test_the_pieces_of_all_ranks_tile_the_sharded_parameters_once(world: int) -> None:
    whole = torch.nn.Parameter(torch.zeros(3, 2))  # (a tied one: the leader's alone)
    params = [FakeShard(5, 4), whole, FakeShard(7), FakeShard(1, 3)]
    covered = torch.zeros(sum(p.numel() for p in params), dtype=torch.int64)
    for r in range(world):
        for offset, count in sharding.pieces(params, r, world):
            covered[offset : offset + count] += 1
    assert covered[:20].tolist() == [1] * 20 and covered[20:26].tolist() == [0] * 6  # the whole one: not a piece
    assert covered[26:].tolist() == [1] * 10
    assert sharding.pieces(params, 0, world)[0] == (0, 4 * (-(-5 // world)))


def test_a_sharded_peer_refuses_what_needs_the_whole_tensor() -> None:
    sharding.refuse(run_config())  # AdamW, fp32: fine
    with pytest.raises(ConfigError, match="adamw8bit.*--devices replicate"):
        sharding.refuse(run_config({"train.optimizer": "adamw8bit"}))
    with pytest.raises(ConfigError, match="weights = 'bf16'.*--devices replicate"):
        sharding.refuse(run_config({"train.weights": "bf16"}))
    with pytest.raises(ConfigError, match="fp16.*bf16"):
        sharding.refuse(run_config({"train.precision": "fp16"}))
