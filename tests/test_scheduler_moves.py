"""Volunteer swarms, where a stage costs its slowest GPU: the rank seed whose two fastest groups are
split by stage time, the local search's compute re-splits of a pair of groups
(:func:`~potluck.coordinator.placement.moves.compute_resplits`), and the first two descents sharing the budget."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from test_scheduler_families import sf  # the benchmark module, loaded from its file

from potluck.coordinator.placement import scheduler
from potluck.coordinator.placement.costmodel import CostModel, Topology, check_assignment
from potluck.coordinator.placement.layouts import device_quality, rank_seeds
from potluck.coordinator.placement.moves import compute_resplits
from potluck.coordinator.placement.scheduler import SearchRun, local_search


def test_a_rank_seed_splits_the_two_fastest_groups_by_stage_time() -> None:
    """The ``2 R`` devices with the best links fill two groups, one holding the ``R`` slowest GPUs of
    them; no pipeline bottleneck moves, so the layout costs less than the one ranked by links alone."""
    t = sf.generate("volunteers", 512, 0).topology
    model = CostModel(t)
    seeds = rank_seeds(model)
    pp, _, stage = device_quality(model)
    fastest = np.argsort(pp, kind="stable")[: 2 * t.replicas]
    slow = set(fastest[np.argsort(-stage[fastest], kind="stable")][: t.replicas].tolist())
    split = [g for g in seeds if {tuple(sorted(slow)), tuple(sorted(set(fastest.tolist()) - slow))} <= set(g)]
    assert len(split) == 1
    check_assignment(t, np.array(split[0]))
    assert model.evaluate(np.array(split[0])) < model.evaluate(np.array(seeds[0]))


def test_compute_resplits_keep_the_worst_link_and_gather_slow_gpus() -> None:
    """Each re-split is a partition of the pair's devices into two groups of the same sizes; the group
    holding the pair's worst link keeps that device; one of them puts the slowest GPU of the pair
    and the fastest in different groups. Without compute speeds there are none."""
    t = sf.generate("volunteers", 256, 0).topology
    model = CostModel(t)
    quality = model.pp_link.sum(axis=1)
    rng = np.random.default_rng(0)
    for _ in range(20):
        devices = rng.permutation(t.devices)[: 2 * t.replicas]
        a, b = tuple(sorted(devices[: t.replicas].tolist())), tuple(sorted(devices[t.replicas:].tolist()))
        worst = int(devices[quality[devices].argmax()])
        splits = compute_resplits(model, quality, a, b)
        assert splits and all((x, y) != (a, b) for x, y in splits)
        for x, y in splits:
            assert len(x) == len(a) and len(y) == len(b) and sorted(x + y) == sorted(a + b)
            assert (worst in x) == (worst in a)
        slowest, quickest = devices[model.stage_time[devices].argmax()], devices[model.stage_time[devices].argmin()]
        assert any((slowest in x) != (quickest in x) for x, _ in splits)
    plain = Topology(delay_ms=t.delay_ms, bandwidth_gbps=t.bandwidth_gbps, stages=t.stages, replicas=t.replicas,
                     activation_gb=t.activation_gb, gradient_gb=t.gradient_gb)
    assert compute_resplits(CostModel(plain), quality, a, b) == []


def test_local_search_gathers_slow_gpus_in_one_group() -> None:
    """Two groups, links all alike, one slow GPU in each: only moving both slow GPUs into one group
    lowers the cost (a swap that moves one of them changes nothing: each group still holds one), and
    a descent with the re-splits finds it at once."""
    n, r = 8, 4
    delay = np.full((n, n), 10.0)
    np.fill_diagonal(delay, 0.0)
    compute = np.ones(n)
    compute[[0, 4]] = 0.25
    t = Topology(delay_ms=delay, bandwidth_gbps=np.full((n, n), 1.0), stages=2, replicas=r, activation_gb=0.1,
                 gradient_gb=0.1, compute=compute, stage_seconds=1.0)
    model = CostModel(t)
    start = [(0, 1, 2, 3), (4, 5, 6, 7)]
    run = SearchRun(model, None, 2, time.perf_counter)  # two evaluations: no swap gets a turn
    groups, score = local_search(run, start, model.score(start), np.random.default_rng(0), smooth=0.0)
    assert score.cost < model.score(start).cost - 2.0  # one stage at 1 s instead of 4 s
    assert any({0, 4} <= set(g) for g in groups)


def test_the_two_first_descents_share_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 512 volunteers the cheapest start and the cheapest on the smoothed objective differ, and a
    descent never ends in the budget: the first gets half of what is left, not all of it, so the
    second start is descended too."""
    t = sf.generate("volunteers", 512, 0).topology
    calls: list[tuple[int, int | None]] = []
    real = scheduler.local_search

    def spy(run: SearchRun, *args: Any, **kwargs: Any) -> Any:
        calls.append((run.evaluations, args[4] if len(args) > 4 else kwargs.get("max_evals")))
        return real(run, *args, **kwargs)

    monkeypatch.setattr(scheduler, "local_search", spy)
    result = scheduler.evolutionary_search(t, seed=0, budget_seconds=None, budget_evals=400)
    (first_at, first_cap), (second_at, _) = calls[:2]
    left = 400 - first_at
    assert first_cap is not None and first_cap <= left // 2 + 1
    assert second_at < 400 and result.evaluations <= 400 + 1
