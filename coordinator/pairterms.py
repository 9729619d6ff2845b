"""The pair terms of the cost model: for two groups, the bottleneck and the min-sum of the perfect
matchings over their pipeline links, memoised by the groups' device tuples, and the blocks of links
they are solved on.

A search's swap changes two groups of ``S``: ``2S - 3`` pairs are new, each a ``R x R`` block of
links to cut from the ``N x N`` matrix. Cut row by row, a block reads ``R`` whole rows (at 1,024
devices and ``R = 100``, 800 KB), and a rejected swap, the usual kind, spends most of its time
there. So the rows of the groups a search keeps for a while (those of the assignment it swaps
from, see :meth:`PairTerms.keep_rows`) are kept too, and a new pair with one kept group is cut from
its rows: ``R x R`` reads. The links are symmetric, so either group of a pair will do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from potluck.coordinator.paths import bottleneck_matching_cost

Key = tuple[tuple[int, ...], tuple[int, ...]]


def pair_key(a: tuple[int, ...], b: tuple[int, ...]) -> Key:
    """The cache key of a pair of groups: the smaller tuple first (the block is ``link[a][:, b]``)."""
    return (a, b) if a < b else (b, a)


class PairTerms:
    """Memoised ``(bottleneck, min_sum)`` of pairs of groups over one symmetric ``link`` matrix.

    ``limit`` bounds the memo (cleared when full); ``rows_kept`` the groups whose rows of ``link``
    are kept (the oldest dropped first).
    """

    def __init__(self, link: np.ndarray, limit: int, rows_kept: int) -> None:
        self.link = link
        self.limit = limit
        self.rows_kept = rows_kept
        self.memo: dict[Key, tuple[float, float]] = {}
        self.rows: dict[tuple[int, ...], np.ndarray] = {}

    def cached(self, groups: Sequence[tuple[int, ...]]) -> tuple[np.ndarray, float, list[tuple[int, int, Any]]]:
        """Edge costs ``2 * bottleneck`` of the memoised pairs, their summed min-sums, and the
        pairs not memoised yet as ``(i, j, key)``."""
        s = len(groups)
        dist = np.zeros((s, s))
        min_sum = 0.0
        missing = []
        memo = self.memo
        for i in range(s):
            for j in range(i + 1, s):
                key = pair_key(groups[i], groups[j])
                hit = memo.get(key)
                if hit is None:
                    missing.append((i, j, key))
                else:
                    dist[i, j] = dist[j, i] = 2.0 * hit[0]
                    min_sum += hit[1]
        return dist, min_sum, missing

    def solve(self, key: Key, block: np.ndarray, lower: float | None = None,
              hint: float | None = None) -> tuple[float, float]:
        """The pair's terms from its block (``lower`` and ``hint`` as in
        :func:`~potluck.coordinator.paths.bottleneck_matching_cost`), memoised."""
        if len(self.memo) > self.limit:
            self.memo.clear()
        hit = self.memo[key] = bottleneck_matching_cost(block, lower, hint)
        return hit

    def hint(self, parent: Sequence[tuple[int, ...]] | None, i: int, j: int) -> float | None:
        """The bottleneck of rows ``i`` and ``j`` of ``parent``, if known: after a swap, most pairs'
        bottlenecks stay where they were."""
        if parent is None:
            return None
        hit = self.memo.get(pair_key(parent[i], parent[j]))
        return None if hit is None else hit[0]

    def keep_rows(self, groups: Sequence[tuple[int, ...]]) -> None:
        """Keep the rows of ``groups`` (an assignment a search will swap from many times), as the
        most recently used: the rows dropped for room are those of groups swapped away."""
        for g in groups:
            rows = self.rows.pop(g, None)
            if rows is None:
                while len(self.rows) >= self.rows_kept:
                    del self.rows[next(iter(self.rows))]
                rows = self.link.take(g, axis=0)
            self.rows[g] = rows

    def blocks(self, keys: list[Key]) -> np.ndarray:
        """``link[a][:, b]`` for each key ``(a, b)``, stacked: the same values, in the same order,
        whether cut from kept rows (of ``a``, or of ``b`` and transposed) or from ``link``."""
        out = np.empty((len(keys), len(keys[0][0]), len(keys[0][1]))) if keys else np.empty((0, 0, 0))
        for k, (a, b) in enumerate(keys):
            rows = self.rows.get(a)
            if rows is not None:
                out[k] = rows.take(b, axis=1)
                continue
            rows = self.rows.get(b)
            if rows is not None:
                out[k] = rows.take(a, axis=1).T
            else:  # row then column takes: about twice as fast as one 3-d fancy index
                out[k] = self.link.take(a, axis=0).take(b, axis=1)
        return out
