"""The scheduler with measured compute: does pricing each device's speed place a slow one where it hurts least?

Random WAN topologies (``coordinator/placement/topology.py``: devices on a plane, delay by distance, log-normal uplinks),
``--stages`` x ``--replicas`` tasklets on that many devices plus ``--spare`` more, all of one speed but one,
``--slow`` times slower (as a weaker GPU, or a peer measured 4x slower by its ``busy_s``). For each topology the
evolutionary search runs twice with the same budget and seed: once given the devices' speeds (what live
placement now feeds it, :func:`potluck.coordinator.placement.placement.compute_speeds`) and once without (what it did
before). Both plans are then priced by the cost model *with* the speeds, the swarm's real cost: the figure is
the ratio (aware / blind; <= 1 is at least as good) and how often the aware plan keeps the slow device out of
the grid when it can. Baseline (blind) and figure come from the same run.

The cost model prices compute in lockstep (a stage as slow as its slowest replica); with rounds as windows a
slow replica trains fewer steps instead of holding the others, so this is the conservative price. A real
pipeline swarm's tokens/s with and without it was not measured on this project's 2-core machines.

    python benchmarks/scheduler_compute.py [--topologies 20] [--stages 4] [--replicas 4] [--spare 2] [--slow 4]
"""

from __future__ import annotations

import json
import statistics
import sys

import numpy as np
from benchargs import bench_parser

from potluck.coordinator.placement.costmodel import CostModel, Topology
from potluck.coordinator.placement.scheduler import evolutionary_search
from potluck.coordinator.placement.topology import generate_random_topology


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--topologies", type=int, default=20)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--spare", type=int, default=2)
    parser.add_argument("--slow", type=float, default=4.0)
    parser.add_argument("--budget-s", type=float, default=1.0)
    parser.add_argument("--stage-seconds", type=float, default=2.0, help="one stage's compute per inner step on a "
                        "device of speed 1 (the topologies' links move a stage's activations in about 1-3 s)")
    args = parser.parse_args()
    n = args.stages * args.replicas + args.spare
    ratios, left_out, slow_cost, blind_cost = [], 0, [], []
    for seed in range(args.topologies):
        base = generate_random_topology(n, args.stages, args.replicas, seed, outer_every=50, with_compute=False)
        compute = np.ones(n)
        slow = seed % n
        compute[slow] = 1.0 / args.slow
        priced = Topology(delay_ms=base.delay_ms, bandwidth_gbps=base.bandwidth_gbps, stages=args.stages,
                          replicas=args.replicas, activation_gb=base.activation_gb, gradient_gb=base.gradient_gb,
                          outer_every=base.outer_every, compute=compute, stage_seconds=args.stage_seconds)
        truth = CostModel(priced)
        aware = evolutionary_search(priced, seed=seed, budget_seconds=args.budget_s, model=CostModel(priced)).plan
        blind = evolutionary_search(base, seed=seed, budget_seconds=args.budget_s).plan
        a = truth.plan(aware.stage_groups).cost
        b = truth.plan(blind.stage_groups).cost
        ratios.append(a / b)
        slow_cost.append(a)
        blind_cost.append(b)
        left_out += slow not in {d for group in aware.stage_groups for d in group}
    print(json.dumps({
        "benchmark": "scheduler_compute", "topologies": args.topologies, "stages": args.stages,
        "replicas": args.replicas, "devices": n, "slow_factor": args.slow, "budget_s": args.budget_s,
        "stage_seconds": args.stage_seconds,
        "cost_ratio_aware_vs_blind_mean": round(statistics.fmean(ratios), 4),
        "cost_ratio_aware_vs_blind_worst": round(max(ratios), 4),
        "cost_ratio_aware_vs_blind_best": round(min(ratios), 4),
        "slow_device_left_out": left_out, "target_ratio": 1.0,
        "cost_aware_mean_s": round(statistics.fmean(slow_cost), 4), "cost_blind_mean_s": round(statistics.fmean(blind_cost), 4),
    }))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
