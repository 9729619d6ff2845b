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
they cost. :meth:`PairTerms.min_sums_below` and :meth:`PairTerms.bottlenecks` get, without it, each new pair's exact bottleneck (searched
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

from potluck.coordinator.placement.paths import bottleneck_below, bottleneck_matching_cost

Key = tuple[tuple[int, ...], tuple[int, ...]]
Duals = tuple[np.ndarray, np.ndarray, np.ndarray]  # by device: dual value, side, mate


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
        self.bottlenecks_known: dict[Key, float] = {}  # of pairs estimated, whose min-sum was not solved
        self.duals: dict[Key, Duals] = {}  # of parents' pairs
        self.matched: dict[Key, np.ndarray] = {}  # min-sum matchings of pairs whose bottleneck was known

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
        :func:`~potluck.coordinator.placement.paths.bottleneck_matching_cost`), memoised."""
        if len(self.memo) > self.limit:
            self.memo.clear()
        known = self.bottlenecks_known.get(key)
        if known is None:
            hit = self.memo[key] = bottleneck_matching_cost(block, lower, hint)
        else:
            rows, cols = linear_sum_assignment(block)
            hit = self.memo[key] = (known, float(block[rows, cols].sum()))
            self._forget(self.matched)
            self.matched[key] = cols  # a swap kept makes this pair a parent's: see _parent_duals
        return hit

    def min_sums_below(self, groups: Sequence[tuple[int, ...]], parent: Sequence[tuple[int, ...]],
                       missing: list[tuple[int, int, Any]], blocks: np.ndarray) -> tuple[float, list[float]]:
        """A lower bound on the summed min-sums of the ``missing`` pairs of ``groups`` (made from
        ``parent`` by a swap), with no min-sum matching, and for each pair the max edge of a perfect
        matching, an upper end for :meth:`bottlenecks` (see the module)."""
        total, uppers = 0.0, []
        pos = np.full(len(self.link), -1)
        for (i, j, key), block in zip(missing, blocks, strict=True):
            first, (dual, side, mate) = self._parent_duals(parent[i], parent[j])
            rows, cols = np.asarray(key[0]), np.asarray(key[1])
            was_a = parent[i] if key[0] == groups[i] else parent[j]  # rows come from was_a's side
            on_a = side[rows] == (0 if was_a is first else 1)
            on_b = side[cols] == (1 if was_a is first else 0)
            u, v = np.where(on_a, dual[rows], np.nan), np.where(on_b, dual[cols], np.nan)
            new_u, new_v = ~on_a, ~on_b
            if new_v.any():
                v[new_v] = (block[on_a][:, new_v] - u[on_a][:, None]).min(axis=0) if on_a.any() else 0.0
            if new_u.any():
                u[new_u] = (block[new_u] - v[None, :]).min(axis=1)
            bound = float(u.sum() + v.sum())
            total += bound - 1e-9 * abs(bound)
            pos[cols] = np.arange(len(cols))
            match = np.where(on_a, pos[mate[rows]], -1)
            pos[cols] = -1
            free = np.ones(len(match), dtype=bool)
            free[match[match >= 0]] = False
            match[match < 0] = np.flatnonzero(free)
            uppers.append(float(block[np.arange(len(match)), match].max()))
        return total, uppers

    def bottlenecks(self, parent: Sequence[tuple[int, ...]], missing: list[tuple[int, int, Any]],
                    blocks: np.ndarray, lower: np.ndarray, uppers: list[float]) -> np.ndarray:
        """The exact bottlenecks of the ``missing`` pairs, searched between ``lower`` and ``uppers``
        (from :meth:`min_sums_below`), the parent's first; memoised for :meth:`solve`."""
        if len(self.bottlenecks_known) > self.limit:
            self.bottlenecks_known.clear()
        out = np.empty(len(missing))
        for k, ((i, j, key), block) in enumerate(zip(missing, blocks, strict=True)):
            hit = self.bottlenecks_known.get(key)
            out[k] = hit if hit is not None else bottleneck_below(block, uppers[k], float(lower[k]),
                                                                  self.hint(parent, i, j))
            self.bottlenecks_known[key] = out[k]
        return out

    def _parent_duals(self, a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], Duals]:
        """Optimal duals of the min-sum matching of a parent's pair, by device (``nan`` off the pair),
        each device's side (0 for the first group of the key, which is returned too, 1 for the
        other, -1 off the pair) and its mate in that matching."""
        key = pair_key(a, b)
        hit = self.duals.get(key)
        if hit is None:
            block = self.blocks([key])[0]
            sigma = self.matched.pop(key, None)
            if sigma is None:
                _, sigma = linear_sum_assignment(block)
            w = block - block[np.arange(len(sigma)), sigma][:, None]  # v[j] <= v[sigma[i]] + w[i, j]
            v = np.zeros(len(sigma))
            for _ in range(len(sigma) + 1):  # Bellman-Ford: no negative cycle, sigma being optimal
                nxt = np.minimum(v, (v[sigma][:, None] + w).min(axis=0))
                if np.array_equal(nxt, v):
                    break
                v = nxt
            u = (block - v[None, :]).min(axis=1)  # feasible whatever rounding did to v
            self._forget(self.duals)
            n, rows, cols = len(self.link), np.asarray(key[0]), np.asarray(key[1])
            dual, side, mate = np.full(n, np.nan), np.full(n, -1, dtype=np.int8), np.full(n, -1)
            dual[rows], dual[cols], side[rows], side[cols] = u, v, 0, 1
            mate[rows], mate[cols[sigma]] = cols[sigma], rows
            hit = self.duals[key] = (dual, side, mate)
        return key[0], hit

    def hint(self, parent: Sequence[tuple[int, ...]] | None, i: int, j: int) -> float | None:
        """The bottleneck of rows ``i`` and ``j`` of ``parent``, if known: after a swap, most pairs'
        bottlenecks stay where they were."""
        if parent is None:
            return None
        hit = self.memo.get(pair_key(parent[i], parent[j]))
        return None if hit is None else hit[0]

    def _forget(self, memo: dict[Key, Any]) -> None:
        """Room in a memo of parents' pairs (a few assignments' worth), the oldest entries dropped."""
        while len(memo) >= max(self.rows_kept, 2) ** 2:
            del memo[next(iter(memo))]

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
