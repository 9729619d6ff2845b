"""What a tasklet assignment costs: DT-FM's communication model (Yuan et al., NeurIPS 2022).

The job is cut into ``S`` pipeline stages, each replicated ``R`` times (data parallel). An
*assignment* puts these ``S * R`` tasklets on ``N >= S * R`` devices: an ``S x R`` integer array
whose row ``g`` is a *group*, the ``R`` devices that hold the same layers and all-reduce their
gradients. A row index is only a label. Which group runs stage 0, 1, ... is decided here, by the
cheapest open path through the groups, and so is which device of the next group each replica's
activations go to (the matchings along that path). :class:`Placement` holds the result in stage order.

Units. Delays are milliseconds, bandwidths gigabits per second, payloads (``activation_gb`` =
``c_pp``, ``gradient_gb`` = ``c_dp``) gigabytes, every cost seconds. Sending ``c`` gigabytes over a
link takes ``delay_ms / 1000 + 8 * c / bandwidth_gbps`` seconds.

The objective, lower is better::

    cost = dp_cost / H + 2 * pp_cost + compute_cost + migration_cost

* ``dp_cost``: for a group ``C``, device ``d`` scatters and then gathers a ``1/|C|`` shard of the
  gradients with every other member, ``sum_{d' in C, d' != d} 2 * (alpha(d, d') + c_dp / (|C| *
  beta(d, d')))`` over its own outgoing links ``d -> d'``; the group takes as long as its slowest
  member and the step as long as the slowest group. DiLoCo all-reduces once every ``H`` inner
  steps (``outer_every``), hence ``/ H``; ``H = 1`` is DT-FM exactly.
* ``pp_cost``: activations go forward and their gradients back over the same link, so a link
  costs the slower direction, ``max`` of ``alpha + c_pp / beta`` both ways. Between two groups the
  ``R`` replicas need a perfect matching, and a matching is as slow as its slowest link: the edge
  cost is the bottleneck perfect matching. ``pp_cost`` is the shortest open path visiting every
  group once (Held-Karp, exact for ``S <= EXACT_TSP_MAX_STAGES``; nearest neighbour plus 2-opt
  above). The factor 2 counts the forward and the backward pass.
* ``compute_cost`` (only with per-device ``compute`` speeds): the replicas of a stage advance in
  lockstep, so a stage takes ``stage_seconds / speed`` of its slowest member, and a micro-batch
  crosses all stages: ``sum over groups of max over members of stage_seconds / compute[d]``.
* ``migration_cost`` (only given a previous plan): ``migration_weight`` per device whose stage
  differs from the one it held in that plan (a device new to the job counts as moved), because
  it must download that stage's weights. It depends on the stage order, so the path search
  minimises ``2 * pp_cost + migration_cost`` jointly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from scipy.optimize import linear_sum_assignment

from potluck.coordinator.placement.pairterms import PairTerms
from potluck.coordinator.placement.paths import (  # noqa: F401  (re-exported for callers)
    HeldKarp,
    bottleneck_matching_cost,
    heuristic_path,
    path_lower_bound,
    power_mean,
    spanning_tree_edges,
)

EXACT_TSP_MAX_STAGES = 10
_CACHE_CELLS = 3_200_000  # device ids held in cache keys, about 26 MB per cache (8 bytes each)

Groups = Sequence[tuple[int, ...]]


class Score(NamedTuple):
    """What a search compares. ``cost`` is the objective. ``soft`` is no part of it: ``2 * pp_cost``
    as if every pipeline hop cost the *average* link of a min-sum matching, over all pairs of groups,
    plus the all-reduce and compute terms with power means in place of their maxima. The bottleneck
    terms make ``cost`` flat under most single moves; ``soft`` still tells which neighbour is closer
    to matchable groups, to all-reduces off slow links, to slow devices gathered in one stage, so a
    search uses it to break ties or to smooth."""

    cost: float
    soft: float


class TopologyError(ValueError):
    """A topology (or an assignment against it) that cannot be scheduled; the message names the field."""


@dataclass(frozen=True, eq=False)
class Topology:
    """The devices, the links between them and the job's shape. Validated on construction.

    ``delay_ms[i][j]`` and ``bandwidth_gbps[i][j]`` describe the link ``i -> j``; diagonals are ignored.
    ``compute[d]`` is device ``d``'s relative speed (1.0 = one stage in ``stage_seconds``).
    """

    delay_ms: np.ndarray
    bandwidth_gbps: np.ndarray
    stages: int
    replicas: int
    activation_gb: float
    gradient_gb: float
    outer_every: int = 1
    compute: np.ndarray | None = None
    stage_seconds: float = 1.0

    def __post_init__(self) -> None:
        delay = _matrix(self.delay_ms, "delay_ms")
        bandwidth = _matrix(self.bandwidth_gbps, "bandwidth_gbps")
        n = len(delay)
        if bandwidth.shape != delay.shape:
            raise TopologyError(f"bandwidth_gbps is {_shape(bandwidth)} but delay_ms is {_shape(delay)}; "
                                "both must be N x N for the same N")
        off = ~np.eye(n, dtype=bool)
        if (delay[off] < 0).any():
            raise TopologyError("delay_ms must be >= 0 off the diagonal")
        if (bandwidth[off] <= 0).any():
            i, j = np.argwhere((bandwidth <= 0) & off)[0]
            raise TopologyError(f"bandwidth_gbps[{i}][{j}] = {bandwidth[i, j]:g}; links need bandwidth > 0")
        stages, replicas = _positive_int(self.stages, "stages"), _positive_int(self.replicas, "replicas")
        if stages * replicas > n:
            raise TopologyError(f"stages * replicas = {stages} * {replicas} = {stages * replicas} tasklets "
                                f"but only {n} devices")
        compute = None
        if self.compute is not None:
            compute = _vector(self.compute, "compute", n)
        object.__setattr__(self, "delay_ms", delay)
        object.__setattr__(self, "bandwidth_gbps", bandwidth)
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "replicas", replicas)
        object.__setattr__(self, "activation_gb", _nonnegative(self.activation_gb, "activation_gb"))
        object.__setattr__(self, "gradient_gb", _nonnegative(self.gradient_gb, "gradient_gb"))
        object.__setattr__(self, "outer_every", _positive_int(self.outer_every, "outer_every"))
        object.__setattr__(self, "compute", compute)
        object.__setattr__(self, "stage_seconds", _nonnegative(self.stage_seconds, "stage_seconds"))

    @property
    def devices(self) -> int:
        return len(self.delay_ms)

    @classmethod
    def from_json(cls, data: Any) -> Topology:
        """Parse the JSON object; unknown keys are ignored, missing optional ones get defaults."""
        if not isinstance(data, dict):
            raise TopologyError(f"a topology is a JSON object, got {type(data).__name__}")
        required = ("delay_ms", "bandwidth_gbps", "stages", "replicas", "activation_gb", "gradient_gb")
        missing = [k for k in required if k not in data]
        if missing:
            raise TopologyError(f"missing field(s): {', '.join(missing)}")
        optional = {k: data[k] for k in ("outer_every", "compute", "stage_seconds") if data.get(k) is not None}
        return cls(**{k: data[k] for k in required}, **optional)

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise TopologyError(f"cannot read {path}: {err.strerror or err}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise TopologyError(f"{path} is not JSON: {err}") from None
        return cls.from_json(data)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "delay_ms": self.delay_ms.tolist(), "bandwidth_gbps": self.bandwidth_gbps.tolist(),
            "stages": self.stages, "replicas": self.replicas, "activation_gb": self.activation_gb,
            "gradient_gb": self.gradient_gb, "outer_every": self.outer_every,
        }
        if self.compute is not None:
            out["compute"] = self.compute.tolist()
            out["stage_seconds"] = self.stage_seconds
        return out


def _shape(a: np.ndarray) -> str:
    return " x ".join(str(s) for s in a.shape) if a.ndim else "a scalar"


def _numbers(value: Any, name: str) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise TopologyError(f"{name} must hold only numbers (and rows of equal length)") from None
    if not np.isfinite(arr).all():
        raise TopologyError(f"{name} holds a non-finite number (NaN or infinity)")
    return arr


def _matrix(value: Any, name: str) -> np.ndarray:
    arr = _numbers(value, name)
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1] or arr.shape[0] == 0:
        raise TopologyError(f"{name} must be a non-empty square N x N matrix, got {_shape(arr)}")
    return arr


def _vector(value: Any, name: str, n: int) -> np.ndarray:
    arr = _numbers(value, name)
    if arr.shape != (n,):
        raise TopologyError(f"{name} must list one number per device ({n}), got {_shape(arr)}")
    if (arr <= 0).any():
        raise TopologyError(f"{name} must be > 0 for every device")
    return arr


def _positive_int(value: Any, name: str) -> int:
    whole = isinstance(value, int | np.integer) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value < 1:
        raise TopologyError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _nonnegative(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number) or not math.isfinite(value) \
            or value < 0:
        raise TopologyError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Placement:
    """An assignment with its cost, in stage order: ``stage_groups[s][r] == pipelines[r][s]``."""

    cost: float
    dp_cost: float
    pp_cost: float
    compute_cost: float
    migration_cost: float
    order: list[int]  # order[s] = row of the input assignment that runs stage s
    stage_groups: list[list[int]]
    pipelines: list[list[int]] = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"cost": self.cost, "dp_cost": self.dp_cost, "pp_cost": self.pp_cost,
                "compute_cost": self.compute_cost, "migration_cost": self.migration_cost,
                "order": self.order, "stage_groups": self.stage_groups, "pipelines": self.pipelines}


class CostModel:
    """Evaluates assignments of one topology, fast enough for a search loop.

    Link costs are precomputed matrices. A group's DP term and a pair of groups' matching terms
    depend only on their device sets, so they are memoised by sorted device tuples: moving one
    device between two groups recomputes 2 group terms and ``2S - 3`` pair terms, the rest are hits.
    """

    def __init__(self, topology: Topology, previous: np.ndarray | Sequence[Sequence[int]] | None = None,
                 migration_weight: float = 0.0) -> None:
        t = self.topology = topology
        alpha = t.delay_ms / 1000.0
        with np.errstate(divide="ignore"):
            pp = alpha + 8.0 * t.activation_gb / t.bandwidth_gbps
            dp = alpha + 8.0 * t.gradient_gb / (t.replicas * t.bandwidth_gbps)
        self.pp_link = np.maximum(pp, pp.T)
        np.fill_diagonal(self.pp_link, 0.0)
        self.dp_link = 2.0 * dp
        np.fill_diagonal(self.dp_link, 0.0)
        self.stage_time = None if t.compute is None else t.stage_seconds / t.compute
        self.migration_weight = float(migration_weight)
        self.prev_stage: np.ndarray | None = None
        if previous is not None and self.migration_weight > 0:
            prev = check_assignment(t, previous, "previous")
            self.prev_stage = np.full(t.devices, -1)
            for s, row in enumerate(prev):
                self.prev_stage[row] = s
        self.evaluations = 0
        pairs = t.stages * (t.stages - 1) / 2
        self._soft = 0.0 if pairs == 0 else 2.0 * (t.stages - 1) / (pairs * t.replicas)
        self._tsp = HeldKarp(t.stages) if t.stages <= EXACT_TSP_MAX_STAGES else None
        # a cache key holds R device ids, so the entries allowed shrink with R: 200,000 up to R = 16,
        # 6,250 at R = 512, which keeps the caches' memory flat however large the groups
        self._cache_limit = _CACHE_CELLS // max(t.replicas, 16)
        self._group: dict[tuple[int, ...], tuple[float, float, np.ndarray]] = {}
        self._group_soft: dict[tuple[int, ...], tuple[float, float]] = {}  # (dp, compute) as power means
        # the rows of the assignment a search swaps from, and of the two groups it last changed
        self._pairs = PairTerms(self.pp_link, self._cache_limit, rows_kept=t.stages + 2)

    def evaluate(self, assignment: np.ndarray | Sequence[Sequence[int]]) -> float:
        score = self.score(canonical(check_assignment(self.topology, assignment)))
        assert score is not None  # no bound, no pruning
        return score.cost

    def plan(self, assignment: np.ndarray | Sequence[Sequence[int]]) -> Placement:
        return self._plan(canonical(check_assignment(self.topology, assignment)))

    def score(self, groups: Groups, bound: float | None = None, smooth: float = 0.0,
              parent: Groups | None = None) -> Score | None:
        """:class:`Score` of canonical groups (sorted tuples); counts one evaluation.

        ``parent``: the assignment these groups were made from by a swap (row ``g`` of one became
        row ``g`` of the other). Its pairs' bottlenecks are where the new pairs' ones are searched
        first; they change the work, never the score.

        With a ``bound``, returns ``None`` as soon as ``cost + smooth * soft`` provably exceeds it:
        new pairs of groups first get cheap lower bounds on their bottleneck and min-sum matchings
        (every row and every column must use one entry), and as the path cost only grows with its
        edge costs, the path over those bounds bounds the cost from below; a minimum spanning tree
        bounds each path from below before the exact path is solved.
        """
        self.evaluations += 1
        terms = [self._group_terms(g) for g in groups]
        base = max(d for d, _, _ in terms) / self.topology.outer_every + sum(c for _, c, _ in terms)
        if bound is not None and base > bound:
            return None
        node = None if self.prev_stage is None else np.stack([m for _, _, m in terms])
        base_soft = self._base_soft(groups)
        if parent is not None:
            self._pairs.keep_rows(parent)
        dist, min_sum, missing = self._pairs.cached(groups)
        if missing:
            blocks = self._pairs.blocks([key for _, _, key in missing])
            row_min, col_min = blocks.min(axis=2), blocks.min(axis=1)
            lower = np.maximum(row_min.max(axis=1), col_min.max(axis=1))
            if bound is not None:
                low = dist.copy()
                for (i, j, _), value in zip(missing, lower, strict=True):
                    low[i, j] = low[j, i] = 2.0 * value
                low_soft = smooth * (base_soft + self._soft * (
                    min_sum + np.maximum(row_min.sum(axis=1), col_min.sum(axis=1)).sum()))
                if base + path_lower_bound(low, node) + low_soft > bound:
                    return None  # the cheap bound: a path is a spanning tree
                low_path = self._path(low, node, want_path=False)[0]
                if base + low_path + low_soft > bound:
                    return None
                if parent is not None:  # duals bound the min-sums, then exact bottlenecks (see PairTerms)
                    sums, uppers = self._pairs.min_sums_below(groups, parent, missing, blocks)
                    low_soft = smooth * (base_soft + self._soft * (min_sum + sums))
                    if base + low_path + low_soft > bound:
                        return None
                    exact = self._pairs.bottlenecks(parent, missing, blocks, lower, uppers)
                    for (i, j, _), value in zip(missing, exact.tolist(), strict=True):
                        low[i, j] = low[j, i] = 2.0 * value
                    if base + self._path(low, node, want_path=False)[0] + low_soft > bound:
                        return None
            for (i, j, key), block, value in zip(missing, blocks, lower.tolist(), strict=True):
                hit = self._pairs.solve(key, block, value, self._pairs.hint(parent, i, j))
                dist[i, j] = dist[j, i] = 2.0 * hit[0]
                min_sum += hit[1]
        soft = base_soft + self._soft * min_sum
        if bound is not None and base + path_lower_bound(dist, node) + smooth * soft > bound:
            return None
        return Score(base + self._path(dist, node, want_path=False)[0], soft)

    def _base_soft(self, groups: Groups) -> float:
        """The soft terms of the groups alone: the all-reduce and compute bottlenecks as power means
        (over groups of power means over members), which, unlike a max, fall a little with every
        device moved off a slow link or into the group of the other slow ones."""
        soft = [self._group_soft.get(g) or self._soft_terms(np.asarray(g)) for g in groups]
        return power_mean(np.array([d for d, _ in soft])) / self.topology.outer_every + sum(c for _, c in soft)

    def _soft_terms(self, idx: np.ndarray, sums: np.ndarray | None = None) -> tuple[float, float]:
        if sums is None:
            sums = self.dp_link.take(idx, axis=0).take(idx, axis=1).sum(axis=1)
        return power_mean(sums), 0.0 if self.stage_time is None else power_mean(self.stage_time[idx])

    def _plan(self, groups: Groups) -> Placement:
        """The full plan; not counted as an evaluation (a search calls it once, for its result)."""
        dist, _ = self._pair_matrix(groups)
        terms = [self._group_terms(g) for g in groups]
        node = None if self.prev_stage is None else np.stack([m for _, _, m in terms])
        _, order = self._path(dist, node, want_path=True)
        pp = float(sum(dist[a, b] for a, b in zip(order, order[1:], strict=False))) / 2.0
        migration = 0.0 if node is None else float(sum(node[g, s] for s, g in enumerate(order)))
        dp = max(d for d, _, _ in terms)
        compute = float(sum(c for _, c, _ in terms))
        cost = dp / self.topology.outer_every + 2.0 * pp + compute + migration
        chains = [[d] for d in groups[order[0]]]
        for a, b in zip(order, order[1:], strict=False):
            nxt = self._matching(groups[a], groups[b], dist[a, b] / 2.0)
            src = {d: i for i, d in enumerate(groups[a])}
            for chain in chains:
                chain.append(groups[b][nxt[src[chain[-1]]]])
        stage_groups = [[chain[s] for chain in chains] for s in range(len(order))]
        return Placement(cost=float(cost), dp_cost=float(dp), pp_cost=pp, compute_cost=compute,
                    migration_cost=migration, order=[int(g) for g in order], stage_groups=stage_groups,
                    pipelines=chains)

    # ------------------------------------------------------------------ terms

    def _group_terms(self, g: tuple[int, ...]) -> tuple[float, float, np.ndarray]:
        hit = self._group.get(g)
        if hit is None:
            idx = np.asarray(g)
            sums = self.dp_link.take(idx, axis=0).take(idx, axis=1).sum(axis=1)
            dp = float(sums.max())
            compute = 0.0 if self.stage_time is None else float(self.stage_time[idx].max())
            if len(self._group_soft) > self._cache_limit:
                self._group_soft.clear()
            self._group_soft[g] = self._soft_terms(idx, sums)
            moved = np.zeros(self.topology.stages)
            if self.prev_stage is not None:
                stages = np.arange(self.topology.stages)
                moved = self.migration_weight * (self.prev_stage[idx][None, :] != stages[:, None]).sum(axis=1)
            if len(self._group) > self._cache_limit:
                self._group.clear()
            hit = self._group[g] = (dp, compute, moved)
        return hit

    def _pair_matrix(self, groups: Groups) -> tuple[np.ndarray, float]:
        """Edge costs ``2 * bottleneck`` between all pairs of groups, and their summed min-sum matchings."""
        dist, min_sum, missing = self._pairs.cached(groups)
        for i, j, key in missing:
            hit = self._pairs.solve(key, self._pairs.blocks([key])[0])
            dist[i, j] = dist[j, i] = 2.0 * hit[0]
            min_sum += hit[1]
        return dist, min_sum

    def _path(self, dist: np.ndarray, node: np.ndarray | None, want_path: bool) -> tuple[float, list[int]]:
        if self._tsp is not None:
            return self._tsp.solve(dist, node, want_path)
        return heuristic_path(dist, node)

    def _matching(self, a: tuple[int, ...], b: tuple[int, ...], bottleneck: float) -> np.ndarray:
        """``out[i]`` = index in ``b`` matched to ``a[i]``: bottleneck-optimal, then min-sum among those."""
        link = self.pp_link[np.ix_(a, b)]
        allowed = np.where(link <= bottleneck * (1 + 1e-12), link, link.max() * len(a) + 1.0)
        rows, cols = linear_sum_assignment(allowed)
        out = np.empty(len(a), dtype=int)
        out[rows] = cols
        return out


def check_assignment(topology: Topology, assignment: np.ndarray | Sequence[Sequence[int]],
                     name: str = "assignment") -> np.ndarray:
    """An ``S x R`` array of distinct device indices, or :class:`TopologyError`."""
    try:
        arr = np.asarray(assignment)
    except ValueError:
        raise TopologyError(f"{name} must be a stages x replicas array of device indices") from None
    want = (topology.stages, topology.replicas)
    if arr.shape != want or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise TopologyError(f"{name} must be a {want[0]} x {want[1]} integer array, got {_shape(arr)} "
                            f"of {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= topology.devices):
        raise TopologyError(f"{name} names a device outside 0..{topology.devices - 1}")
    if len(np.unique(arr)) != arr.size:
        raise TopologyError(f"{name} uses a device twice")
    return arr.astype(np.int64)


def canonical(assignment: np.ndarray | Iterable[Iterable[int]]) -> list[tuple[int, ...]]:
    """Groups as sorted tuples: the cache keys of :class:`CostModel`."""
    return [tuple(sorted(int(d) for d in row)) for row in assignment]


def plan_cost(topology: Topology, assignment: np.ndarray | Sequence[Sequence[int]],
              previous: np.ndarray | Sequence[Sequence[int]] | None = None,
              migration_weight: float = 0.0) -> Placement:
    """One-shot :meth:`CostModel.plan` (a search should keep one :class:`CostModel` instead)."""
    return CostModel(topology, previous, migration_weight).plan(assignment)
