"""Built-in data: stable ids, disjoint shards, and an entropy floor that the samples really have."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from potluck.peer.training.data import EVAL_ID_OFFSET, DataError, Dataset, MarkovSource
from potluck.peer.training.model import TinyGPT, build_layers, lm_loss, num_layers
from potluck.protos.config.runconfig import DataConfig, ModelConfig


def test_samples_are_a_pure_function_of_their_id() -> None:
    a = MarkovSource(16, 2, 0.2, seed=7, seq_len=32)
    b = MarkovSource(16, 2, 0.2, seed=7, seq_len=32)
    assert np.array_equal(a.sample(123), b.sample(123))
    assert not np.array_equal(a.sample(123), a.sample(124))
    assert a.sample(5).shape == (33,)


@pytest.mark.parametrize("order,vocab", [(1, 12), (2, 8)])
def test_entropy_floor_matches_the_empirical_loss_of_the_true_model(order: int, vocab: int) -> None:
    src = MarkovSource(vocab, order, 0.3, seed=1, seq_len=48)
    nll = []
    for i in range(1500):
        s = src.sample(i)
        for t in range(order, 49):
            ctx = 0
            for tok in s[t - order : t]:
                ctx = ctx * vocab + int(tok)
            nll.append(-np.log(src.table[ctx, s[t]]))
    assert abs(np.mean(nll) - src.entropy_rate()) < 0.03
    assert src.loss_floor() >= src.entropy_rate() - 1e-12


def test_eval_ids_are_held_out_and_bad_ids_refused() -> None:
    ds = Dataset(DataConfig(num_samples=50, eval_samples=4), ModelConfig(vocab_size=16, seq_len=8))
    assert all(i >= EVAL_ID_OFFSET for i in ds.eval_ids())
    x, y = ds.batch(ds.eval_ids())
    assert x.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(DataError):
        ds.sample(50)


def test_byte_file_source(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "text.txt"
    path.write_bytes(b"hello potluck " * 100)
    ds = Dataset(DataConfig(source="bytes", path=str(path), eval_samples=2), ModelConfig(vocab_size=256, seq_len=16))
    assert ds.loss_floor is None and ds.num_samples > 10
    x, _ = ds.batch([0, 1])
    assert bytes(x[0].tolist()).startswith(b"hello potluck")
    with pytest.raises(DataError, match="vocab_size = 256"):
        Dataset(DataConfig(source="bytes", path=str(path)), ModelConfig(vocab_size=64))
    with pytest.raises(DataError, match="does not exist"):
        Dataset(DataConfig(source="bytes", path=str(tmp_path / "nope")), ModelConfig(vocab_size=256))


def test_a_markov_table_too_big_for_memory_is_refused() -> None:
    with pytest.raises(DataError, match="table entries"):
        MarkovSource(4096, 2, 0.1, seed=0, seq_len=8)


def test_model_init_is_identical_however_it_is_sliced() -> None:
    cfg = ModelConfig(d_model=32, n_layers=3, n_heads=2, seq_len=16)
    full = build_layers(cfg, seed=3)
    tail = build_layers(cfg, seed=3, start=2)
    for a, b in zip(full[2:].parameters(), tail.parameters(), strict=True):
        assert torch.equal(a, b)
    assert len(full) == num_layers(cfg) == 5
    model = TinyGPT(cfg, seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    loss = lm_loss(model(tokens), tokens)
    assert abs(float(loss.detach()) - np.log(cfg.vocab_size)) < 0.3  # untrained: about uniform
