"""Synthetic topologies for tests and benchmarks of the tasklet scheduler.

Real swarms are measured (pings and transfers); these stand in for them with known structure, so
a test can say what a good plan looks like: in a geo topology, one pipeline per region.
"""

from __future__ import annotations

import numpy as np

from potluck.coordinator.placement.costmodel import Topology


def generate_geo_topology(regions: int = 8, per_region: int = 8, stages: int = 8, replicas: int = 8,
                          seed: int = 0, *, in_region_delay_ms: float = 5.0, in_region_gbps: float = 2.0,
                          cross_delay_ms: tuple[float, float] = (10.0, 250.0),
                          cross_gbps: tuple[float, float] = (0.3, 1.2), activation_gb: float = 0.2,
                          gradient_gb: float = 0.25, outer_every: int = 1, jitter: float = 0.0) -> Topology:
    """``regions`` data centres of ``per_region`` GPUs each; device ``d`` lives in region ``d // per_region``.

    Links inside a region are fast; each pair of regions gets one delay and one bandwidth drawn
    uniformly from the ranges (symmetric). ``jitter`` scales every link by ``1 + U(-jitter, jitter)``
    so that no two links tie exactly. The defaults make the pipeline term dominate at ``H = 1``:
    with one pipeline per region every activation hop is local, while the all-reduces go across.
    """
    rng = np.random.default_rng(seed)
    n = regions * per_region
    region = np.arange(n) // per_region
    delay_r = np.triu(rng.uniform(*cross_delay_ms, (regions, regions)), 1)
    gbps_r = np.triu(rng.uniform(*cross_gbps, (regions, regions)), 1)
    delay_r = delay_r + delay_r.T
    gbps_r = gbps_r + gbps_r.T
    np.fill_diagonal(delay_r, in_region_delay_ms)
    np.fill_diagonal(gbps_r, in_region_gbps)
    delay = delay_r[region][:, region]
    gbps = gbps_r[region][:, region]
    if jitter > 0:
        delay = delay * (1 + rng.uniform(-jitter, jitter, (n, n)))
        gbps = gbps * (1 + rng.uniform(-jitter, jitter, (n, n)))
    np.fill_diagonal(delay, 0.0)
    return Topology(delay_ms=delay, bandwidth_gbps=gbps, stages=stages, replicas=replicas,
                    activation_gb=activation_gb, gradient_gb=gradient_gb, outer_every=outer_every)


def generate_random_topology(devices: int, stages: int, replicas: int, seed: int = 0, *,
                             activation_gb: float = 0.2, gradient_gb: float = 0.25, outer_every: int = 1,
                             with_compute: bool = True) -> Topology:
    """Heterogeneous devices with no region structure: points on a plane, delay ~ distance,
    log-normal per-device uplinks (a link is as fast as the slower end), speeds in ``[0.5, 2]``."""
    rng = np.random.default_rng(seed)
    xy = rng.uniform(0, 1, (devices, 2))
    distance = np.linalg.norm(xy[:, None, :] - xy[None, :, :], axis=2)
    delay = 2.0 + 200.0 * distance
    uplink = np.exp(rng.normal(np.log(0.8), 0.6, devices))
    gbps = np.minimum(uplink[:, None], uplink[None, :])
    np.fill_diagonal(delay, 0.0)
    compute = rng.uniform(0.5, 2.0, devices) if with_compute else None
    return Topology(delay_ms=delay, bandwidth_gbps=gbps, stages=stages, replicas=replicas,
                    activation_gb=activation_gb, gradient_gb=gradient_gb, outer_every=outer_every,
                    compute=compute, stage_seconds=0.5)


def is_region_layout(pipelines: list[list[int]], per_region: int) -> bool:
    """Whether every pipeline of a plan keeps all its stages inside one region."""
    return all(len({d // per_region for d in chain}) == 1 for chain in pipelines)
