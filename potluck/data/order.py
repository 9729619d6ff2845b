"""The run's sample order: one seeded permutation per epoch, addressed by a global position.

A run of ``n`` training samples (ids ``0..n-1``) reads them in the order of *global positions*
``g = 0, 1, 2, ...``: position ``g`` is sample ``perm_e(g mod n)`` of epoch ``e = g div n``, where
``perm_e`` is a pseudo-random permutation of ``0..n-1`` seeded by (data seed, epoch). The
coordinator's cursor (:mod:`potluck.coordinator.rounds.cursor`) hands each round's replicas disjoint ranges
of positions; a peer turns its range into sample ids here, with no table of ``n`` entries anywhere:
the permutation is a keyed Feistel network over the smallest even-bit power of two ``>= n``,
cycle-walked back into ``0..n-1`` (Black & Rogaway's construction), so any position maps to its
sample in O(1) and a run of a billion samples costs nothing to shuffle. Sample ids stay the stable
ids the data source and AC-SGD's per-sample buffers use.

Everything is integer arithmetic on uint64 with wrap-around, identical on every machine; the
scalar :func:`permute_one` is the readable reference the vectorised :func:`permute` is tested
against (and both against being a bijection).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from potluck.data import DataError

ROUNDS = 4
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(x: int) -> int:
    """splitmix64's finaliser: a fixed bijection of 64-bit integers with good avalanche."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def _keys(seed: int, epoch: int) -> list[int]:
    base = _mix((seed & _M64) ^ _mix((epoch & _M64) ^ 0x6F72646572))  # "order"
    return [_mix(base + (r + 1) * _GOLDEN & _M64) for r in range(ROUNDS)]


def _half_bits(n: int) -> int:
    """Bits in each half of the Feistel block: the domain 2**(2h) is the smallest even power >= n (< 4n)."""
    bits = max(2, (n - 1).bit_length())
    return (bits + 1) // 2


def permute_one(position: int, n: int, seed: int, epoch: int) -> int:
    """Sample id at ``position`` (in ``0..n-1``) of epoch ``epoch``: the reference implementation."""
    if not 0 <= position < n:
        raise DataError(f"position {position} is outside [0, {n})")
    h = _half_bits(n)
    mask, keys, x = (1 << h) - 1, _keys(seed, epoch), position
    while True:
        left, right = x >> h, x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        x = (left << h) | right
        if x < n:
            return x


def _mix_np(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """:func:`permute_one` for every entry of ``positions`` (int64 array in ``0..n-1``), vectorised."""
    pos = np.asarray(positions, dtype=np.int64)
    if pos.size and (pos.min() < 0 or pos.max() >= n):
        raise DataError(f"positions outside [0, {n})")
    h = _half_bits(n)
    shift, mask = np.uint64(h), np.uint64((1 << h) - 1)
    keys = [np.uint64(k) for k in _keys(seed, epoch)]
    out = pos.astype(np.uint64)
    todo = np.arange(out.size)
    x = out.copy()
    with np.errstate(over="ignore"):
        while todo.size:
            left, right = x >> shift, x & mask
            for k in keys:
                left, right = right, left ^ (_mix_np(right ^ k) & mask)
            x = (left << shift) | right
            done = x < np.uint64(n)
            out[todo[done]] = x[done]
            todo, x = todo[~done], x[~done]
    return out.astype(np.int64)


def sample_ids(spans: Iterable[tuple[int, int]], n: int, seed: int) -> np.ndarray:
    """The sample ids at global positions ``[start, stop)`` of each span, in order (int64)."""
    if n < 1:
        raise DataError("a run needs at least one training sample")
    parts = []
    for start, stop in spans:
        if not 0 <= start <= stop:
            raise DataError(f"bad span [{start}, {stop})")
        g = np.arange(start, stop, dtype=np.int64)
        epochs, offsets = np.divmod(g, n)
        out = np.empty_like(g)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = permute(offsets[sel], n, seed, int(e))
        parts.append(out)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
