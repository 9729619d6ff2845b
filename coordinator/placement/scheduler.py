"""Search for a cheap tasklet assignment: DT-FM's hybrid genetic algorithm, plus two baselines.

The search space is every way to split ``S * R`` of the ``N`` devices into ``S`` groups of ``R``
(the cost model orders the groups into a pipeline itself). :func:`evolutionary_search` is a
memetic algorithm, as in Yuan et al. (NeurIPS 2022):

1. a population from the blocks layout, two greedy seeds (one pipeline per cluster of close
   devices; one group per cluster), *rank seeds* (:func:`rank_seeds`: the slowest devices unused,
   slow ones gathered; :func:`ranked_greedy_seeds`: the greedy seeds over the best-ranked devices),
   *structured seeds* (:func:`segment_seeds`: pipeline segments
   kept inside the places -- boxes, data centers, regions -- read off the links at several
   thresholds, every pipeline's first segment first or pipeline by pipeline) and random
   assignments; half the places go to the cheapest, half to the cheapest on the smoothed
   objective, and both of those are descended first (the cheapest on the smoothed objective
   first, each with half of what is left of the budget at most). Start layouts are built as they are evaluated, for at most ``SEED_SHARE`` of a time
   budget: at 1,024 devices each one costs tens of milliseconds, and there can be a hundred;
2. each generation, children of two tournament-picked parents: a group-wise crossover (align the
   parents' group labels by overlap, take each group from either parent, drop duplicates, refill
   to exactly ``R`` devices per group), a few random swaps, then local search;
3. local search cycles through pairs of groups Kernighan-Lin style, trying device swaps between
   the two (and with unused devices; at most ``PAIR_SWAPS`` a visit, as ``R = 100`` makes 10,000;
   with large groups the ``GUIDED_SWAPS`` that :func:`misfit` ranks best first, then ``RANDOM_TAIL``
   random ones, as at 1,024 devices nearly every swap kept is guided, until a cycle of such visits
   finds nothing, then full ones), keeping each one that lowers ``cost + smooth * soft``, until a
   whole cycle brings no improvement; with per-device compute speeds, a visit first tries two
   re-splits of the pair that gather slow GPUs in one group (:func:`compute_resplits`);
4. a child replaces the worst member if it is better and new;
5. after ``stall_generations`` generations without a new best, a *restart*: the next structured
   seed not descended yet (or, once they are used up, the best plan kicked by random swaps) is
   descended and joins the population.

Why ``soft`` (:class:`~potluck.coordinator.placement.costmodel.Score`): pipeline edges cost a *bottleneck*,
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

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from potluck.coordinator.placement.costmodel import CostModel, Placement, Score, Topology, canonical
from potluck.coordinator.placement.layouts import (  # noqa: F401  (places, segments_layout: for callers)
    Groups,
    blocks_layout,
    greedy_seeds,
    iter_segment_seeds,
    places,
    random_groups,
    rank_seeds,
    ranked_greedy_seeds,
    segment_seeds,
    segments_layout,
)
from potluck.coordinator.placement.moves import compute_resplits, crossover, mutate

PAIR_SWAPS = 1024  # per visit of a pair of groups in the local search: all of them up to R = 32
GUIDED_SWAPS = 64  # per visit of a pair, tried before the random ones: see _guided
RANDOM_TAIL = 16  # random swaps a visit tries after the guided ones, but in a cycle after a quiet one
SEED_SHARE = 0.25  # of a time budget, at most, for evaluating start layouts (a 1,024-device one costs ~0.1 s)


@dataclass(frozen=True)
class SearchResult:
    plan: Placement
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


class SearchRun:
    """Budget bookkeeping around one :class:`CostModel`; remembers the cheapest assignment seen."""

    def __init__(self, model: CostModel, budget_seconds: float | None, budget_evals: int | None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if budget_seconds is None and budget_evals is None:
            raise ValueError("give a time budget, an evaluation budget or both")
        self.model = model
        self.clock = clock
        self.start = clock()
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
        return self.evaluations >= self.max_evals or self.clock() >= self.deadline

    def score(self, groups: Groups, bound: float | None = None, smooth: float = 0.0,
              parent: Groups | None = None) -> Score | None:
        s = self.model.score(groups, bound, smooth, parent)
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
        seconds = self.clock() - self.start
        plan = self.model.plan(np.array(self.best[1]))
        return SearchResult(plan=plan, evaluations=self.evaluations, seconds=seconds,
                            evals_to_best=self.evals_to_best, stopped=stopped, generations=generations,
                            restarts=restarts, start_evaluations=starts, curve=self.curve)

    def stop_reason(self) -> str:
        return "evaluations" if self.evaluations >= self.max_evals else "seconds"


# ------------------------------------------------------------------ local search


def local_search(run: SearchRun, groups: Groups, score: Score, rng: np.random.Generator, smooth: float = 0.0,
                 max_evals: int | None = None, until: float = math.inf) -> tuple[Groups, Score]:
    """Cyclic Kernighan-Lin style descent over pairs of groups (and group/unused-pool pairs).

    For the current pair, try swapping each device of one side with each of the other, in random order;
    keep the first swap that lowers ``cost + smooth * soft``, and work on the pair until none does. Stops
    after a cycle of pairs without improvement, after ``max_evals`` evaluations, at ``until`` (the run's
    clock) or out of budget."""
    groups = list(groups)
    s = len(groups)
    stop_at = math.inf if max_evals is None else run.evaluations + max_evals

    def spent() -> bool:
        return run.evaluations >= stop_at or run.exhausted() or (until < math.inf and run.clock() >= until)

    unused = tuple(sorted(set(range(run.model.topology.devices)) - {d for g in groups for d in g}))
    quality = None if run.model.stage_time is None else run.model.pp_link.sum(axis=1)  # for compute_resplits
    pairs = [(i, j) for i in range(s) for j in range(i + 1, s)] + ([(i, -1) for i in range(s)] if unused else [])
    order = rng.permutation(len(pairs))
    quiet, k, thorough, guided = 0, 0, False, False
    while pairs and quiet < len(pairs) and not spent():
        i, j = pairs[order[k % len(pairs)]]
        k += 1
        improved, found = True, False
        tried: set[tuple[int, int]] = set()  # this visit's swaps, not guided again after a success
        for left, right in compute_resplits(run.model, quality, groups[i], groups[j]) if quality is not None and j >= 0 else ():
            trial = list(groups)
            trial[i], trial[j] = left, right
            new = run.score(trial, score.cost + smooth * score.soft, smooth)
            if new is not None and better(new, score, smooth):
                groups, score, found = trial, new, True
                break
        while improved and not spent():
            improved = False
            other = unused if j < 0 else groups[j]
            bound = score.cost + smooth * score.soft
            first = _guided(run.model, groups, i, j, other, tried)
            guided = guided or len(first) > 0
            limit = PAIR_SWAPS if thorough or not len(first) else len(first) + RANDOM_TAIL
            for x, y in _swaps(len(groups[i]), len(other), rng, first, limit):
                a, b = groups[i][x], other[y]
                tried.add((a, b))
                trial = list(groups)
                trial[i] = tuple(sorted(groups[i][:x] + groups[i][x + 1:] + (b,)))
                rest = tuple(sorted(other[:y] + other[y + 1:] + (a,)))
                if j >= 0:
                    trial[j] = rest
                new = run.score(trial, bound, smooth, parent=groups)
                if new is not None and better(new, score, smooth):
                    groups, score, improved, found = trial, new, True, True
                    if j < 0:
                        unused = rest
                    break
                if spent():
                    break
        quiet = 0 if found else quiet + 1
        thorough = thorough and not found
        if guided and not thorough and quiet == len(pairs):  # short visits found nothing: one long cycle
            thorough, quiet = True, 0
    return groups, score


def _swaps(n: int, m: int, rng: np.random.Generator, first: np.ndarray | None = None,
           limit: int = PAIR_SWAPS) -> list[tuple[int, int]]:
    """The swaps between two sides of ``n`` and ``m`` devices: the ``first`` ones (flat indices
    ``x * m + y``), then the others in random order; at most ``limit`` of them, so that with
    large groups (``R * R`` swaps a pair) one visit does not spend the whole budget on one pair
    while the others (and the unused devices) wait."""
    flat = rng.permutation(n * m)
    if first is not None and len(first):
        flat = np.concatenate([first, flat[~np.isin(flat, first)]])
    return [(int(f) // m, int(f) % m) for f in flat[:limit]]


def _guided(model: CostModel, groups: Groups, i: int, j: int, other: tuple[int, ...],
            tried: set[tuple[int, int]]) -> np.ndarray:
    """The ``GUIDED_SWAPS`` swaps of a pair that move the devices worst placed where they are to
    where they fit best, by :func:`misfit` (flat indices, best first; none with small groups, where
    the random order tries every swap anyway), but those ``tried`` already in this visit of the pair:
    a swap that just failed mostly fails again after another one succeeded, and the guided ones are
    dear to score (close calls: all their new pairs are solved before the bound rejects them). The
    costs are bottlenecks: a swap changes the cost only if it moves a device that makes one, and
    random swaps of ``R = 100`` groups rarely do."""
    n, m = len(groups[i]), len(other)
    if n * m <= PAIR_SWAPS:
        return np.empty(0, dtype=np.int64)
    rest = [g for k, g in enumerate(groups) if k not in (i, j)]
    side_i, side_o = np.asarray(groups[i]), np.asarray(other)
    cand = np.concatenate([side_i, side_o])
    here = misfit(model, groups[i], cand, rest)
    gain = here[:n, None] - here[None, n:]  # x leaves group i, y joins it
    if j >= 0:
        there = misfit(model, other, cand, rest)
        gain += there[None, n:] - there[:n, None]  # y leaves group j, x joins it
    ranked = np.argsort(-gain, axis=None, kind="stable")
    if tried:
        fresh = [f for f in ranked[: GUIDED_SWAPS + len(tried)].tolist() if (side_i[f // m], side_o[f % m]) not in tried]
        ranked = np.array(fresh, dtype=np.int64)
    return ranked[:GUIDED_SWAPS]


def misfit(model: CostModel, group: tuple[int, ...], cand: np.ndarray, rest: list[tuple[int, ...]]) -> np.ndarray:
    """How badly each device of ``cand`` sits (or would sit) in ``group``, relative to the group's worst
    member in each bottleneck term: its all-reduce sum with the members, its stage time, and its
    nearest pipeline link to each of the ``rest`` of the groups (the worst of those): 1 for a
    device that makes a bottleneck, above 1 for one that would make a worse one. ``cand`` holds the
    group's members (their worst is the scale) and the devices that might replace them."""
    idx = np.asarray(group)
    inside = np.isin(cand, idx)
    dp = model.dp_link.take(cand, axis=0).take(idx, axis=1).sum(axis=1)
    terms = [dp, model.stage_time[cand]] if model.stage_time is not None else [dp]
    if rest:
        rows = model.pp_link.take(cand, axis=0)
        terms.append(np.max([rows.take(np.asarray(g), axis=1).min(axis=1) for g in rest], axis=0))
    out = np.zeros(len(cand))
    for term in terms:
        worst = term[inside].max() if inside.any() else 0.0
        if worst > 0:
            out = np.maximum(out, term / worst)
    return out


# ------------------------------------------------------------------ searches


def evolutionary_search(topology: Topology, *, seed: int = 0, budget_seconds: float | None = 10.0,
                        budget_evals: int | None = None, population: int = 10, offspring: int = 2,
                        stall_generations: int = 10, stall_restarts: int = 5, mutation_swaps: int = 2,
                        smooth: float = 1.0,
                        local_search_evals: int | None = None, greedy: bool = True,
                        model: CostModel | None = None,
                        clock: Callable[[], float] = time.perf_counter) -> SearchResult:
    """DT-FM's hybrid genetic algorithm; see the module docstring.

    Children descend ``cost + smooth * soft`` (see :class:`Score`): the soft term keeps the
    bottleneck plateaus from stopping the descent early. The best assignment is always judged
    by ``cost`` alone, and once the search stalls, the best gets a final descent on ``cost``.
    ``model`` lets a caller pass a :class:`CostModel` with a previous plan and migration weight;
    ``clock`` is what ``budget_seconds`` counts (``time.process_time``: CPU seconds, which a box
    shared with other work does not steal).
    """
    model = model or CostModel(topology)
    rng = np.random.default_rng(seed)
    run = SearchRun(model, budget_seconds, budget_evals, clock)
    # Start layouts are built as they are evaluated: with SEED_SHARE of the time spent, the rest are
    # never built (at 1,024 devices, building them all can take longer than the search's budget).
    # The blocks layout and the greedy seeds are evaluated whatever the budget: a search starved of
    # CPU (a busy coordinator) returns at worst the greedy layout, not the blocks layout.
    seed_until = math.inf if budget_seconds is None else run.start + SEED_SHARE * budget_seconds
    floor = 3 if greedy else 1
    pop: list[tuple[Score, Groups]] = []
    built = 0
    for groups in _start_layouts(model, greedy):
        if built >= floor and (run.exhausted() or run.clock() >= seed_until):
            break
        built += 1
        pop.append((run.exact(groups), groups))
    for _ in range(max(0, population - built)):
        if run.exhausted():
            break
        groups = random_groups(topology, rng)
        pop.append((run.exact(groups), groups))
    seeded = run.evaluations
    # The structured seeds compete for the population's places: half go to the cheapest, half to
    # the cheapest on the smoothed objective (the starts a descent gets furthest from).
    by_cost = sorted(pop, key=lambda p: (p[0].cost, p[0].soft))
    by_key = sorted(pop, key=lambda p: _key(p[0], smooth))
    keep = max(population, 2)
    pop = list({tuple(g): (sc, g) for sc, g in by_cost[: keep // 2] + by_key[: keep - keep // 2]}.values())
    pop += [p for p in by_key if all(p[1] != g for _, g in pop)][: keep - len(pop)]
    # the cheapest on the smoothed objective first: the cheapest start is often a ranked layout whose
    # swaps are dear to score (they change bottlenecks). The two share what is left of the budget: at
    # 512-1,024 devices a descent never ends in it (its closing cycle of full visits alone is 10,000-
    # 29,000 evaluations, which keep next to nothing), so the first took it all; at 512 volunteers
    # (4 x 68) it went from 13.82 to 13.79 in 24,000 evaluations and the cheapest start (13.60, the
    # split rank seed) was never descended, against a reference that did (13.21).
    firsts = list({tuple(by_key[0][1]): by_key[0], tuple(by_cost[0][1]): by_cost[0]}.values())
    for k, start in enumerate(firsts):
        if run.exhausted():
            break
        share = 1.0 / (len(firsts) - k)
        until = run.clock() + share * (run.deadline - run.clock()) if run.deadline < math.inf else math.inf
        evals = share * (run.max_evals - run.evaluations) if run.max_evals < math.inf else math.inf
        evals = min(evals, math.inf if local_search_evals is None else local_search_evals)
        groups, score = local_search(run, start[1], start[0], rng, smooth,
                                     None if evals == math.inf else max(1, int(evals)), until)
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
            best_before = run.best[0]
            # every other restart descends on the cost alone: the smoothing that crosses plateaus
            # can also lead away from a plan that only plain swaps reach
            _restart(run, pop, starts, rng, smooth, smooth if restarts % 2 else 0.0, local_search_evals)
            restarts, stalled = restarts + 1, 0
            fruitless = 0 if better(run.best[0], best_before) else fruitless + 1
            continue
        generations += 1
        before = run.best[0] if run.best else None
        for _ in range(offspring):
            if run.exhausted():
                break
            a, b = _tournament(pop, rng, smooth), _tournament(pop, rng, smooth)
            child = crossover(a[1], b[1], topology, rng) if a is not b else a[1]
            child = mutate(child, topology, rng, mutation_swaps)
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


def _start_layouts(model: CostModel, greedy: bool) -> Iterator[Groups]:
    """The blocks layout, then (with ``greedy``) the greedy and the structured seeds, built lazily."""
    yield canonical(blocks_layout(model.topology))
    if greedy:
        yield from greedy_seeds(model)
        yield from rank_seeds(model)
        yield from ranked_greedy_seeds(model)
        yield from iter_segment_seeds(model)


def _restart(run: SearchRun, pop: list[tuple[Score, Groups]], starts: list[Groups], rng: np.random.Generator,
             smooth: float, descent_smooth: float, local_search_evals: int | None) -> None:
    """Descend (on ``cost + descent_smooth * soft``) from the next unused start, or from the best plan
    kicked by random swaps, and let the result replace the population's worst member if it is new."""
    assert run.best is not None
    topology = run.model.topology
    fresh = starts.pop(0) if starts else mutate(run.best[1], topology, rng, kick_swaps(topology))
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
                  budget_seconds: float | None = None, model: CostModel | None = None,
                  clock: Callable[[], float] = time.perf_counter) -> SearchResult:
    """Baseline: uniformly random assignments, keep the cheapest."""
    model = model or CostModel(topology)
    rng = np.random.default_rng(seed)
    run = SearchRun(model, budget_seconds, budget_evals, clock)
    run.exact(random_groups(topology, rng))
    while not run.exhausted():
        assert run.best is not None
        run.score(random_groups(topology, rng), bound=run.best[0].cost)
    return run.result(run.stop_reason())
