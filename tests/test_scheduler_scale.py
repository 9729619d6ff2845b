"""The scheduler at volunteer scale: start layouts that keep whole pipelines inside places and hop to
the nearest place, partial sorts that agree with numpy's stable sort, a search that never spends more
than a quarter of its time on start layouts (a clock that ticks per call makes that exact), and the
``--scale`` mode of ``benchmarks/scheduler_families.py``."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from test_scheduler_families import sf  # the benchmark module, loaded from its file

from potluck.coordinator.placement.costmodel import (
    CostModel,
    Topology,
    bottleneck_matching_cost,
    canonical,
    check_assignment,
)
from potluck.coordinator.placement.layouts import (
    RANKED_GREEDY,
    chained_layout,
    device_quality,
    greedy_seeds,
    iter_segment_seeds,
    nearest_first,
    rank_seeds,
    ranked_greedy_seeds,
    segment_seeds,
)
from potluck.coordinator.placement.pairterms import PairTerms
from potluck.coordinator.placement.scheduler import (
    GUIDED_SWAPS,
    PAIR_SWAPS,
    RANDOM_TAIL,
    SEED_SHARE,
    SearchRun,
    evolutionary_search,
    local_search,
    misfit,
)


def _sites(sizes: list[int], km_apart: float = 1000.0, seed: int = 0) -> tuple[Topology, np.ndarray]:
    """Sites on a line, ``km_apart`` each from the next: fast inside a site, slower with distance."""
    site = np.repeat(np.arange(len(sizes)), sizes)
    rng = np.random.default_rng(seed)
    gap = np.abs(site[:, None] - site[None, :]) * km_apart / 200.0
    delay = np.where(site[:, None] == site[None, :], 0.01, 2.0 + gap) * (1 + 0.01 * rng.random((len(site),) * 2))
    delay = (delay + delay.T) / 2
    np.fill_diagonal(delay, 0.0)
    gbps = np.where(site[:, None] == site[None, :], 400.0, 1.0)
    return Topology(delay_ms=delay, bandwidth_gbps=gbps, stages=4, replicas=5, activation_gb=0.1,
                    gradient_gb=0.5, outer_every=50), site


def test_chained_layout_keeps_each_pipeline_in_one_site_when_it_fits() -> None:
    """Five 4-stage pipelines, sites of 8, 8, 4 and 2 GPUs: pipeline by pipeline, largest site first,
    every whole pipeline lands inside one site (two each in the 8s, one in the 4); the
    every-pipeline-first placement (segments_layout) does the same only by the tie-breaks' luck."""
    t, site = _sites([8, 8, 4, 2])
    members = [np.flatnonzero(site == s).tolist() for s in range(4)]
    groups = chained_layout(t, members, t.stages, False, CostModel(t).pp_link)
    flat = check_assignment(t, groups)
    plan = CostModel(t).plan(flat)
    assert all(len({int(site[d]) for d in p}) == 1 for p in plan.pipelines)


def test_chained_layout_hops_to_the_nearest_site() -> None:
    """2-stage segments, sites of 2 GPUs on a line: a pipeline's second segment goes to the site
    nearest its first (distance 1), never across the line."""
    t, site = _sites([2] * 10)
    members = [np.flatnonzero(site == s).tolist() for s in range(10)]
    groups = chained_layout(t, members, 2, True, CostModel(t).pp_link)
    plan = CostModel(t).plan(check_assignment(t, groups))
    for p in plan.pipelines:
        hops = [abs(int(site[a]) - int(site[b])) for a, b in itertools.pairwise(p)]
        assert max(hops) <= 1, (p, hops)


def test_segment_seeds_are_the_lazy_ones_and_valid() -> None:
    inst = sf.generate("regions", 128, 1)
    model = CostModel(inst.topology)
    seeds = segment_seeds(model)
    assert seeds == list(iter_segment_seeds(model))
    assert len({tuple(g) for g in seeds}) == len(seeds)
    for groups in seeds:
        check_assignment(inst.topology, groups)


def test_nearest_is_numpys_stable_argsort() -> None:
    """The partial sort behind the greedy clusters picks the same neighbours, in the same order, as a
    stable full sort, ties included (spot_mix swarms are full of exactly equal links)."""
    rng = np.random.default_rng(3)
    for trial in range(200):
        rows = rng.integers(1, 12)
        cols = rng.integers(1, 30)
        x = rng.integers(0, 3, (rows, cols)).astype(float) if trial % 2 else rng.random((rows, cols))
        size = int(rng.integers(1, cols + 1))
        want = np.argsort(x, axis=1, kind="stable")[:, :size]
        assert np.array_equal(nearest_first(x, size), want)


class TickClock:
    """A clock that advances ``step`` seconds every time it is read: a time budget becomes a count
    of reads, the same on any box."""

    def __init__(self, step: float) -> None:
        self.now, self.step, self.reads = 0.0, step, 0

    def __call__(self) -> float:
        self.now += self.step
        self.reads += 1
        return self.now


def test_start_layouts_get_at_most_a_quarter_of_the_time() -> None:
    """A 256-device swarm with dozens of start layouts: with a time budget, evaluating them stops once
    SEED_SHARE of it is gone (the rest are never built), and the search still returns a plan no worse
    than the blocks layout and the greedy seeds it evaluated first."""
    inst = sf.generate("regions", 256, 2)
    t = inst.topology
    total = len(list(iter_segment_seeds(CostModel(t)))) + len(rank_seeds(CostModel(t))) + 3
    clock = TickClock(0.01)
    result = evolutionary_search(t, seed=0, budget_seconds=1.0, clock=clock)
    assert 3 <= result.start_evaluations < total
    assert result.start_evaluations <= SEED_SHARE / 0.01 + 1
    model = CostModel(t)
    assert result.plan.cost <= min(model.evaluate(np.array(g)) for g in greedy_seeds(model)) + 1e-12


def test_a_starved_search_still_returns_the_greedy_layout() -> None:
    """A clock already past the budget at its first read (a coordinator starved of CPU): the blocks
    layout and the two greedy seeds are evaluated anyway, and the cheapest of them comes back."""
    t = sf.generate("volunteers", 128, 0).topology
    result = evolutionary_search(t, seed=0, budget_seconds=1.0, clock=TickClock(100.0))
    assert result.start_evaluations == 3 and result.stopped == "seconds"
    model = CostModel(t)
    assert result.plan.cost == pytest.approx(min(model.evaluate(np.array(g)) for g in greedy_seeds(model)), rel=1e-12)


def test_scale_job_shapes_use_half_the_devices_or_more() -> None:
    for devices in (256, 512, 1024):
        for seed in range(20):
            s, r = sf.scale_job_shape(devices, np.random.default_rng(seed))
            assert 2 <= s <= 16 and devices // 2 - s < s * r <= devices


def test_scale_mode_prints_one_json_line_per_size(capsys: pytest.CaptureFixture[str]) -> None:
    """Budgets in CPU seconds (the child process gets the clock too): the figure a shared box can give."""
    sf.main(["--scale", "--sizes", "256", "--seeds", "1", "--budget", "0.05", "--long-factor", "2",
             "--clock", "cpu"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["mode"] == "scale" and out["devices"] == 256 and out["instances"] == 1 and out["clock"] == "cpu"
    assert out["worst_regret"] >= 0 and out["greedy_worst_regret"] >= 0  # 50 ms may not reach the greedy seeds
    row = out["rows"][0]
    assert row["family"] == "volunteers" and row["stages"] * row["replicas"] >= 128
    assert row["rss_peak_mb"] is None or row["rss_peak_mb"] > 0


def test_rank_seeds_leave_the_slowest_devices_unused_and_gather_slow_with_slow() -> None:
    """Volunteers: the quality-ranked seeds are valid and distinct; the first leaves unused the devices
    with the slowest mean pipeline link and puts consecutive ranks in one group; and the best of them
    beats the greedy seeds (one slow device taxes every edge of its group, wherever it is)."""
    t = sf.generate("volunteers", 512, 0).topology
    model = CostModel(t)
    seeds = rank_seeds(model)
    assert 1 <= len(seeds) <= 4 and len({tuple(g) for g in seeds}) == len(seeds)
    for g in seeds:
        check_assignment(t, np.array(g))
    mean_link = model.pp_link.sum(axis=1)
    used = np.array(seeds[0]).ravel()
    assert mean_link[np.setdiff1d(np.arange(t.devices), used)].min() >= mean_link[used].max()
    spans = sorted((mean_link[list(g)].min(), mean_link[list(g)].max()) for g in seeds[0])
    assert all(hi <= lo for (_, hi), (lo, _) in itertools.pairwise(spans))
    greedy = min(model.evaluate(np.array(g)) for g in greedy_seeds(model))
    assert min(model.evaluate(np.array(g)) for g in seeds) < 0.95 * greedy


def test_bottleneck_hints_never_change_the_answer() -> None:
    """A hint (an entry, a value between entries, outside the range, the lower bound) only orders the
    search: the bottleneck and the min-sum are exactly those found without one."""
    rng = np.random.default_rng(5)
    for trial in range(300):
        n = int(rng.integers(1, 12))
        m = rng.integers(0, 8, (n, n)).astype(float) if trial % 2 else rng.random((n, n))
        want = bottleneck_matching_cost(m)
        for hint in (*rng.choice(m.ravel(), 3), float(rng.random() * 8), -1.0, 99.0, want[0], m.min()):
            assert bottleneck_matching_cost(m, hint=float(hint)) == want
            assert bottleneck_matching_cost(m, max(m.min(axis=0).max(), m.min(axis=1).max()), float(hint)) == want


def _random_swap(groups: list[tuple[int, ...]], devices: int, rng: np.random.Generator) -> list[tuple[int, ...]]:
    """One swap of two devices of two groups, or of a device with an unused one."""
    flat = np.array(groups)
    unused = np.setdiff1d(np.arange(devices), flat)
    i = int(rng.integers(len(flat)))
    k = int(rng.integers(flat.shape[1]))
    if len(unused) and rng.random() < 0.3:
        flat[i, k] = unused[rng.integers(len(unused))]
    else:
        j = (i + 1 + int(rng.integers(len(flat) - 1))) % len(flat)
        m = int(rng.integers(flat.shape[1]))
        flat[i, k], flat[j, m] = flat[j, m], flat[i, k]
    return canonical(flat)


def test_guided_visits_are_short_until_a_cycle_of_them_finds_nothing_then_one_cycle_is_full() -> None:
    """R = 33 (1,089 swaps a pair: guided) on links all alike, where no swap is ever better: the one
    pair's first visit scores the guided swaps and RANDOM_TAIL random ones, the next (after that quiet
    cycle) PAIR_SWAPS, and then the descent ends."""
    n = 66
    t = Topology(delay_ms=np.ones((n, n)), bandwidth_gbps=np.ones((n, n)), stages=2, replicas=33,
                 activation_gb=0.1, gradient_gb=0.1)
    run = SearchRun(CostModel(t), None, 10**6)
    groups = canonical(np.arange(n).reshape(2, 33))
    local_search(run, groups, run.exact(groups), np.random.default_rng(0), smooth=1.0)
    assert run.evaluations == 1 + (GUIDED_SWAPS + RANDOM_TAIL) + PAIR_SWAPS


@pytest.mark.parametrize("family,devices,seed", [("volunteers", 256, 0), ("world", 256, 1), ("regions", 64, 2)])
def test_a_swap_scored_from_its_parent_equals_the_full_score(family: str, devices: int, seed: int) -> None:
    """Golden: a swap scored with its parent (whose pairs' bottlenecks seed the new pairs' searches,
    whose duals bound their min-sums) gets exactly the score of a model that saw the same
    assignments without parents, with and without a bound, or is pruned only where that score
    exceeds the bound; and, unpruned, a fresh model's score (to rounding: a model with cached pairs
    sums the min-sums in another order)."""
    t = sf.generate(family, devices, seed).topology
    rng = np.random.default_rng(seed)
    model, plain = CostModel(t), CostModel(t)
    groups = canonical(rng.permutation(t.devices)[: t.stages * t.replicas].reshape(t.stages, t.replicas))
    start = model.score(groups)
    assert start is not None and plain.score(groups) == start
    for _ in range(25):
        trial = _random_swap(groups, t.devices, rng)
        bound = None if rng.random() < 0.3 else (start.cost + start.soft) * float(rng.uniform(0.99, 1.01))
        got, want = model.score(trial, bound, 1.0, parent=groups), plain.score(trial, bound, 1.0)
        assert got == want or (got is None and bound is not None and (want is None or sum(want) > bound))
        fresh = CostModel(t).score(trial)
        assert fresh is not None and (got is None or got == pytest.approx(fresh, rel=1e-12))
        if got is not None and rng.random() < 0.5:
            groups, start = trial, got


def test_misfit_is_one_for_a_bottleneck_member_and_relative_to_the_worst_member_per_term() -> None:
    """The local search tries first the swaps that move a device making a bottleneck of its group
    (misfit 1) for one that would sit better: per term (all-reduce sum with the members, stage time,
    nearest link to each other group, the worst of those), relative to the group's worst member."""
    t = sf.generate("volunteers", 256, 0).topology
    model = CostModel(t)
    groups = canonical(np.arange(t.stages * t.replicas).reshape(t.stages, t.replicas))
    members = np.asarray(groups[0])
    outsiders = np.setdiff1d(np.arange(t.devices), np.array(groups).ravel())
    fit = misfit(model, groups[0], np.concatenate([members, outsiders]), list(groups[1:]))
    assert fit[: len(members)].max() == pytest.approx(1.0) and (fit[: len(members)] <= 1.0 + 1e-12).all()

    def terms(d: int) -> list[float]:
        near = max(min(model.pp_link[d, e] for e in g) for g in groups[1:])
        return [sum(model.dp_link[d, e] for e in members), model.stage_time[d], near]

    worst = np.max([terms(int(d)) for d in members], axis=0)
    for d, got in zip(outsiders, fit[len(members):], strict=True):
        assert got == pytest.approx(max(np.array(terms(int(d))) / worst), rel=1e-9)


def test_ranked_greedy_seeds_cluster_only_the_best_ranked_devices() -> None:
    """Sites of GPUs with uneven uplinks and speeds: the greedy seeds built from the best-ranked
    devices use only those, are valid, and beat the greedy seeds over all devices; with no device to
    spare (every device a tasklet) there are none."""
    t = sf.generate("world", 1024, 1).topology
    model = CostModel(t)
    seeds = list(ranked_greedy_seeds(model))
    assert len(seeds) == 2 * len(RANKED_GREEDY)
    for g in seeds:
        check_assignment(t, np.array(g))
    kept = int(t.stages * t.replicas * RANKED_GREEDY[0][1])
    best = set(np.argsort(device_quality(model)[RANKED_GREEDY[0][0]], kind="stable")[:kept].tolist())
    assert all(set(d for g in seed for d in g) <= best for seed in seeds[:2])
    greedy = min(model.evaluate(np.array(g)) for g in greedy_seeds(model))
    assert min(model.evaluate(np.array(g)) for g in seeds) < 0.95 * greedy
    full = Topology(delay_ms=t.delay_ms[:20, :20], bandwidth_gbps=t.bandwidth_gbps[:20, :20], stages=4, replicas=5,
                    activation_gb=0.1, gradient_gb=0.5)
    assert list(ranked_greedy_seeds(CostModel(full))) == []


def test_a_search_with_guided_swaps_is_reproducible_under_an_evaluation_budget() -> None:
    """R = 79: the local search guides its swaps (misfit, kept rows, bottleneck hints); the same seed and
    evaluation budget still give the same plan along the same improvement curve."""
    t = sf.generate("world", 512, 1).topology
    runs = [evolutionary_search(t, seed=3, budget_seconds=None, budget_evals=300) for _ in range(2)]
    assert runs[0].curve == runs[1].curve and runs[0].plan.stage_groups == runs[1].plan.stage_groups


@pytest.mark.parametrize("family,devices,seed", [("volunteers", 256, 0), ("world", 256, 1), ("regions", 64, 2)])
def test_a_swap_bounded_from_its_parent_has_the_exact_bottlenecks_and_a_min_sum_below(
        family: str, devices: int, seed: int) -> None:
    """Golden: for the new pairs of a swap, :meth:`PairTerms.bottlenecks` gives exactly the bottlenecks
    of :func:`bottleneck_matching_cost` and :meth:`PairTerms.min_sums_below` a lower bound on the summed min-sums; so a swap they
    rejects is never one the full score would accept."""
    t = sf.generate(family, devices, seed).topology
    rng = np.random.default_rng(seed)
    pairs = PairTerms(CostModel(t).pp_link, limit=10_000, rows_kept=t.stages + 2)
    groups = canonical(rng.permutation(t.devices)[: t.stages * t.replicas].reshape(t.stages, t.replicas))
    for step in range(40):
        trial = _random_swap(groups, t.devices, rng)
        pairs.keep_rows(groups)
        _, cached, missing = pairs.cached(trial)
        if not missing:
            continue
        blocks = pairs.blocks([key for _, _, key in missing])
        lower = np.maximum(blocks.min(axis=2).max(axis=1), blocks.min(axis=1).max(axis=1))
        low, uppers = pairs.min_sums_below(trial, groups, missing, blocks)
        exact = pairs.bottlenecks(groups, missing, blocks, lower, uppers)
        want = [bottleneck_matching_cost(b) for b in blocks]
        assert exact.tolist() == [w[0] for w in want]
        assert low <= sum(w[1] for w in want)
        assert sum(w[1] for w in want) - low <= 0.5 * sum(w[1] for w in want)  # a bound worth having
        if step % 3 == 0:
            groups = trial
