"""The generators and references of ``benchmarks/scheduler_families.py``: valid, seeded topologies
with the structure each family promises, and an exact optimum that agrees with brute force."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from potluck.coordinator.placement.costmodel import CostModel, check_assignment, plan_cost
from potluck.coordinator.placement.scheduler import evolutionary_search


def _load() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "scheduler_families.py"
    if str(path.parent) not in sys.path:  # (it imports its swarms from beside it, as a script run from there does)
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("scheduler_families", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sf = _load()
sw = sys.modules["scheduler_swarms"]  # its swarms, imported by it from beside it
BOXED = [f for f in sf.FAMILIES if f != "volunteers"]


@pytest.mark.parametrize("family", list(sf.FAMILIES))
@pytest.mark.parametrize("devices", [8, 16, 37, 128])
def test_instances_are_valid_and_seeded(family: str, devices: int) -> None:
    a, b = sf.generate(family, devices, 0), sf.generate(family, devices, 0)
    t = a.topology
    assert t.devices == devices and t.stages * t.replicas <= devices
    assert np.array_equal(t.delay_ms, b.topology.delay_ms)
    assert np.array_equal(t.bandwidth_gbps, b.topology.bandwidth_gbps)
    assert np.allclose(t.delay_ms, t.delay_ms.T) and np.allclose(t.bandwidth_gbps, t.bandwidth_gbps.T)
    assert not np.array_equal(t.bandwidth_gbps, sf.generate(family, devices, 1).topology.bandwidth_gbps)
    for label in a.places:
        assert label.shape == (devices,)


@pytest.mark.parametrize("family", BOXED)
def test_box_links_are_the_fast_ones(family: str) -> None:
    """Devices of a box (finest place) talk with the box delay; every other link is slower."""
    inst = sf.generate(family, 64, 3)
    box = inst.places[0]
    same = (box[:, None] == box[None, :]) & ~np.eye(64, dtype=bool)
    other = box[:, None] != box[None, :]
    assert np.allclose(inst.topology.delay_ms[same], sw.BOX_DELAY_MS)
    assert inst.topology.delay_ms[other].min() > sw.BOX_DELAY_MS
    assert inst.topology.bandwidth_gbps[same].min() >= sw.BOX_GBPS[0]


def test_spot_mix_joins_everything_else_by_one_link() -> None:
    inst = sf.generate("spot_mix", 64, 0)
    box = inst.places[0]
    other = box[:, None] != box[None, :]
    assert len(np.unique(inst.topology.delay_ms[other])) == 1
    assert len(np.unique(inst.topology.bandwidth_gbps[other])) == 1
    sizes = np.bincount(box)
    assert 0.25 * 64 - 8 < sizes[sizes > 1].sum() <= 0.6 * 64  # multi-GPU boxes, plus single GPUs
    assert (sizes == 1).sum() >= 64 * 0.4


def test_volunteer_link_is_as_fast_as_its_slower_end() -> None:
    t = sf.generate("volunteers", 32, 0).topology
    access = t.bandwidth_gbps.max(axis=1)
    off = ~np.eye(32, dtype=bool)
    assert np.allclose(t.bandwidth_gbps[off], np.minimum(access[:, None], access[None, :])[off])
    assert t.compute is not None and len(np.unique(t.compute)) == 32


def test_job_shapes_fit_and_sometimes_leave_devices_over() -> None:
    left_over = set()
    for devices in range(6, 131):
        for seed in range(4):
            s, r = sf.job_shape(devices, np.random.default_rng(seed))
            assert 2 <= s and 2 <= r and s * r <= devices
            if devices <= 8:
                assert s * r < devices
            left_over.add(s * r < devices)
    assert left_over == {True, False}


def test_exact_optimum_matches_brute_force() -> None:
    inst = sf.generate("regions", 7, 2)
    t = inst.topology
    k = t.stages * t.replicas
    brute = min(plan_cost(t, np.array(p[:k]).reshape(t.stages, t.replicas)).cost
                for p in itertools.permutations(range(t.devices)))
    assert sf.exact_optimum(t) == pytest.approx(brute, rel=1e-12)
    used = itertools.combinations(range(t.devices), k)
    splits = sum(1 for chosen in used for _ in sf._splits(chosen, t.replicas))
    assert splits == sf.assignment_count(t)
    assert evolutionary_search(t, seed=0, budget_evals=500).plan.cost >= brute * (1 - 1e-12)


@pytest.mark.parametrize("family", BOXED)
def test_placed_layouts_are_assignments(family: str) -> None:
    inst = sf.generate(family, 37, 0)
    layouts = sf.placed_layouts(inst.topology, inst.places)
    assert layouts
    model = CostModel(inst.topology)
    for groups in layouts:
        check_assignment(inst.topology, groups)
    best = min(layouts, key=lambda g: model.evaluate(np.array(g)))
    polished = sf.descend(model, best, time.perf_counter() + 0.2, np.random.default_rng(0))
    assert polished <= model.evaluate(np.array(best))


def test_prints_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    sf.main(["--families", "spot_mix,volunteers", "--sizes", "8", "--seeds", "1", "--budget", "0.05",
             "--long-factor", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out["families"]) == {"spot_mix", "volunteers"}
    for fam in out["families"].values():
        assert fam["instances"] == 1 and fam["exact_instances"] == 1 and fam["worst_regret"] >= 0
    assert out["targets"] == {"worst_regret": 0.02, "mean_regret": 0.005}
