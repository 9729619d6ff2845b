"""The tasklet scheduler: costs against an independent brute-force reference and a stored golden
fixture, topology validation, and the search (reproducible, finds the per-region layout, beats
random search), end to end through the command line."""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from potluck.coordinator.placement.costmodel import (
    CostModel,
    HeldKarp,
    Topology,
    TopologyError,
    bottleneck_matching_cost,
    heuristic_path,
    plan_cost,
)
from potluck.coordinator.placement.schedule_cli import register
from potluck.coordinator.placement.scheduler import blocks_layout, evolutionary_search, random_search
from potluck.coordinator.placement.topology import (
    generate_geo_topology,
    generate_random_topology,
    is_region_layout,
)

FIXTURE = Path(__file__).parent / "fixtures" / "scheduler_golden.json"
TERMS = ("cost", "dp_cost", "pp_cost", "compute_cost", "migration_cost")


# ---------------------------------------------------------------- independent reference


def reference_cost(topo: dict, assignment: list[list[int]], previous: list[list[int]] | None = None,
                   weight: float = 0.0) -> dict:
    """DT-FM's cost by brute force, written from the formulas and nothing else: every perfect
    matching between two groups (permutations), every order of the groups (permutations)."""
    delay = np.array(topo["delay_ms"], dtype=float) / 1000.0
    bw = np.array(topo["bandwidth_gbps"], dtype=float)
    s, r = topo["stages"], topo["replicas"]
    c_pp, c_dp, h = topo["activation_gb"], topo["gradient_gb"], topo.get("outer_every", 1)

    def pp_link(d: int, e: int) -> float:  # activations forward, gradients back: the slower direction
        return max(delay[d, e] + 8 * c_pp / bw[d, e], delay[e, d] + 8 * c_pp / bw[e, d])

    def dp_group(group: list[int]) -> float:
        return max(sum(2 * (delay[d, e] + 8 * c_dp / (len(group) * bw[d, e])) for e in group if e != d)
                   for d in group)

    def bottleneck(a: list[int], b: list[int]) -> float:
        return min(max(pp_link(a[i], b[p[i]]) for i in range(r)) for p in itertools.permutations(range(r)))

    edge = {(i, j): bottleneck(assignment[i], assignment[j]) for i in range(s) for j in range(s) if i != j}

    def moved(order: tuple[int, ...]) -> float:
        if previous is None:
            return 0.0
        was = {d: k for k, row in enumerate(previous) for d in row}
        return weight * sum(was.get(d) != k for k, g in enumerate(order) for d in assignment[g])

    def path(order: tuple[int, ...]) -> float:
        return sum(edge[a, b] for a, b in itertools.pairwise(order))

    order = min(itertools.permutations(range(s)), key=lambda o: 2 * path(o) + moved(o))
    dp = max(dp_group(g) for g in assignment)
    compute = 0.0
    if topo.get("compute") is not None:
        speed = topo["compute"]
        compute = sum(max(topo.get("stage_seconds", 1.0) / speed[d] for d in g) for g in assignment)
    pp, mig = path(order), moved(order)
    return {"cost": dp / h + 2 * pp + compute + mig, "dp_cost": dp, "pp_cost": pp, "compute_cost": compute,
            "migration_cost": mig}


def hand_made_cases() -> list[dict]:
    rng = np.random.default_rng(7)

    def topo(n: int, s: int, r: int, h: int = 1, compute: bool = False) -> dict:
        delay = rng.integers(1, 120, (n, n)).astype(float)  # asymmetric on purpose
        bw = rng.choice([0.25, 0.5, 1.0, 2.0, 10.0], (n, n))
        np.fill_diagonal(delay, 0.0)
        out = {"delay_ms": delay.tolist(), "bandwidth_gbps": bw.tolist(), "stages": s, "replicas": r,
               "activation_gb": 0.125, "gradient_gb": 0.5, "outer_every": h}
        if compute:
            out["compute"] = rng.choice([0.5, 1.0, 2.0], n).tolist()
            out["stage_seconds"] = 0.25
        return out

    cases = []
    shapes = [("3x2", topo(6, 3, 2)), ("3x2 spare device, H=4", topo(7, 3, 2, h=4)),
              ("4x2 with compute", topo(9, 4, 2, compute=True)), ("2x3", topo(6, 2, 3)),
              ("R=1: no all-reduce", topo(5, 4, 1)), ("S=1: no pipeline", topo(4, 1, 3))]
    for name, t in shapes:
        n, s, r = len(t["delay_ms"]), t["stages"], t["replicas"]
        for k in range(2):
            a = rng.permutation(n)[: s * r].reshape(s, r).tolist()
            cases.append({"name": f"{name} #{k}", "topology": t, "assignment": a})
    t = shapes[2][1]
    prev = rng.permutation(9)[:8].reshape(4, 2).tolist()
    cases.append({"name": "4x2 migration", "topology": t, "assignment": prev[1:] + prev[:1], "previous": prev,
                  "migration_weight": 0.3})
    cases.append({"name": "4x2 migration, unchanged", "topology": t, "assignment": prev, "previous": prev,
                  "migration_weight": 5.0})
    for case in cases:
        case["expected"] = reference_cost(case["topology"], case["assignment"], case.get("previous"),
                                          case.get("migration_weight", 0.0))
    return cases


def write_fixture() -> None:  # python -c "import tests.test_scheduler as t; t.write_fixture()"
    lines = ",\n  ".join(json.dumps(case) for case in hand_made_cases())
    FIXTURE.write_text('{"cases": [\n  ' + lines + "\n]}\n")


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(FIXTURE.read_text())


def test_fixture_matches_reference(golden: dict) -> None:
    fresh = hand_made_cases()
    assert [c["name"] for c in fresh] == [c["name"] for c in golden["cases"]]
    for got, want in zip(fresh, golden["cases"], strict=True):
        assert got["assignment"] == want["assignment"]
        for term in TERMS:
            assert got["expected"][term] == pytest.approx(want["expected"][term], rel=1e-12), want["name"]


def test_costs_equal_golden(golden: dict) -> None:
    for case in golden["cases"]:
        topo = Topology.from_json(case["topology"])
        plan = plan_cost(topo, case["assignment"], case.get("previous"), case.get("migration_weight", 0.0))
        for term in TERMS:
            assert getattr(plan, term) == pytest.approx(case["expected"][term], rel=1e-12, abs=1e-12), \
                (case["name"], term)


def test_plan_pipelines_realise_the_cost(golden: dict) -> None:
    """The printed pipelines are a real plan: stage groups are the assignment's rows, and hopping
    along each pipeline costs exactly pp_cost (the matchings achieve the bottlenecks)."""
    for case in golden["cases"]:
        t = case["topology"]
        topo = Topology.from_json(t)
        plan = plan_cost(topo, case["assignment"])
        assert sorted(map(sorted, plan.stage_groups)) == sorted(map(sorted, case["assignment"]))
        assert [[p[s] for p in plan.pipelines] for s in range(topo.stages)] == plan.stage_groups
        delay, bw = np.array(t["delay_ms"]) / 1000.0, np.array(t["bandwidth_gbps"])
        link = delay + 8 * t["activation_gb"] / bw
        link = np.maximum(link, link.T)
        hops = sum(max(link[p[k], p[k + 1]] for p in plan.pipelines) for k in range(topo.stages - 1))
        assert hops == pytest.approx(plan.pp_cost, rel=1e-12)


def test_bottleneck_and_paths_against_brute_force() -> None:
    rng = np.random.default_rng(3)
    for _ in range(60):
        n = int(rng.integers(1, 6))
        m = rng.integers(0, 6, (n, n)).astype(float)  # small integers: many ties
        want = min(max(m[i, p[i]] for i in range(n)) for p in itertools.permutations(range(n)))
        assert bottleneck_matching_cost(m)[0] == want

    def cost(p: tuple[int, ...], d: np.ndarray, node: np.ndarray) -> float:
        return sum(d[a, b] for a, b in itertools.pairwise(p)) + sum(node[g, k] for k, g in enumerate(p))

    for n in (1, 2, 5, 7):
        d = rng.random((n, n))
        d = d + d.T
        node = rng.random((n, n))
        want = min(cost(p, d, node) for p in itertools.permutations(range(n)))
        got, path = HeldKarp(n).solve(d, node)
        assert got == pytest.approx(want) and cost(tuple(path), d, node) == pytest.approx(want)
        approx, path = heuristic_path(d, node)
        assert approx >= want - 1e-12 and cost(tuple(path), d, node) == pytest.approx(approx)


# ---------------------------------------------------------------- validation


def valid() -> dict:
    return {"delay_ms": [[0, 10, 20], [10, 0, 5], [20, 5, 0]], "bandwidth_gbps": [[0, 1, 1], [1, 0, 2], [1, 2, 0]],
            "stages": 1, "replicas": 3, "activation_gb": 0.1, "gradient_gb": 0.2}


@pytest.mark.parametrize("change,field", [
    ({"delay_ms": [[0, 1], [1, 0], [2, 2]]}, "delay_ms"),
    ({"delay_ms": [[0, 1, 2], [1, 0]]}, "delay_ms"),
    ({"bandwidth_gbps": [[0, 1], [1, 0]]}, "bandwidth_gbps"),
    ({"stages": 2}, "stages * replicas"),
    ({"bandwidth_gbps": [[0, 1, 1], [0, 0, 2], [1, 2, 0]]}, "bandwidth_gbps"),
    ({"bandwidth_gbps": [[0, 1, 1], [1, 0, -2], [1, 2, 0]]}, "bandwidth_gbps"),
    ({"delay_ms": [[0, 10, float("nan")], [10, 0, 5], [20, 5, 0]]}, "delay_ms"),
    ({"bandwidth_gbps": [[0, 1, float("inf")], [1, 0, 2], [1, 2, 0]]}, "bandwidth_gbps"),
    ({"delay_ms": [[0, -1, 20], [10, 0, 5], [20, 5, 0]]}, "delay_ms"),
    ({"delay_ms": [[0, "x", 20], [10, 0, 5], [20, 5, 0]]}, "delay_ms"),
    ({"stages": 0}, "stages"),
    ({"replicas": 1.5}, "replicas"),
    ({"stages": True}, "stages"),
    ({"stages": "1"}, "stages"),
    ({"outer_every": 0}, "outer_every"),
    ({"activation_gb": float("nan")}, "activation_gb"),
    ({"gradient_gb": -1}, "gradient_gb"),
    ({"compute": [1, 2]}, "compute"),
    ({"compute": [1, 0, 2]}, "compute"),
])
def test_bad_topologies_name_the_field(change: dict, field: str) -> None:
    with pytest.raises(TopologyError, match=field.replace("*", r"\*")):
        Topology.from_json({**valid(), **change})


def test_missing_fields_and_bad_assignments() -> None:
    with pytest.raises(TopologyError, match="gradient_gb"):
        Topology.from_json({k: v for k, v in valid().items() if k != "gradient_gb"})
    with pytest.raises(TopologyError, match="JSON object"):
        Topology.from_json([1, 2])
    topo = Topology.from_json({**valid(), "future_field": "ignored"})
    assert Topology.from_json(topo.to_json()).to_json() == topo.to_json()
    for bad in ([[0, 1, 1]], [[0, 1]], [[0, 1, 3]], [[0.0, 1.0, 2.0]]):
        with pytest.raises(TopologyError, match="assignment"):
            CostModel(topo).evaluate(bad)


# ---------------------------------------------------------------- search


def test_search_is_reproducible_with_a_seed() -> None:
    topo = generate_random_topology(16, 4, 3, seed=5)
    runs = [evolutionary_search(topo, seed=11, budget_seconds=None, budget_evals=600) for _ in range(2)]
    assert runs[0].plan == runs[1].plan
    assert runs[0].curve == runs[1].curve and runs[0].evaluations == runs[1].evaluations == 600


@pytest.mark.parametrize("greedy", [True, False])
def test_search_finds_one_pipeline_per_region(greedy: bool) -> None:
    topo = generate_geo_topology(regions=4, per_region=4, stages=4, replicas=4, seed=2)
    result = evolutionary_search(topo, seed=0, budget_seconds=None, budget_evals=1500, greedy=greedy)
    assert is_region_layout(result.plan.pipelines, per_region=4)
    assert result.plan.cost < plan_cost(topo, blocks_layout(topo)).cost


def test_search_beats_random_search_at_equal_evaluations() -> None:
    topo = generate_random_topology(24, 4, 5, seed=1)
    evo = evolutionary_search(topo, seed=0, budget_seconds=None, budget_evals=800)
    rnd = random_search(topo, seed=0, budget_evals=800)
    assert evo.evaluations == rnd.evaluations == 800
    assert evo.plan.cost < rnd.plan.cost


def test_migration_weight_keeps_the_previous_plan() -> None:
    topo = generate_random_topology(12, 3, 3, seed=4)
    previous = plan_cost(topo, np.arange(9).reshape(3, 3)).stage_groups
    model = CostModel(topo, previous=previous, migration_weight=1e3)
    result = evolutionary_search(topo, seed=0, budget_seconds=None, budget_evals=300, model=model)
    assert result.plan.migration_cost == 0.0
    assert sorted(map(sorted, result.plan.stage_groups)) == sorted(map(sorted, previous))


# ---------------------------------------------------------------- command line


def schedule(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "potluck.coordinator.placement.schedule_cli", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_prints_one_json_plan(tmp_path: Path) -> None:
    topo = generate_geo_topology(regions=3, per_region=3, stages=3, replicas=3, seed=1)
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(topo.to_json()))
    done = schedule("--topology", str(path), "--seed", "3", "--budget-evals", "300")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    for key in ("cost", "dp_cost", "pp_cost", "stage_groups", "pipelines", "evaluations", "seconds"):
        assert key in out
    assert out["evaluations"] == 300
    assert [[p[s] for p in out["pipelines"]] for s in range(3)] == out["stage_groups"]
    assert sorted(d for g in out["stage_groups"] for d in g) == list(range(9))
    assert out["cost"] == pytest.approx(plan_cost(topo, out["stage_groups"]).cost)


def test_cli_rejects_bad_files_with_status_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**valid(), "bandwidth_gbps": [[0, 1, 1], [1, 0, 0], [1, 2, 0]]}))
    done = schedule("--topology", str(bad))
    assert done.returncode == 2
    assert done.stderr.startswith("potluck schedule: ") and "bandwidth_gbps" in done.stderr
    assert done.stdout == ""
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    done = schedule("--topology", str(garbage))
    assert done.returncode == 2 and "not JSON" in done.stderr


def test_register_adds_the_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="potluck")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["schedule", "--topology", str(tmp_path / "missing.json")])
    assert args.fn(args) == 2
    assert "potluck schedule: cannot read" in capsys.readouterr().err
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(valid()))
    args = parser.parse_args(["schedule", "--topology", str(path), "--budget-evals", "20"])
    assert args.fn(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(out["pipelines"]) == [[0], [1], [2]] and out["evaluations"] == 20


def test_structured_seeds_find_the_boxes_and_keep_segments_inside_them() -> None:
    """Two 4-GPU boxes (fast inside) and four single GPUs, all joined by one slow link: the places are
    read off the links alone, and a seed keeps each 2-stage segment of every pipeline inside a box --
    what the search's greedy seed alone never reached on this kind of swarm."""
    from potluck.coordinator.placement.costmodel import CostModel, Topology, plan_cost
    from potluck.coordinator.placement.scheduler import evolutionary_search, places, segment_seeds

    box = np.repeat([0, 0, 0, 0, 1, 1, 1, 1, 2, 3, 4, 5], 1)
    same = box[:, None] == box[None, :]
    delay, bandwidth = np.where(same, 0.01, 20.0), np.where(same, 400.0, 1.0)
    t = Topology(delay_ms=delay, bandwidth_gbps=bandwidth, stages=4, replicas=2, activation_gb=0.1, gradient_gb=0.5,
                 outer_every=50)
    found = places(CostModel(t).pp_link)
    assert [sorted(map(sorted, g)) for g in found][0][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    seeds = segment_seeds(CostModel(t))
    inside = [g for g in seeds if all(len({int(box[d]) for d in (g[s][r], g[s + 1][r])}) == 1
                                      for s in (0, 2) for r in range(2))]
    assert inside, "no seed keeps the 2-stage segments inside boxes"
    result = evolutionary_search(t, seed=0, budget_evals=400)
    assert result.plan.cost <= min(plan_cost(t, np.array(g)).cost for g in seeds) + 1e-12


def test_path_lower_bound_never_exceeds_the_exact_path() -> None:
    """The pruning bound (a minimum spanning tree, plus each node's cheapest position) is a lower bound
    of Held-Karp's exact open path on random matrices, and equal to it on a line."""
    from potluck.coordinator.placement.costmodel import HeldKarp, path_lower_bound

    rng = np.random.default_rng(0)
    for n in (2, 3, 5, 8):
        hk = HeldKarp(n)
        for _ in range(30):
            d = rng.uniform(0, 10, (n, n))
            d = d + d.T
            np.fill_diagonal(d, 0)
            node = rng.uniform(0, 3, (n, n))
            assert path_lower_bound(d) <= hk.solve(d, want_path=False)[0] + 1e-9
            assert path_lower_bound(d, node) <= hk.solve(d, node, want_path=False)[0] + 1e-9
    x = np.arange(6.0)
    line = np.abs(x[:, None] - x[None, :])
    assert path_lower_bound(line) == pytest.approx(HeldKarp(6).solve(line)[0]) == pytest.approx(5.0)


def test_power_mean_lies_between_mean_and_max_and_rewards_gathering() -> None:
    from potluck.coordinator.placement.costmodel import power_mean

    rng = np.random.default_rng(1)
    for _ in range(50):
        x = rng.uniform(0, 5, int(rng.integers(1, 20)))
        ref = float(np.mean(x ** 8) ** (1 / 8))  # the textbook formula, unscaled
        assert power_mean(x) == pytest.approx(ref, rel=1e-9)
        assert x.mean() - 1e-12 <= power_mean(x) <= x.max() + 1e-12
    assert power_mean(np.zeros(3)) == 0.0 and power_mean(np.array([])) == 0.0
    slow, fast = 0.7, 0.25  # 9 slow devices over two groups of 16: gathering them lowers the sum
    split = power_mean(np.array([slow] * 5 + [fast] * 11)) + power_mean(np.array([slow] * 4 + [fast] * 12))
    gathered = power_mean(np.array([slow] * 6 + [fast] * 10)) + power_mean(np.array([slow] * 3 + [fast] * 13))
    assert gathered < split


def test_places_are_nested_and_see_boxes_through_jitter() -> None:
    """Two data centres of 8-GPU boxes: NVLink inside a box, a jittered fabric inside a data centre, a
    slow link between: the groupings nest, and both the boxes and the data centres are among them."""
    from potluck.coordinator.placement.costmodel import CostModel, Topology
    from potluck.coordinator.placement.scheduler import places

    rng = np.random.default_rng(2)
    dc, box = np.repeat([0, 1], 16), np.repeat(np.arange(4), 8)
    delay = np.where(box[:, None] == box[None, :], 0.01, np.where(dc[:, None] == dc[None, :], 0.05, 20.0))
    noise = np.triu(rng.uniform(-0.05, 0.05, delay.shape), 1)
    gbps = np.where(box[:, None] == box[None, :], 1000.0, np.where(dc[:, None] == dc[None, :], 100.0, 5.0))
    gbps = gbps * (1 + noise + noise.T)
    t = Topology(delay_ms=delay, bandwidth_gbps=gbps, stages=4, replicas=8, activation_gb=0.1, gradient_gb=0.5)
    found = places(CostModel(t).pp_link)
    as_sets = [sorted(sorted(g) for g in level) for level in found]
    assert sorted(np.flatnonzero(box == b).tolist() for b in range(4)) in as_sets
    assert sorted(np.flatnonzero(dc == d).tolist() for d in range(2)) in as_sets
    for fine, coarse in zip(found, found[1:], strict=False):  # finest first, each inside the next
        assert all(any(set(g) <= set(c) for c in coarse) for g in fine)


def test_a_solved_swarm_stops_early_and_a_time_budget_buys_restarts() -> None:
    """Restarts replace stopping on a plateau, but a small swarm whose restarts find nothing new stops
    ("stalled") long before a generous budget is spent; a reproducible run stays reproducible."""
    from potluck.coordinator.placement.scheduler import evolutionary_search

    t = generate_random_topology(8, 2, 2, seed=4)
    result = evolutionary_search(t, seed=0, budget_seconds=30.0)
    assert result.stopped == "stalled" and result.seconds < 5.0 and result.restarts >= 1
    t = generate_random_topology(24, 4, 5, seed=1)
    a = evolutionary_search(t, seed=3, budget_seconds=None, budget_evals=3000)
    b = evolutionary_search(t, seed=3, budget_seconds=None, budget_evals=3000)
    assert (a.plan.cost, a.evaluations, a.restarts, a.plan.pipelines) == (b.plan.cost, b.evaluations, b.restarts,
                                                                          b.plan.pipelines)
