"""Tasklet scheduler: how far the evolutionary search lands from the best known plan, per family of swarm.

For every family, size and seed it generates one topology and job shape, runs
:func:`~potluck.coordinator.placement.scheduler.evolutionary_search` for ``--budget`` seconds (a fresh
cost model, as ``potluck schedule`` does) and compares its cost with a *reference* found in the
same run, in ``--long-factor`` times the budget, as the best cost of:

* the blocks layout and the two greedy seeds (``greedy``, also the baseline: ``greedy_*``);
* hand-made layouts from the structure the generator built and the search never sees
  (:func:`placed_layouts`, polished by a swap descent): ``placed``;
* :func:`random_search`, for a tenth of the time;
* restarts of the evolutionary search with other seeds and settings (default, no greedy seeds,
  a larger population with more patience) for the rest, sharing one cost model's caches;
* the run under test itself, if it beats all of these (``short_run``: a sign of a weak reference);
* for instances small enough (at most ``EXACT_LIMIT`` assignments, e.g. 8 devices into 2 x 3),
  instead of all that, the exact optimum, by enumerating every way to pick and split the devices.

Per family it prints the mean and worst regret (``cost / reference - 1``) and
``seed_unchanged_but_worse``: the share of instances where the search returned one of its start
layouts unchanged (``evals_to_best <= start_evaluations``: the blocks layout, the greedy and
structured seeds and the random starts, evaluated before any search) although the reference is
better. ``searches_only_*``
is the regret against the searches alone (no hand-made layouts, no enumeration): where it is far
below the regret, the evolutionary search cannot find those plans even with 100 times the time.
The families take turns, instance by instance, so that a burst of load on a shared box spreads
over all of them; ``median_evaluations`` tells how much searching a budget bought.

Target (issue #15): worst regret <= 2 % per family and mean <= 0.5 %.

The families (device ids shuffled, so that no layout can lean on their order; ms, Gbit/s, GB):

* ``datacenter``: 8-GPU boxes, NVLink-like inside, a datacenter fabric between boxes;
* ``spot_mix``: 2/4/8-GPU boxes holding 25-60 % of the GPUs, the rest single GPUs, all joined by
  ONE uniform slower link (the kind of swarm issue #15 reports);
* ``two_dc``: two such data centres joined by a slower wide-area link;
* ``regions``: 3-6 regions of boxes of 1-8 GPUs; each region its own LAN, each pair its own WAN link;
* ``world``: sites of 1-8 GPUs on the globe, delay ~ distance, bandwidth the slower site uplink,
  worn down with distance; one GPU speed per site;
* ``volunteers``: single GPUs with their own access bandwidth and latency: a link is as fast as
  the slower end, its delay both access latencies plus distance; mixed GPU speeds.

Sizes of 8 devices or fewer get tiny job shapes, solved exactly. A full run at the defaults takes
days; ``--quick`` is the CI smoke run (under a minute).

``--scale`` (issue #30): volunteer swarms of 256, 512 and 1,024 devices, job shapes of 2-16 stages
using 50-100 % of the devices (:func:`scale_job_shape`), instance ``i`` of a size from family
``SCALE_FAMILIES[i % 3]`` (volunteers, world, regions), 2 per size by default (about 12 minutes),
the reference 10 budgets long. The search under test runs in a child process, which reports its
peak RSS growth (``search_rss_growth_mb``) and its CPU seconds. One JSON line per size, with the
baselines (greedy seeds, blocks layout) measured in the same run. ``--clock cpu`` counts budgets in
CPU seconds, for a box shared with other work, where 10 wall seconds can be a fraction of a core.

    python benchmarks/scheduler_families.py [--families spot_mix,world] [--seeds 10]
        [--sizes 8,16,32,64,128] [--budget 10] [--long-factor 100] [--quick]
    python benchmarks/scheduler_families.py --scale [--sizes 256,512,1024] [--seeds 2] [--clock cpu]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from scheduler_swarms import FAMILIES, SCALE_FROM, Instance, Swarm, generate, job_shape, scale_job_shape  # noqa: F401  (benchmarks/ is on the path of a script run from it)

from potluck.coordinator.placement.costmodel import CostModel, Topology, canonical, plan_cost
from potluck.coordinator.placement.scheduler import (
    Groups,
    blocks_layout,
    evolutionary_search,
    greedy_seeds,
    random_search,
    segments_layout,
)

TARGET_WORST = 0.02
TARGET_MEAN = 0.005
EXACT_LIMIT = 20_000  # assignments; one evaluation is some 50 us
MAX_RESTARTS = 6  # of the reference's evolutionary runs; small instances stall in milliseconds
RANDOM_EVALS = 20_000  # random search's share ends at this or at its time, whichever comes first
SOLVED = 1e-9  # relative cost difference below which two plans count as equally good
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
SCALE_FAMILIES = ("volunteers", "world", "regions")  # --scale: instance i of a size is of family i % 3

def assignment_count(t: Topology) -> int:
    """Ways to pick ``S * R`` devices and split them into ``S`` unordered groups of ``R``."""
    k = t.stages * t.replicas
    return math.comb(t.devices, k) * math.factorial(k) // (math.factorial(t.replicas) ** t.stages
                                                           * math.factorial(t.stages))


def _splits(items: tuple[int, ...], size: int) -> Iterator[list[tuple[int, ...]]]:
    """Every split of ``items`` into unordered groups of ``size``: the first item's group first."""
    if not items:
        yield []
        return
    for rest in itertools.combinations(items[1:], size - 1):
        group = (items[0], *rest)
        left = tuple(d for d in items[1:] if d not in rest)
        for tail in _splits(left, size):
            yield [group, *tail]


def exact_optimum(t: Topology) -> float:
    """The cheapest assignment by enumeration: every subset of devices, every split of it."""
    model = CostModel(t)
    best, arg = math.inf, None
    for used in itertools.combinations(range(t.devices), t.stages * t.replicas):
        for groups in _splits(used, t.replicas):
            score = model.score(groups)
            assert score is not None  # no bound, no pruning
            if score.cost < best:
                best, arg = score.cost, groups
    return plan_cost(t, np.array(arg)).cost


def placed_layouts(t: Topology, places: list[np.ndarray]) -> list[Groups]:
    """Hand-made layouts from the structure a generator built (the search never sees it).

    A pipeline edge is as slow as its slowest replica's hop, so it is fast only if *every* replica
    crosses it inside a place. Hence, for each segment length ``k``: cut every pipeline into
    segments of ``k`` consecutive stages at the same stage boundaries, and put each segment inside
    one place where one fits (smallest or largest place first). And one group per place, for
    all-reduces that stay inside.
    """
    out = []
    for label in places:
        members = [np.flatnonzero(label == p).tolist() for p in np.unique(label)]
        for k in range(1, t.stages + 1):
            out += [segments_layout(t, members, k, smallest) for smallest in (True, False)]
        out.append(segments_layout(t, members, 1, True, by_group=True))
    return out


def descend(model: CostModel, groups: Groups, deadline: float, rng: np.random.Generator,
            clock: Callable[[], float] = time.perf_counter) -> float:
    """First-improvement descent on the cost alone: swap two devices of two groups, or one device
    with an unused one, in random order, until no swap helps or time is up. Returns the cost."""
    s, r = model.topology.stages, model.topology.replicas
    flat = np.array(groups)
    unused = np.setdiff1d(np.arange(model.topology.devices), flat)
    best = model.evaluate(flat)
    improved = True
    while improved and clock() < deadline:
        improved = False
        cells = [(g, i) for g in range(s) for i in range(r)]
        partners = cells + [(-1, u) for u in range(len(unused))]
        swaps = itertools.product(rng.permutation(cells).tolist(), rng.permutation(partners).tolist())
        for (g, i), (h, j) in swaps:
            if h == g or clock() >= deadline:
                continue
            trial = flat.copy()
            if h < 0:
                trial[g, i] = unused[j]
            else:
                trial[g, i], trial[h, j] = flat[h, j], flat[g, i]
            cost = model.evaluate(trial)
            if cost < best * (1 - SOLVED):
                if h < 0:
                    unused[j] = flat[g, i]
                flat, best, improved = trial, cost, True
                break
    return best


def long_reference(instance: Instance, seconds: float, seed: int,
                   clock: Callable[[], float] = time.perf_counter) -> tuple[dict[str, float], int]:
    """The best cost of each method within ``seconds`` in all, and how many evolutionary runs.

    A tenth of the time goes to the hand-made layouts (each built layout evaluated, the best few
    then polished by :func:`descend`), a tenth to random search, the rest to evolutionary runs.
    """
    t = instance.topology
    start, model, rng = clock(), CostModel(t), np.random.default_rng(seed + 1)
    starts = [canonical(blocks_layout(t)), *greedy_seeds(model)]
    found = {"greedy": min(model.evaluate(np.array(g)) for g in starts)}
    placed = sorted(placed_layouts(t, instance.places), key=lambda g: model.evaluate(np.array(g)))
    if placed:
        found["placed"] = model.evaluate(np.array(placed[0]))
        for groups in placed[:3]:
            polish = start + seconds / 10 * (placed.index(groups) + 1) / 3
            found["placed"] = min(found["placed"], descend(model, groups, polish, rng, clock))
    found["random"] = random_search(t, seed=seed + 1, budget_evals=RANDOM_EVALS, budget_seconds=seconds / 10,
                                    model=model, clock=clock).plan.cost
    variants: list[tuple[str, dict[str, Any]]] = [
        ("evolutionary", {}), ("evolutionary_no_greedy", {"greedy": False}),
        ("evolutionary_patient", {"population": 20, "stall_generations": 30})]
    deadline = start + seconds
    restarts = 0
    while restarts < MAX_RESTARTS and (left := deadline - clock()) > 0.01:
        name, kwargs = variants[restarts % len(variants)]
        run = evolutionary_search(t, seed=seed + 1000 + restarts, budget_seconds=min(left, seconds * 0.3),
                                  model=model, clock=clock, **kwargs)
        found[name] = min(found.get(name, math.inf), run.plan.cost)
        restarts += 1
    return found, restarts


# ------------------------------------------------------------------ measurement


def measure(family: str, devices: int, seed: int, budget: float, long_factor: float) -> dict[str, Any]:
    instance = generate(family, devices, seed)
    t = instance.topology
    run = evolutionary_search(t, seed=seed, budget_seconds=budget)
    found, restarts = long_reference(instance, budget * long_factor, seed)
    method = min(found, key=lambda k: found[k])
    long_cost, cost = found[method], run.plan.cost
    searched = min(v for k, v in found.items() if k != "placed")
    exact = exact_optimum(t) if assignment_count(t) <= EXACT_LIMIT else None
    if exact is not None:
        assert min(cost, long_cost) >= exact * (1 - SOLVED), "a search beat the enumeration"
        reference, method = exact, "exact"
    elif cost < long_cost * (1 - SOLVED):
        reference, method = cost, "short_run"
    else:
        reference = min(cost, long_cost)
    return {"family": family, "devices": devices, "seed": seed, "stages": t.stages, "replicas": t.replicas,
            "outer_every": t.outer_every, "cost": cost, "reference": reference,
            "regret": cost / reference - 1, "greedy_regret": found["greedy"] / reference - 1,
            "regret_vs_searches": cost / min(cost, searched) - 1,
            "evals_to_best": run.evals_to_best, "evaluations": run.evaluations,
            "seconds": round(run.seconds, 3), "stopped": run.stopped,
            "seed_unchanged": run.evals_to_best <= run.start_evaluations, "reference_method": method,
            "restarts_under_test": run.restarts,
            "exact": exact is not None,
            "long_run_missed_exact": exact is not None and long_cost > exact * (1 + SOLVED),
            "restarts": restarts}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    regret = [r["regret"] for r in rows]
    worst = max(rows, key=lambda r: r["regret"])
    stuck = [r for r in rows if r["seed_unchanged"] and r["regret"] > SOLVED]
    by_size: dict[str, dict[str, float]] = {}
    for n in sorted({r["devices"] for r in rows}):
        mine = [r["regret"] for r in rows if r["devices"] == n]
        by_size[str(n)] = {"mean_regret": statistics.fmean(mine), "worst_regret": max(mine)}
    methods: dict[str, int] = {}
    for r in rows:
        methods[r["reference_method"]] = methods.get(r["reference_method"], 0) + 1
    mean = statistics.fmean(regret)
    return {
        "instances": len(rows), "mean_regret": mean, "worst_regret": worst["regret"],
        "meets_targets": mean <= TARGET_MEAN and worst["regret"] <= TARGET_WORST,
        "over_2pct": sum(x > TARGET_WORST for x in regret),
        "seed_unchanged_but_worse": len(stuck) / len(rows), "seed_unchanged_but_worse_count": len(stuck),
        "solved": sum(x <= SOLVED for x in regret),
        "greedy_mean_regret": statistics.fmean(r["greedy_regret"] for r in rows),
        "greedy_worst_regret": max(r["greedy_regret"] for r in rows),
        "searches_only_mean_regret": statistics.fmean(r["regret_vs_searches"] for r in rows),
        "searches_only_worst_regret": max(r["regret_vs_searches"] for r in rows),
        "median_evaluations": statistics.median(r["evaluations"] for r in rows),
        "median_evals_to_best": statistics.median(r["evals_to_best"] for r in rows),
        "by_size": by_size, "reference_methods": methods,
        "exact_instances": sum(r["exact"] for r in rows),
        "long_run_missed_exact": sum(r["long_run_missed_exact"] for r in rows),
        "worst": {k: worst[k] for k in ("devices", "seed", "stages", "replicas", "outer_every", "cost",
                                        "reference", "evals_to_best", "evaluations", "reference_method")},
    }


# ------------------------------------------------------------------ scale (--scale)


def _rss_mb(field: str) -> float | None:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process in MB, from ``/proc`` (``None`` elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def search_child(family: str, devices: int, seed: int, budget: float, clock: str) -> dict[str, Any]:
    """The search under test, as ``potluck schedule`` runs it, in a fresh process of its own: its
    memory is not mixed with the reference's caches, and the peak RSS is reset (``clear_refs``) after
    the instance is built, so ``rss_peak_mb - rss_before_mb`` is what the search itself added."""
    t = generate(family, devices, seed).topology
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    before, cpu = _rss_mb("VmRSS"), time.process_time()
    run = evolutionary_search(t, seed=seed, budget_seconds=budget, clock=CLOCKS[clock])
    return {"cpu_seconds": round(time.process_time() - cpu, 3), "cost": run.plan.cost, "evaluations": run.evaluations, "evals_to_best": run.evals_to_best,
            "seconds": round(run.seconds, 3), "stopped": run.stopped, "generations": run.generations,
            "restarts": run.restarts, "rss_before_mb": before, "rss_peak_mb": _rss_mb("VmHWM"),
            "peak_reset": reset}


def measure_scale(family: str, devices: int, seed: int, budget: float, long_factor: float,
                  clock: str) -> dict[str, Any]:
    """One large instance: the search under test in a child process (:func:`search_child`), then the
    reference (:func:`long_reference`, ``long_factor`` budgets) here; the baselines are the blocks
    layout and the greedy seeds, evaluated in the same run."""
    done = subprocess.run([sys.executable, __file__, "--search-child", family, str(devices), str(seed), str(budget),
                           "--clock", clock],
                          capture_output=True, text=True, check=True)
    child = json.loads(done.stdout.strip().splitlines()[-1])
    instance = generate(family, devices, seed)
    t = instance.topology
    found, restarts = long_reference(instance, budget * long_factor, seed, CLOCKS[clock])
    method = min(found, key=lambda k: found[k])
    cost = child["cost"]
    reference = min(cost, found[method])
    growth = None if child["rss_peak_mb"] is None else child["rss_peak_mb"] - child["rss_before_mb"]
    return {"family": family, "devices": devices, "seed": seed, "stages": t.stages, "replicas": t.replicas,
            "outer_every": t.outer_every, "cost": cost, "reference": reference, "regret": cost / reference - 1,
            "reference_method": method if found[method] <= cost else "short_run",
            "greedy_regret": found["greedy"] / reference - 1,
            "blocks_over_search": CostModel(t).evaluate(blocks_layout(t)) / cost,
            "reference_restarts": restarts, "search_rss_growth_mb": growth,
            **{k: child[k] for k in ("evaluations", "evals_to_best", "seconds", "cpu_seconds", "stopped", "generations",
                                     "restarts", "rss_peak_mb", "peak_reset")}}


def summarize_scale(devices: int, rows: list[dict[str, Any]], budget: float, long_factor: float,
                    clock: str) -> dict[str, Any]:
    """The JSON line of one size."""
    regret = [r["regret"] for r in rows]
    growth = [r["search_rss_growth_mb"] for r in rows if r["search_rss_growth_mb"] is not None]
    return {
        "benchmark": "scheduler_families", "mode": "scale", "devices": devices, "instances": len(rows),
        "clock": clock, "budget_seconds": budget, "reference_seconds": budget * long_factor,
        "mean_regret": statistics.fmean(regret), "worst_regret": max(regret),
        "meets_worst_target": max(regret) <= TARGET_WORST,
        "greedy_mean_regret": statistics.fmean(r["greedy_regret"] for r in rows),
        "greedy_worst_regret": max(r["greedy_regret"] for r in rows),
        "blocks_over_search_min": min(r["blocks_over_search"] for r in rows),
        "search_seconds_max": max(r["seconds"] for r in rows),
        "search_cpu_seconds_min": min(r["cpu_seconds"] for r in rows),
        "search_rss_growth_mb_max": max(growth) if growth else None,
        "search_rss_peak_mb_max": max((r["rss_peak_mb"] or 0.0) for r in rows),
        "median_evaluations": statistics.median(r["evaluations"] for r in rows),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "rows": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items() if k != "devices"}
                 for r in rows],
    }


def main_scale(sizes: list[int], instances: int, budget: float, long_factor: float, clock: str) -> None:
    """One JSON line per size; instance ``i`` of a size is of family ``SCALE_FAMILIES[i % 3]``, seed ``i``."""
    for devices in sizes:
        rows = []
        for i in range(instances):
            family = SCALE_FAMILIES[i % len(SCALE_FAMILIES)]
            row = measure_scale(family, devices, i, budget, long_factor, clock)
            rows.append(row)
            print(f"[scheduler_families scale {family} n={devices} seed={i}] S={row['stages']} R={row['replicas']} "
                  f"regret={row['regret']:.4f} greedy_regret={row['greedy_regret']:.4f} "
                  f"evals={row['evaluations']} rss+={row['search_rss_growth_mb']}", file=sys.stderr, flush=True)
        print(json.dumps(summarize_scale(devices, rows, budget, long_factor, clock)), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES),
                   help="comma-separated, of: " + ", ".join(FAMILIES))
    p.add_argument("--seeds", type=int, default=None, help="instances per size and family (--scale: per size); "
                   "default 10 (--scale: 2)")
    p.add_argument("--sizes", default=None, help="device counts, comma-separated; default 8,16,32,64,128 "
                   "(--scale: 256,512,1024)")
    p.add_argument("--budget", type=float, default=10.0, help="seconds for the search under test")
    p.add_argument("--long-factor", type=float, default=None,
                   help="the reference gets this many budgets; default 100 (--scale: 10)")
    p.add_argument("--quick", action="store_true",
                   help="CI smoke run: 2 seeds, budget 0.2 s, long factor 10, sizes 8,16")
    p.add_argument("--scale", action="store_true",
                   help="volunteer swarms: one JSON line per size, with the search's memory")
    p.add_argument("--clock", choices=list(CLOCKS), default="wall",
                   help="what --budget counts (--scale): wall seconds, or CPU seconds of this process")
    p.add_argument("--search-child", nargs=4, metavar=("FAMILY", "DEVICES", "SEED", "BUDGET"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.search_child:
        family, devices, seed, budget = args.search_child
        print(json.dumps(search_child(family, int(devices), int(seed), float(budget), args.clock)))
        return
    if args.quick:
        args.seeds, args.budget, args.long_factor, args.sizes = 2, 0.2, 10.0, "8,16"
    if args.scale:
        sizes = [int(s) for s in (args.sizes or "256,512,1024").split(",")]
        if min(sizes) < SCALE_FROM:
            p.error(f"--scale: every size must be >= {SCALE_FROM} devices")
        main_scale(sizes, args.seeds or 2, args.budget, args.long_factor or 10.0, args.clock)
        return
    args.seeds, args.long_factor = args.seeds or 10, args.long_factor or 100.0
    args.sizes = args.sizes or "8,16,32,64,128"
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        p.error(f"unknown famil{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                f"choose from {', '.join(FAMILIES)}")
    sizes = [int(s) for s in args.sizes.split(",")]
    if min(sizes) < 6:
        p.error("--sizes: every size must be >= 6 devices")
    start = time.perf_counter()
    rows: dict[str, list[dict[str, Any]]] = {f: [] for f in families}
    for devices, seed, family in itertools.product(sizes, range(args.seeds), families):
        row = measure(family, devices, seed, args.budget, args.long_factor)
        rows[family].append(row)
        print(f"[scheduler_families {family} n={devices} seed={seed}] S={row['stages']} R={row['replicas']} "
              f"H={row['outer_every']} regret={row['regret']:.4f} evals_to_best={row['evals_to_best']} "
              f"evals={row['evaluations']} ref={row['reference_method']}", file=sys.stderr, flush=True)
    out = {
        "benchmark": "scheduler_families",
        "settings": {"families": families, "sizes": sizes, "seeds": args.seeds, "budget_seconds": args.budget,
                     "long_factor": args.long_factor, "quick": args.quick, "exact_limit": EXACT_LIMIT,
                     "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "targets": {"worst_regret": TARGET_WORST, "mean_regret": TARGET_MEAN},
        "families": {f: summarize(r) for f, r in rows.items()},
        "overall": summarize([r for f in families for r in rows[f]]),
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
