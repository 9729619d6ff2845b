"""Training data with stable sample ids: a synthetic Markov source, a byte file, or token shards.

Every sample has an integer id and is a pure function of the data config and that id, so any peer
can produce sample 1234 without coordination and AC-SGD can keep one buffer per id. Which ids a
replica trains on in a step is the coordinator's decision (spans of the run's order, see
:mod:`potluck.coordinator.rounds.cursor`), read here by :class:`SpanSampler`. Token shards
(:mod:`potluck.data.corpus`) and byte files are memory-mapped, never read whole into RAM.

The built-in source is a random Markov chain of order ``k`` over ``vocab_size`` tokens (Dirichlet
rows, fixed by the seed). Its entropy rate is known exactly, which gives the best loss any model can
reach (:meth:`MarkovSource.loss_floor`): a run's eval loss is reported next to it.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import torch

from potluck.data import DataError
from potluck.data.corpus import ShardCorpus, locate
from potluck.data.order import sample_ids
from potluck.protos.config.runcheck import min_corpus_bytes
from potluck.protos.config.runconfig import BYTE_VOCAB, MAX_MARKOV_ENTRIES, DataConfig, ModelConfig

EVAL_ID_OFFSET = 1 << 40  # eval sample ids live far above training ids


class MarkovSource:
    """A random order-``k`` Markov chain; ``sample(i)`` is ``seq_len + 1`` tokens for id ``i``.

    Peers check that they draw the run's samples through a hash of the parameters
    (:func:`potluck.protos.config.runcheck.markov_identity`): a change to how samples are drawn from them
    must bump ``MARKOV_GENERATOR`` there.
    """

    def __init__(self, vocab_size: int, order: int, concentration: float, seed: int, seq_len: int) -> None:
        states = vocab_size**order
        if states * vocab_size > MAX_MARKOV_ENTRIES:
            raise DataError(f"vocab_size**(markov_order + 1) = {states * vocab_size} table entries is more than "
                            f"{MAX_MARKOV_ENTRIES}")
        self.vocab_size, self.order, self.seq_len, self.seed = vocab_size, order, seq_len, seed
        rng = np.random.default_rng([seed, 0x6D61726B])
        self.table = rng.dirichlet(np.full(vocab_size, concentration), size=states)  # [contexts, V]
        self.cumulative = np.cumsum(self.table, axis=1)
        self.cumulative[:, -1] = 1.0
        self.stationary = self._stationary()
        self.context_cumulative = np.cumsum(self.stationary)
        self.context_cumulative[-1] = 1.0

    def _stationary(self) -> np.ndarray:
        """Stationary distribution over contexts (power iteration on the context chain)."""
        v, k = self.vocab_size, self.order
        pi = np.full(v**k, 1.0 / v**k)
        for _ in range(10_000):
            # context c = (x_1..x_k) moves to (x_2..x_k, y) with probability table[c, y]
            nxt = (pi[:, None] * self.table).reshape(v, v ** (k - 1), v).sum(axis=0).reshape(-1)
            if np.abs(nxt - pi).sum() < 1e-13:
                return nxt
            pi = nxt
        return pi

    def entropy_rate(self) -> float:
        """H(X_t | X_{t-k..t-1}) under stationarity, in nats per token."""
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -np.nansum(np.where(self.table > 0, self.table * np.log(self.table), 0.0), axis=1)
        return float(self.stationary @ h)

    def loss_floor(self) -> float:
        """The lowest mean next-token loss a model can reach on a sample (nats).

        Targets ``x_1..x_T`` are predicted from everything before them; the first ``k - 1`` of them
        see less than a full context, so their conditional entropies come from marginals of the
        stationary context distribution, the rest pay the entropy rate.
        """
        v, k, t = self.vocab_size, self.order, self.seq_len
        joint = self.stationary.reshape((v,) * k)
        prefix_entropy = []
        for j in range(1, k + 1):
            marginal = joint.sum(axis=tuple(range(j, k))) if j < k else joint
            p = marginal.reshape(-1)
            prefix_entropy.append(float(-(p[p > 0] * np.log(p[p > 0])).sum()))
        # H(x_j | x_<j) = H(x_0..x_j) - H(x_0..x_{j-1}) for j = 1..k-1
        partial = [prefix_entropy[j] - prefix_entropy[j - 1] for j in range(1, min(k, t + 1))]
        full = t - len(partial)
        return (sum(partial) + full * self.entropy_rate()) / t

    def sample(self, sample_id: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 0x73616D70, sample_id])
        u = rng.random(self.seq_len + 2)
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        context = int(np.searchsorted(self.context_cumulative, u[0], side="right"))
        digits = [(context // self.vocab_size ** (self.order - 1 - i)) % self.vocab_size for i in range(self.order)]
        n_start = min(self.order, self.seq_len + 1)
        out[:n_start] = digits[:n_start]
        modulus = self.vocab_size ** (self.order - 1)
        for t in range(self.order, self.seq_len + 1):
            nxt = int(np.searchsorted(self.cumulative[context], u[t - self.order + 1], side="right"))
            out[t] = nxt
            context = (context % modulus) * self.vocab_size + nxt if modulus > 1 else nxt
        return out


class ByteFileSource:
    """Non-overlapping windows of a byte file; the last ``eval_windows`` windows are held out."""

    def __init__(self, path: str | Path, seq_len: int, eval_windows: int) -> None:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"data file {path} does not exist")
        try:  # memory-mapped: a corpus bigger than RAM trains too
            self.data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
        except OSError as err:
            raise DataError(f"cannot read the data file {path}: {err.strerror or err}") from None
        self.seq_len = seq_len
        need = min_corpus_bytes(seq_len, eval_windows)
        if len(self.data) < need:
            raise DataError(f"{path} holds {len(self.data)} bytes: too small for {eval_windows + 1} windows of "
                            f"{seq_len + 1} bytes (at least {need} bytes)")
        self.train_windows = (len(self.data) - 1) // seq_len - eval_windows
        self.eval_windows = eval_windows

    def sample(self, sample_id: int) -> np.ndarray:
        if sample_id >= EVAL_ID_OFFSET:
            window = self.train_windows + (sample_id - EVAL_ID_OFFSET)
        else:
            window = sample_id % self.train_windows
        start = window * self.seq_len
        return self.data[start : start + self.seq_len + 1].astype(np.int64)


class Dataset:
    """Samples by id for training (ids ``0..num_samples-1``) and evaluation (a fixed held-out set)."""

    def __init__(self, data: DataConfig, model: ModelConfig) -> None:
        self.cfg = data
        self.source: MarkovSource | ByteFileSource | ShardCorpus
        self.eval_samples = data.eval_samples
        if data.source == "markov":
            self.source = MarkovSource(
                model.vocab_size, data.markov_order, data.markov_concentration, data.seed, model.seq_len
            )
            self.num_samples = data.num_samples
        elif data.source in ("shards", "hf"):  # a peer's joining already fetched (or prepared) and checked them
            self.source = ShardCorpus.open(locate(data, override=data.path if data.source == "hf" else None), data, model)
            self.num_samples, self.eval_samples = self.source.num_samples, self.source.eval_samples
        else:
            if model.vocab_size < BYTE_VOCAB:
                raise DataError(f"byte-level data needs model.vocab_size = {BYTE_VOCAB} (or more: a Hugging Face model's "
                                f"vocabulary), got {model.vocab_size}")
            assert data.path is not None
            self.source = ByteFileSource(data.path, model.seq_len, data.eval_samples)
            self.num_samples = min(data.num_samples, self.source.train_windows)
        self._cache: dict[int, np.ndarray] = {}

    @functools.cached_property
    def loss_floor(self) -> float | None:
        """Best achievable loss, when the source knows it (the Markov source does)."""
        return self.source.loss_floor() if isinstance(self.source, MarkovSource) else None

    def sample(self, sample_id: int) -> np.ndarray:
        if sample_id < 0 or (sample_id >= self.num_samples and sample_id < EVAL_ID_OFFSET):
            raise DataError(f"sample id {sample_id} is outside the training set [0, {self.num_samples})")
        if isinstance(self.source, ShardCorpus):  # memory-mapped: reading again is cheaper than holding it
            return self.source.sample(sample_id, EVAL_ID_OFFSET)
        cached = self._cache.get(sample_id)
        if cached is None:
            cached = self.source.sample(sample_id)
            if len(self._cache) < 1 << 18:
                self._cache[sample_id] = cached
        return cached

    def batch(self, ids: list[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each ``[len(ids), seq_len]`` int64."""
        rows = np.stack([self.sample(int(i)) for i in ids])
        tokens = torch.from_numpy(rows)
        return tokens[:, :-1], tokens[:, 1:]

    def eval_ids(self) -> list[int]:
        return [EVAL_ID_OFFSET + j for j in range(self.eval_samples)]


class SpanSampler:
    """The sample ids one replica trains on in one outer step: the coordinator's spans of global
    positions (:class:`~potluck.protos.wire.records.Share`) through the run's order (:mod:`potluck.data.order`).
    """

    def __init__(self, spans: list[tuple[int, int]], num_samples: int, seed: int, count: int) -> None:
        self.spans = spans
        held = sum(b - a for a, b in spans)
        if held < count:  # checked before a single id is made: a bad span must not allocate its size
            raise DataError(f"the round hands this replica {held} samples; an outer step needs {count}")
        self.ids = sample_ids(spans, num_samples, seed)
        self.position = 0

    def next_ids(self, batch_size: int) -> list[int]:
        if self.position + batch_size > len(self.ids):
            raise DataError(f"this replica's {len(self.ids)} samples of the step are used up")
        out = self.ids[self.position : self.position + batch_size]
        self.position += batch_size
        return [int(i) for i in out]


def in_run_order(num_samples: int, seed: int, count: int = 1 << 12) -> SpanSampler:
    """The first ``count`` samples of the run's order, as one replica alone would read them (tests, benchmarks)."""
    return SpanSampler([(0, count)], num_samples, seed, count)


def bits_per_token(nats: float) -> float:
    return nats / math.log(2)
