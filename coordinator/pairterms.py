"""The pair terms of the cost model: for two groups, the bottleneck and the min-sum of the perfect
matchings over their pipeline links, memoised by the groups' device tuples, and the blocks of links
they are solved on.

A search's swap changes two groups of ``S``: ``2S - 3`` pairs are new, each a ``R x R`` block of
links to cut from the ``N x N`` matrix. Cut row by row, a block reads ``R`` whole rows (at 1,024
devices and ``R = 100``, 800 KB), and a rejected swap, the usual kind, spends most of its time
there. So the rows of the groups a search keeps for a while (those of the assignment it swaps
from, see :meth:`PairTerms.keep_rows`) are kept too, and a new pair with one kept group is cut from
its rows: ``R x R`` reads. The links are symmetric, so either group of a pair will do.

Most swaps a search tries are rejected, and the min-sum matching of each new pair is most of what
they cost. :meth:`PairTerms.estimate` gets, without it, each new pair's exact bottleneck (searched
below a perfect matching patched from the parent pair's min-sum one) and a lower bound on its
min-sum: the parent pair's optimal dual values (one per device, as the links are symmetric), kept
for the devices still on the same side, and the new devices' ones fitted so that the duals stay
feasible; any feasible dual bounds the min-sum from below (LP duality).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.optimize import linear_sum_assignment

from potluck.coordinator.paths import bottleneck_below, bottleneck_matching_cost

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
        self.bottlenecks: dict[Key, float] = {}  # of pairs estimated, whose min-sum was not solved
        self.duals: dict[Key, tuple[dict[int, float], dict[int, int]]] = {}  # parents' pairs: (dual, mate both ways)

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
        known = self.bottlenecks.get(key)
        if known is None:
            hit = self.memo[key] = bottleneck_matching_cost(block, lower, hint)
        else:
            rows, cols = linear_sum_assignment(block)
            hit = self.memo[key] = (known, float(block[rows, cols].sum()))
        return hit

    def estimate(self, groups: Sequence[tuple[int, ...]], parent: Sequence[tuple[int, ...]],
                 missing: list[tuple[int, int, Any]], blocks: np.ndarray,
                 lower: np.ndarray) -> tuple[np.ndarray, float]:
        """Exact bottlenecks of the ``missing`` pairs of ``groups`` (made from ``parent`` by a swap)
        and a lower bound on their summed min-sums, with no min-sum matching (see the module)."""
        if len(self.bottlenecks) > self.limit:
            self.bottlenecks.clear()
        out, total = np.empty(len(missing)), 0.0
        for k, ((i, j, key), block) in enumerate(zip(missing, blocks, strict=True)):
            dual, mate = self._parent_duals(parent[i], parent[j])
            was_a, was_b = (parent[i], parent[j]) if key[0] == groups[i] else (parent[j], parent[i])
            a_set, b_set, cols = set(was_a), set(was_b), {d: c for c, d in enumerate(key[1])}
            u = np.array([dual[d] if d in a_set else np.nan for d in key[0]])
            v = np.array([dual[d] if d in b_set else np.nan for d in key[1]])
            new_u, new_v = np.isnan(u), np.isnan(v)
            if new_v.any():
                old = ~new_u
                v[new_v] = (block[old][:, new_v] - u[old][:, None]).min(axis=0) if old.any() else 0.0
            if new_u.any():
                u[new_u] = (block[new_u] - v[None, :]).min(axis=1)
            bound = float(u.sum() + v.sum())
            total += bound - 1e-9 * abs(bound)
            match = np.array([cols.get(mate[d], -1) if d in a_set else -1 for d in key[0]])
            free = np.ones(len(match), dtype=bool)
            free[match[match >= 0]] = False
            match[match < 0] = np.flatnonzero(free)
            upper = float(block[np.arange(len(match)), match].max())
            hit = self.memo.get(key)
            out[k] = hit[0] if hit is not None else self.bottlenecks.get(key) or bottleneck_below(
                block, upper, float(lower[k]), self.hint(parent, i, j))
            self.bottlenecks[key] = out[k]
        return out, total

    def _parent_duals(self, a: tuple[int, ...], b: tuple[int, ...]) -> tuple[dict[int, float], dict[int, int]]:
        """Optimal duals of the min-sum matching of a parent's pair, by device, and its matching."""
        key = pair_key(a, b)
        hit = self.duals.get(key)
        if hit is None:
            block = self.blocks([key])[0]
            _, sigma = linear_sum_assignment(block)
            w = block - block[np.arange(len(sigma)), sigma][:, None]  # v[j] <= v[sigma[i]] + w[i, j]
            v = np.zeros(len(sigma))
            for _ in range(len(sigma) + 1):  # Bellman-Ford: no negative cycle, sigma being optimal
                nxt = np.minimum(v, (v[sigma][:, None] + w).min(axis=0))
                if np.array_equal(nxt, v):
                    break
                v = nxt
            u = (block - v[None, :]).min(axis=1)  # feasible whatever rounding did to v
            if len(self.duals) > 4 * max(self.rows_kept, 1) ** 2:
                self.duals.clear()
            dual = dict(zip(key[0], u.tolist(), strict=True)) | dict(zip(key[1], v.tolist(), strict=True))
            mate = dict(zip(key[0], (key[1][c] for c in sigma), strict=True))
            hit = self.duals[key] = (dual, mate | {b: a for a, b in mate.items()})
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
