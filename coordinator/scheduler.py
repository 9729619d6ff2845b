"""Search for a cheap tasklet assignment: DT-FM's hybrid genetic algorithm, plus two baselines.

The search space is every way to split ``S * R`` of the ``N`` devices into ``S`` groups of ``R``
(the cost model orders the groups into a pipeline itself). :func:`evolutionary_search` is a
memetic algorithm, as in Yuan et al. (NeurIPS 2022):

1. a population from the blocks layout, two greedy seeds (one pipeline per cluster of close
   devices; one group per cluster), *structured seeds* (:func:`segment_seeds`: pipeline segments
   kept inside the places -- boxes, data centers, regions -- read off the links at several
   thresholds) and random assignments; half the places go to the cheapest, half to the cheapest on
   the smoothed objective, and both of those are descended first;
2. each generation, children of two tournament-picked parents: a group-wise crossover (align the
   parents' group labels by overlap, take each group from either parent, drop duplicates, refill
   to exactly ``R`` devices per group), a few random swaps, then local search;
3. local search cycles through pairs of groups Kernighan-Lin style, trying device swaps between
   the two (and with unused devices), keeping each one that lowers ``cost + smooth * soft``, until
   a whole cycle brings no improvement;
4. a child replaces the worst member if it is better and new;
5. after ``stall_generations`` generations without a new best, a *restart*: the next structured
   seed not descended yet (or, once they are used up, the best plan kicked by random swaps) is
   descended and joins the population.

Why ``soft`` (:class:`~potluck.coordinator.costmodel.Score`): pipeline edges cost a *bottleneck*,
so moving one device rarely changes the cost until the last mismatched device of two groups is
fixed; descending on the cost alone stops on these plateaus far from one-pipeline-per-region
layouts. The soft term (average instead of slowest matched link; power means instead of the
slowest all-reduce and the slowest device of a stage) slopes the plateaus. The best assignment is
always judged by ``cost`` alone, and gets a last descent on ``cost`` alone.

It stops at the time or evaluation budget, or after ``stall_restarts`` restarts in a row that
found no new best (a small swarm is solved in milliseconds and does not burn its budget). Every
random choice comes from one seeded ``numpy.random.Generator``, so a run with an evaluation budget
(not a time budget) is reproducible.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from potluck.coordinator.costmodel import CostModel, Plan, Score, Topology, canonical, spanning_tree_edges

Groups = list[tuple[int, ...]]


@dataclass(frozen=True)
class SearchResult:
    plan: Plan
    evaluations: int
    seconds: float
    evals_to_best: int
    stopped: str  # "evaluations", "seconds" or "stalled"
    generations: int = 0
    restarts: int = 0
    start_evaluations: int = 0  # spent on the start layouts: evals_to_best <= this returns one unchanged
    curve: list[tuple[int, float]] = field(default_factory=list, repr=False)  # (evaluations, best cost)

    def to_json(self, curve_points: int = 20) -> dict[str, Any]:
        return {"cost": self.plan.cost, "evaluations": self.evaluations, "seconds": round(self.seconds, 3),
                "evals_to_best": self.evals_to_best, "stopped": self.stopped, "generations": self.generations,
                "restarts": self.restarts, "start_evaluations": self.start_evaluations,
                "curve": [[e, c] for e, c in subsample(self.curve, curve_points)]}


def subsample(curve: list[tuple[int, float]], points: int) -> list[tuple[int, float]]:
    """At most ``points`` entries of an improvement curve, always keeping the first and the last."""
    if len(curve) <= points:
        return list(curve)
    keep = np.unique(np.linspace(0, len(curve) - 1, points).round().astype(int))
    return [curve[i] for i in keep]


def better(a: Score, b: Score, smooth: float = 0.0) -> bool:
    """``a`` has a lower ``cost + smooth * soft``, or the same (to rounding) and a lower ``soft``."""
    fa, fb = a.cost + smooth * a.soft, b.cost + smooth * b.soft
    tol = 1e-12 * max(1.0, abs(fb))
    return fa < fb - tol or (fa <= fb + tol and a.soft < b.soft - tol)


class _Run:
    """Budget bookkeeping around one :class:`CostModel`; remembers the cheapest assignment seen."""

    def __init__(self, model: CostModel, budget_seconds: float | None, budget_evals: int | None) -> None:
        if budget_seconds is None and budget_evals is None:
            raise ValueError("give a time budget, an evaluation budget or both")
        self.model = model
        self.start = time.perf_counter()
        self.deadline = math.inf if budget_seconds is None else self.start + budget_seconds
        self.max_evals = math.inf if budget_evals is None else budget_evals
        self.first_eval = model.evaluations
        self.best: tuple[Score, Groups] | None = None
        self.evals_to_best = 0
        self.curve: list[tuple[int, float]] = []

    @property
    def evaluations(self) -> int:
        return self.model.evaluations - self.first_eval

    def exhausted(self) -> bool:
        return self.evaluations >= self.max_evals or time.perf_counter() >= self.deadline

    def score(self, groups: Groups, bound: float | None = None, smooth: float = 0.0) -> Score | None:
        s = self.model.score(groups, bound, smooth)
        if s is not None and (self.best is None or better(s, self.best[0])):
            self.best = (s, list(groups))
            self.evals_to_best = self.evaluations
            self.curve.append((self.evaluations, s.cost))
        return s

    def exact(self, groups: Groups) -> Score:
        s = self.score(groups)
        assert s is not None  # no bound, no pruning
        return s

    def result(self, stopped: str, generations: int = 0, restarts: int = 0, starts: int = 0) -> SearchResult:
        assert self.best is not None
        seconds = time.perf_counter() - self.start
        plan = self.model.plan(np.array(self.best[1]))
        return SearchResult(plan=plan, evaluations=self.evaluations, seconds=seconds,
                            evals_to_best=self.evals_to_best, stopped=stopped, generations=generations,
                            restarts=restarts, start_evaluations=starts, curve=self.curve)

    def stop_reason(self) -> str:
        return "evaluations" if self.evaluations >= self.max_evals else "seconds"


# ------------------------------------------------------------------ layouts


def blocks_layout(topology: Topology) -> np.ndarray:
    """Devices ``0..R-1`` run stage 0, ``R..2R-1`` stage 1, and so on: the layout without a scheduler."""
    return np.arange(topology.stages * topology.replicas).reshape(topology.stages, topology.replicas)


def _random_groups(topology: Topology, rng: np.random.Generator) -> Groups:
    s, r = topology.stages, topology.replicas
    return canonical(rng.permutation(topology.devices)[: s * r].reshape(s, r))


def _clusters(link: np.ndarray, count: int, size: int) -> list[list[int]]:
    """``count`` disjoint clusters of ``size`` close devices: each time, the device whose
    ``size - 1`` nearest free neighbours are closest, with those neighbours, in nearest-first order."""
    free = np.ones(len(link), dtype=bool)
    out = []
    for _ in range(count):
        idx = np.flatnonzero(free)
        sub = link[np.ix_(idx, idx)]
        near = np.argsort(sub, axis=1, kind="stable")[:, :size]  # column 0 is the device itself
        spread = np.take_along_axis(sub, near, axis=1).sum(axis=1)
        seed = int(spread.argmin())
        members = [int(idx[k]) for k in near[seed]]
        free[members] = False
        out.append(members)
    return out


def greedy_seeds(model: CostModel) -> list[Groups]:
    """Two constructive layouts. Pipeline-first: ``R`` clusters of ``S`` close devices, one per
    replica, ordered as a nearest-neighbour chain, stage ``s`` taking the ``s``-th of each, so
    activations stay inside a cluster. Group-first: ``S`` clusters of ``R``, so all-reduces do."""
    t = model.topology
    link = model.pp_link + np.diag(np.full(t.devices, -1.0))  # a device is its own nearest
    chains = []
    for members in _clusters(link, t.replicas, t.stages):
        chain, left = [members[0]], list(members[1:])
        while left:
            chain.append(left.pop(int(model.pp_link[chain[-1], left].argmin())))
        chains.append(chain)
    pipeline_first = canonical(np.array(chains).T)
    dp_link = model.dp_link + model.dp_link.T + np.diag(np.full(t.devices, -1.0))
    group_first = canonical(_clusters(dp_link, t.stages, t.replicas))
    return [pipeline_first, group_first]


def places(link: np.ndarray, levels: int = 4, min_ratio: float = 1.25) -> list[list[list[int]]]:
    """Groups of devices joined by clearly faster links than the rest (boxes, data centers, regions),
    finest first: single-linkage components (``link <= threshold``) at the ``levels`` widest relative
    gaps (at least ``min_ratio``) between the sorted link costs, and between the sorted edge costs of a
    minimum spanning tree (which sees the gaps *along* chains of close devices). Found from the
    measured links alone, as the search sees them; each grouping nests in the next."""
    n = len(link)
    if n < 3:
        return []
    thresholds = set()
    for values in (spanning_tree_edges(link), link[~np.eye(n, dtype=bool)]):
        costs = np.unique(np.round(values, 12))
        ratios = costs[1:] / np.maximum(costs[:-1], 1e-12)
        for gap in np.argsort(-ratios, kind="stable")[:levels]:
            if ratios[gap] >= min_ratio:
                thresholds.add(math.sqrt(costs[gap] * costs[gap + 1]))
    out: dict[tuple[int, ...], list[list[int]]] = {}
    for threshold in sorted(thresholds):
        count, label = connected_components(csr_matrix(link <= threshold), directed=False)
        if 1 < count < n:
            out.setdefault(tuple(label), [np.flatnonzero(label == g).tolist() for g in range(count)])
    return list(out.values())


def segment_seeds(model: CostModel) -> list[Groups]:
    """Layouts that keep pipeline *segments* inside places: a pipeline edge is as slow as its slowest
    replica's hop, so it is fast only if every replica crosses it inside a place. For each grouping
    (:func:`places`) and segment length ``k``: cut every pipeline into ``k`` consecutive stages at the
    same boundaries and put each segment inside one place where one fits (smallest place first, and
    largest first; after the first, places in the same larger place as the last one come first);
    plus one stage group per place, for all-reduces that stay inside."""
    t = model.topology
    out: list[Groups] = []
    found = places(model.pp_link)
    labels = [_labels(members, t.devices) for members in found]
    for level, members in enumerate(found):
        parents = [tuple(int(lab[m[0]]) for lab in labels[level + 1:]) for m in members]
        for near, smallest in itertools.product((None, parents), (True, False)):
            out += [segments_layout(t, members, k, smallest, parents=near) for k in range(1, t.stages + 1)]
            out.append(segments_layout(t, members, 1, smallest, by_group=True, parents=near))
    return list({tuple(g): g for g in out}.values())


def _labels(members: list[list[int]], devices: int) -> np.ndarray:
    label = np.empty(devices, dtype=int)
    for i, m in enumerate(members):
        label[m] = i
    return label


def segments_layout(t: Topology, members: list[list[int]], k: int, smallest: bool, by_group: bool = False,
                    parents: list[tuple[int, ...]] | None = None) -> Groups:
    """Pipelines cut into segments of ``k`` stages, each inside one of ``members`` (places) where one
    fits; ``parents[i]`` names the larger places that hold place ``i`` (finest first), and a segment
    goes to a place sharing the most of them with the last place used before any other."""
    free = [list(m) for m in members]
    family = parents or [()] * len(free)
    rows, length, count = (t.stages, t.replicas, 1) if by_group else (t.replicas, k, -(-t.stages // k))
    chains: list[list[int]] = [[] for _ in range(rows)]
    last: tuple[int, ...] = ()

    def near(i: int) -> int:  # larger places shared with the last place used
        return sum(a == b for a, b in zip(family[i], last, strict=False))

    for block in range(count):
        size = length if by_group else min(k, t.stages - block * k)
        for chain in chains:
            fits = [i for i, f in enumerate(free) if len(f) >= size]
            if fits:
                i = min(fits, key=lambda i: (-near(i), len(free[i]) if smallest else -len(free[i])))
                chain += free[i][:size]
                del free[i][:size]
                last = family[i]
            else:  # no place holds the whole segment: take from the fullest ones
                for _ in range(size):
                    chain.append(max(free, key=len).pop(0))
    return canonical(np.array(chains) if by_group else np.array(chains).T)


# ------------------------------------------------------------------ operators


def _crossover(a: Groups, b: Groups, topology: Topology, rng: np.random.Generator) -> Groups:
    """Group-wise uniform crossover with balance repair: every group ends with exactly ``R`` devices."""
    s = len(a)
    overlap = np.array([[len(set(x) & set(y)) for y in b] for x in a])
    _, match = linear_sum_assignment(-overlap)  # b's group match[i] plays a's group i
    picked = [set(a[i]) if rng.random() < 0.5 else set(b[match[i]]) for i in range(s)]
    taken: set[int] = set()
    for i in rng.permutation(s):
        picked[i] -= taken
        taken |= picked[i]
    pool = [int(d) for d in rng.permutation(topology.devices) if int(d) not in taken]
    for g in picked:
        while len(g) < topology.replicas:
            g.add(pool.pop())
    return canonical(picked)


def _mutate(groups: Groups, topology: Topology, rng: np.random.Generator, swaps: int) -> Groups:
    flat = np.array(groups)
    unused = np.setdiff1d(np.arange(topology.devices), flat)
    for _ in range(swaps):
        i = rng.integers(flat.shape[0])
        if len(unused) and rng.random() < len(unused) / topology.devices:
            k, u = rng.integers(flat.shape[1]), rng.integers(len(unused))
            flat[i, k], unused[u] = unused[u], flat[i, k]
        else:
            j = (i + 1 + rng.integers(flat.shape[0] - 1)) % flat.shape[0] if flat.shape[0] > 1 else i
            k, m = rng.integers(flat.shape[1]), rng.integers(flat.shape[1])
            flat[i, k], flat[j, m] = flat[j, m], flat[i, k]
    return canonical(flat)


def local_search(run: _Run, groups: Groups, score: Score, rng: np.random.Generator, smooth: float = 0.0,
                 max_evals: int | None = None) -> tuple[Groups, Score]:
    """Cyclic Kernighan-Lin style descent over pairs of groups (and group/unused-pool pairs).

    For the current pair, try swapping each device of one side with each of the other, in random
    order; keep the first swap that lowers ``cost + smooth * soft`` and keep working on the pair
    until none does, then move on. Stops after a full cycle of pairs without improvement, after
    ``max_evals`` evaluations, or when the budget is spent.
    """
    groups = list(groups)
    s = len(groups)
    stop_at = math.inf if max_evals is None else run.evaluations + max_evals

    def spent() -> bool:
        return run.evaluations >= stop_at or run.exhausted()

    unused = tuple(sorted(set(range(run.model.topology.devices)) - {d for g in groups for d in g}))
    pairs = [(i, j) for i in range(s) for j in range(i + 1, s)] + ([(i, -1) for i in range(s)] if unused else [])
    order = rng.permutation(len(pairs))
    quiet, k = 0, 0
    while pairs and quiet < len(pairs) and not spent():
        i, j = pairs[order[k % len(pairs)]]
        k += 1
        improved, found = True, False
        while improved and not spent():
            improved = False
            other = unused if j < 0 else groups[j]
            bound = score.cost + smooth * score.soft
            for x, y in _swaps(len(groups[i]), len(other), rng):
                a, b = groups[i][x], other[y]
                trial = list(groups)
                trial[i] = tuple(sorted(groups[i][:x] + groups[i][x + 1:] + (b,)))
                rest = tuple(sorted(other[:y] + other[y + 1:] + (a,)))
                if j >= 0:
                    trial[j] = rest
                new = run.score(trial, bound, smooth)
                if new is not None and better(new, score, smooth):
                    groups, score, improved, found = trial, new, True, True
                    if j < 0:
                        unused = rest
                    break
                if spent():
                    break
        quiet = 0 if found else quiet + 1
    return groups, score


def _swaps(n: int, m: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    flat = rng.permutation(n * m)
    return [(int(f) // m, int(f) % m) for f in flat]


# ------------------------------------------------------------------ searches


def evolutionary_search(topology: Topology, *, seed: int = 0, budget_seconds: float | None = 10.0,
                        budget_evals: int | None = None, population: int = 10, offspring: int = 2,
                        stall_generations: int = 10, stall_restarts: int = 5, mutation_swaps: int = 2,
                        smooth: float = 1.0,
                        local_search_evals: int | None = None, greedy: bool = True,
                        model: CostModel | None = None) -> SearchResult:
    """DT-FM's hybrid genetic algorithm; see the module docstring.

    Children descend ``cost + smooth * soft`` (see :class:`Score`): the soft term keeps the
    bottleneck plateaus from stopping the descent early. The best assignment is always judged
    by ``cost`` alone, and once the search stalls, the best gets a final descent on ``cost``.
    ``model`` lets a caller pass a :class:`CostModel` with a previous plan and migration weight.
    """
    model = model or CostModel(topology)
    rng = np.random.default_rng(seed)
    run = _Run(model, budget_seconds, budget_evals)
    seeds = [canonical(blocks_layout(topology))] + (greedy_seeds(model) + segment_seeds(model) if greedy else [])
    seeds += [_random_groups(topology, rng) for _ in range(max(0, population - len(seeds)))]
    pop: list[tuple[Score, Groups]] = []
    for groups in seeds:
        if run.exhausted() and pop:
            break
        pop.append((run.exact(groups), groups))
    seeded = run.evaluations
    # The structured seeds compete for the population's places: half go to the cheapest, half to
    # the cheapest on the smoothed objective (the starts a descent gets furthest from).
    by_cost = sorted(pop, key=lambda p: (p[0].cost, p[0].soft))
    by_key = sorted(pop, key=lambda p: _key(p[0], smooth))
    keep = max(population, 2)
    pop = list({tuple(g): (sc, g) for sc, g in by_cost[: keep // 2] + by_key[: keep - keep // 2]}.values())
    pop += [p for p in by_key if all(p[1] != g for _, g in pop)][: keep - len(pop)]
    for start in {tuple(by_key[0][1]): by_key[0], tuple(by_cost[0][1]): by_cost[0]}.values():
        if run.exhausted():
            break
        groups, score = local_search(run, start[1], start[0], rng, smooth, local_search_evals)
        pop[pop.index(start)] = (score, groups)
    pop.sort(key=lambda p: _key(p[0], smooth))
    # Later starts, for restarts: the structured seeds not descended yet, cheapest first.
    starts = [g for _, g in by_cost if all(g != p for _, p in pop)]
    generations = stalled = fruitless = restarts = 0
    while not run.exhausted():
        if stalled >= stall_generations:  # a plateau: restart from a new start instead of stopping
            if fruitless >= stall_restarts:
                break
            assert run.best is not None
            before = run.best[0]
            # every other restart descends on the cost alone: the smoothing that crosses plateaus
            # can also lead away from a plan that only plain swaps reach
            _restart(run, pop, starts, rng, smooth, smooth if restarts % 2 else 0.0, local_search_evals)
            restarts, stalled = restarts + 1, 0
            fruitless = 0 if better(run.best[0], before) else fruitless + 1
            continue
        generations += 1
        before = run.best[0] if run.best else None
        for _ in range(offspring):
            if run.exhausted():
                break
            a, b = _tournament(pop, rng, smooth), _tournament(pop, rng, smooth)
            child = _crossover(a[1], b[1], topology, rng) if a is not b else a[1]
            child = _mutate(child, topology, rng, mutation_swaps)
            child, score = local_search(run, child, run.exact(child), rng, smooth, local_search_evals)
            pop.sort(key=lambda p: _key(p[0], smooth))
            if better(score, pop[-1][0], smooth) and all(child != g for _, g in pop):
                pop[-1] = (score, child)
        improved = run.best is not None and before is not None and better(run.best[0], before)
        stalled = 0 if improved else stalled + 1
        fruitless = 0 if improved else fruitless
    stopped = "stalled" if not run.exhausted() else run.stop_reason()
    if run.best is not None and smooth > 0:
        local_search(run, run.best[1], run.best[0], rng)
    return run.result(stopped, generations, restarts, seeded)


def _restart(run: _Run, pop: list[tuple[Score, Groups]], starts: list[Groups], rng: np.random.Generator,
             smooth: float, descent_smooth: float, local_search_evals: int | None) -> None:
    """Descend (on ``cost + descent_smooth * soft``) from the next unused start, or from the best plan
    kicked by random swaps, and let the result replace the population's worst member if it is new."""
    assert run.best is not None
    topology = run.model.topology
    fresh = starts.pop(0) if starts else _mutate(run.best[1], topology, rng, kick_swaps(topology))
    groups, score = local_search(run, fresh, run.exact(fresh), rng, descent_smooth, local_search_evals)
    pop.sort(key=lambda p: _key(p[0], smooth))
    if all(groups != g for _, g in pop):
        pop[-1] = (score, groups)


def kick_swaps(topology: Topology) -> int:
    """Random swaps that move a restart away from the best plan: about a tenth of the tasklets."""
    return max(2, topology.stages * topology.replicas // 10)


def _key(score: Score, smooth: float) -> tuple[float, float]:
    return score.cost + smooth * score.soft, score.soft


def _tournament(pop: list[tuple[Score, Groups]], rng: np.random.Generator,
                smooth: float) -> tuple[Score, Groups]:
    i, j = rng.integers(len(pop)), rng.integers(len(pop))
    return pop[i] if better(pop[i][0], pop[j][0], smooth) else pop[j]


def random_search(topology: Topology, *, seed: int = 0, budget_evals: int | None = 1000,
                  budget_seconds: float | None = None, model: CostModel | None = None) -> SearchResult:
    """Baseline: uniformly random assignments, keep the cheapest."""
    model = model or CostModel(topology)
    rng = np.random.default_rng(seed)
    run = _Run(model, budget_seconds, budget_evals)
    run.exact(_random_groups(topology, rng))
    while not run.exhausted():
        assert run.best is not None
        run.score(_random_groups(topology, rng), bound=run.best[0].cost)
    return run.result(run.stop_reason())
