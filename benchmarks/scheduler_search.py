"""Tasklet scheduler: the evolutionary search against random search and the blocks layout.

Prints one JSON line per generated topology, all measured in this run:

* ``evolutionary``: cost, evaluations, seconds, evaluations until its best, and the best cost
  as evaluations grow (``curve``, subsampled), under a time budget;
* ``evolutionary_no_greedy``: the same without the two greedy seeds (blocks + random start only),
  to show what the genetic algorithm does by itself;
* ``random``: random search given exactly as many evaluations as the evolutionary run used;
* ``blocks_cost``: devices ``0..R-1`` on stage 0 and so on, i.e. no scheduler at all;
* ``ratio_vs_random`` = evolutionary cost / random cost (lower is better), and for geo topologies
  ``region_layout_cost`` (one pipeline per region) and ``found_region_layout``.

Target: on 8 regions x 8 GPUs, S=8, R=8, find one pipeline per region within 10 s on one core.

    python benchmarks/scheduler_search.py [--budget-seconds 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from potluck.coordinator.placement.costmodel import Topology, plan_cost
from potluck.coordinator.placement.scheduler import blocks_layout, evolutionary_search, random_search
from potluck.coordinator.placement.topology import (
    generate_geo_topology,
    generate_random_topology,
    is_region_layout,
)


def topologies(seed: int) -> list[tuple[str, Topology, int | None]]:
    """``(name, topology, devices per region or None)``."""
    return [
        ("geo 8x8 S=8 R=8 H=1", generate_geo_topology(8, 8, 8, 8, seed=seed, outer_every=1), 8),
        ("geo 8x8 S=8 R=8 H=50", generate_geo_topology(8, 8, 8, 8, seed=seed, outer_every=50), 8),
        ("geo 8x8 S=8 R=8 H=50 jitter=0.2", generate_geo_topology(8, 8, 8, 8, seed=seed, outer_every=50,
                                                                  jitter=0.2), 8),
        ("geo 4x4 S=4 R=4 H=1", generate_geo_topology(4, 4, 4, 4, seed=seed, outer_every=1), 4),
        ("random 48 devices S=6 R=6 H=10 compute", generate_random_topology(48, 6, 6, seed=seed, outer_every=10),
         None),
    ]


def measure(name: str, topo: Topology, per_region: int | None, budget_seconds: float, seed: int) -> dict[str, Any]:
    evo = evolutionary_search(topo, seed=seed, budget_seconds=budget_seconds)
    bare = evolutionary_search(topo, seed=seed, budget_seconds=budget_seconds, greedy=False)
    rnd = random_search(topo, seed=seed, budget_evals=evo.evaluations)
    out: dict[str, Any] = {
        "topology": name, "devices": topo.devices, "stages": topo.stages, "replicas": topo.replicas,
        "outer_every": topo.outer_every, "budget_seconds": budget_seconds,
        "evolutionary": evo.to_json(), "evolutionary_no_greedy": bare.to_json(), "random": rnd.to_json(),
        "blocks_cost": plan_cost(topo, blocks_layout(topo)).cost,
        "ratio_vs_random": evo.plan.cost / rnd.plan.cost,
    }
    if per_region is not None:
        regions = topo.devices // per_region
        region = np.arange(regions * per_region).reshape(regions, per_region)[:, : topo.stages].T
        out["region_layout_cost"] = plan_cost(topo, region[:, : topo.replicas]).cost
        out["found_region_layout"] = is_region_layout(evo.plan.pipelines, per_region)
        out["no_greedy_found_region_layout"] = is_region_layout(bare.plan.pipelines, per_region)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-seconds", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for name, topo, per_region in topologies(args.seed):
        print(json.dumps(measure(name, topo, per_region, args.budget_seconds, args.seed)), flush=True)


if __name__ == "__main__":
    main()
