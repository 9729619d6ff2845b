"""The graph pieces of the cost model: bottleneck and min-sum matchings between two groups, the
shortest open path through the groups (Held-Karp, exact; a heuristic above its size; a spanning-tree
lower bound for pruning), and the power mean the search's soft terms use."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from scipy.optimize import linear_sum_assignment

SOFT_POWER = 8.0


def power_mean(x: np.ndarray, p: float = SOFT_POWER) -> float:
    """``(mean x^p)^(1/p)``: between the mean and the max of ``x >= 0``, and, unlike the max, lower for
    every entry lowered; concave in how many entries share the max, so gathering them pays."""
    top = float(x.max()) if len(x) else 0.0
    return 0.0 if top <= 0 else top * float(np.mean((x / top) ** p)) ** (1.0 / p)


def bottleneck_matching_cost(link: np.ndarray, lower: float | None = None,
                             hint: float | None = None) -> tuple[float, float]:
    """``(bottleneck, min_sum)`` of perfect matchings of a square cost matrix.

    The bottleneck is the smallest threshold whose entries ``<= threshold`` still admit a perfect
    matching. It lies between a lower bound (every row and column needs one entry; a caller that
    has it already passes ``lower``) and the max edge of the min-sum matching, and is found by
    binary search over the entries in between, after two guesses (:func:`_first_feasible`): the
    lower bound itself, and ``hint``, a bottleneck the caller expects (that of the pair before a
    swap: moving one device mostly leaves it where it was). The guesses change the search's cost,
    never its answer.
    """
    rows, cols = linear_sum_assignment(link)
    chosen = link[rows, cols]
    upper, min_sum = float(chosen.max()), float(chosen.sum())
    return bottleneck_below(link, upper, lower, hint), min_sum


def bottleneck_below(link: np.ndarray, upper: float, lower: float | None = None,
                     hint: float | None = None) -> float:
    """The bottleneck of a square cost matrix (as in :func:`bottleneck_matching_cost`) given ``upper``,
    the max edge of *some* perfect matching: a feasible threshold, the search's other end. The
    bottleneck is one entry of ``link`` whatever ``upper`` is given, so the answer is the same."""
    if lower is None:
        lower = max(link.min(axis=0).max(), link.min(axis=1).max())
    if upper <= lower:
        return upper
    values = np.sort(link[(link >= lower) & (link < upper)])
    lo = _first_feasible(values, lambda v: _has_perfect_matching(link > v), hint)
    return float(values[lo]) if lo < len(values) else upper


def _first_feasible(values: np.ndarray, feasible: Callable[[float], bool], hint: float | None) -> int:
    """The first index of sorted ``values`` that is ``feasible`` (``len(values)`` if none is; feasibility
    is monotone). Tries the index of ``hint`` (with the one before it) first, ``hint`` being an entry
    or at least ``upper`` (index ``len(values)``, known feasible: one matching then settles it),
    then index 0, then bisects: one or two matchings instead of a dozen when a guess is right."""
    lo, hi = 0, len(values)  # values[hi] would be `upper`, known feasible
    if hint is not None:
        at = int(np.searchsorted(values, hint))
        if at == hi or values[at] == hint:
            if at < hi and not feasible(values[at]):
                lo = at + 1
            else:
                if at == 0 or not feasible(values[at - 1]):
                    return at
                hi = at - 1
    if lo == 0 < hi:
        if feasible(values[0]):
            return 0
        lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(values[mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _has_perfect_matching(forbidden: np.ndarray) -> bool:
    penalty = forbidden.astype(np.float64)
    rows, cols = linear_sum_assignment(penalty)
    return not penalty[rows, cols].any()


class HeldKarp:
    """Exact shortest open path through ``n`` nodes, any start, by dynamic programming over subsets.

    ``best[j, mask]`` is the cheapest path visiting exactly ``mask`` and ending at ``j``. Layers of
    equal popcount are computed as one numpy operation each ("pull": drop ``j`` from ``mask``).
    An optional ``node[j, k]`` adds the cost of putting node ``j`` at position ``k``.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        size = 1 << n
        popcount = np.array([bin(m).count("1") for m in range(size)])
        bits = 1 << np.arange(n)
        self.layers: list[tuple[np.ndarray, np.ndarray]] = []
        for k in range(2, n + 1):
            masks = np.flatnonzero(popcount == k)
            inside = (masks[:, None] & bits[None, :]) != 0
            self.layers.append((masks, np.where(inside, masks[:, None] ^ bits[None, :], 0)))

    def solve(self, dist: np.ndarray, node: np.ndarray | None = None,
              want_path: bool = True) -> tuple[float, list[int]]:
        n = self.n
        best = np.full((n, 1 << n), np.inf)  # best[j, mask]; column 0 stays inf: "j not in mask"
        parent = np.zeros((n, 1 << n), dtype=np.int64) if want_path else None
        best[np.arange(n), 1 << np.arange(n)] = 0.0 if node is None else node[:, 0]
        step = dist[:, None, :]  # step[i, 0, j] = dist[i, j]
        for k, (masks, prev) in enumerate(self.layers, start=1):
            cand = best.take(prev, axis=1)  # cand[i, m, j]: path over mask - {j} ending at i ...
            cand += step  # ... then i -> j; reducing over the leading axis is the fast one
            if parent is not None:
                arg = cand.argmin(axis=0)
                parent[:, masks] = arg.T
                layer = np.take_along_axis(cand, arg[None], axis=0)[0]
            else:
                layer = np.minimum.reduce(cand, axis=0)
            best[:, masks] = layer.T if node is None else layer.T + node[:, k][:, None]
        last = int(best[:, -1].argmin())
        cost = float(best[last, -1])
        if parent is None:
            return cost, []
        path, mask = [last], (1 << n) - 1
        while mask & (mask - 1):
            prev_node = int(parent[last, mask])
            mask ^= 1 << last
            last = prev_node
            path.append(last)
        return cost, path[::-1]


def spanning_tree_edges(dist: np.ndarray) -> np.ndarray:
    """The edge costs of a minimum spanning tree of the complete graph ``dist`` (Prim, dense)."""
    n = len(dist)
    edges, inside, reach = np.empty(max(n - 1, 0)), np.zeros(n, dtype=bool), dist[0].astype(np.float64)
    inside[0] = True
    for k in range(n - 1):
        reach[inside] = np.inf
        j = int(reach.argmin())
        edges[k] = reach[j]
        inside[j] = True
        reach = np.minimum(reach, dist[j])
    return edges


def path_lower_bound(dist: np.ndarray, node: np.ndarray | None = None) -> float:
    """A lower bound on the shortest open path through every node: an open path is a spanning tree,
    so it costs at least a minimum spanning tree; each node's cheapest position bounds ``node``."""
    total = float(spanning_tree_edges(dist).sum())
    return total if node is None else total + float(node.min(axis=1).sum())


def heuristic_path(dist: np.ndarray, node: np.ndarray | None = None) -> tuple[float, list[int]]:
    """Open path for too many stages for Held-Karp: nearest neighbour from every start, then 2-opt."""
    n = len(dist)

    def cost(path: list[int]) -> float:
        total = float(sum(dist[a, b] for a, b in zip(path, path[1:], strict=False)))
        return total if node is None else total + float(sum(node[g, k] for k, g in enumerate(path)))

    best: list[int] = []
    for start in range(n):
        path, left = [start], set(range(n)) - {start}
        while left:
            nxt = min(left, key=lambda j: dist[path[-1], j] + (0.0 if node is None else node[j, len(path)]))
            path.append(nxt)
            left.discard(nxt)
        if not best or cost(path) < cost(best):
            best = path
    current = cost(best)
    improved = True
    while improved:
        improved = False
        for i in range(n - 1):
            for j in range(i + 1, n):
                trial = best[:i] + best[i:j + 1][::-1] + best[j + 1:]
                c = cost(trial)
                if c < current - 1e-12:
                    best, current, improved = trial, c, True
    return current, best
