"""The swarms ``scheduler_families.py`` places jobs on: six seeded families of topologies (a data center,
a spot mix, two data centers, regions, the world, volunteers) and the job shapes asked of them.

Each generator returns a :class:`Swarm` (delays in ms, bandwidths in Gbps, compute times, and the
structure it built, which the search never sees); :func:`generate` makes one seeded instance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from potluck.coordinator.placement.costmodel import Topology

SCALE_FROM = 256  # devices; from here on, volunteer-swarm job shapes (scale_job_shape)

# in-box GPU links (NVLink to PCIe) and a datacenter fabric between boxes
BOX_DELAY_MS, BOX_GBPS = 0.01, (200.0, 2400.0)
FABRIC_DELAY_MS, FABRIC_GBPS = 0.05, (100.0, 200.0)
KM_PER_MS = 200.0  # light in fibre
ROUTE_FACTOR = 1.5  # fibre paths are longer than great circles


# ------------------------------------------------------------------ generators


def _boxes(rng: np.random.Generator, devices: int, sizes: tuple[int, ...],
           weights: tuple[float, ...]) -> np.ndarray:
    """Box label of each device: boxes of sizes drawn from ``sizes`` until the devices run out."""
    label, box, d = np.empty(devices, dtype=int), 0, 0
    while d < devices:
        size = min(int(rng.choice(sizes, p=np.asarray(weights) / sum(weights))), devices - d)
        label[d:d + size] = box
        box, d = box + 1, d + size
    return label


def _split(rng: np.random.Generator, devices: int, parts: int) -> np.ndarray:
    """Part label of each device; parts of random sizes, each of at least 2 devices."""
    cuts = np.sort(rng.choice(np.arange(2, devices - 1, 2), parts - 1, replace=False))
    label = np.zeros(devices, dtype=int)
    for c in cuts:
        label[c:] += 1
    return label


def _overlay(delay: np.ndarray, gbps: np.ndarray, label: np.ndarray, delay_ms: np.ndarray,
             link_gbps: np.ndarray) -> None:
    """Links between two devices of the same label take that label's delay and bandwidth."""
    same = label[:, None] == label[None, :]
    delay[same] = np.broadcast_to(delay_ms[label][:, None], delay.shape)[same]
    gbps[same] = np.broadcast_to(link_gbps[label][:, None], gbps.shape)[same]


def _jitter(rng: np.random.Generator, m: np.ndarray, amount: float) -> np.ndarray:
    """Symmetric multiplicative noise, as measured links have: no two links tie exactly."""
    noise = np.triu(rng.uniform(-amount, amount, m.shape), 1)
    return m * (1 + noise + noise.T)


def _boxed(rng: np.random.Generator, delay: np.ndarray, gbps: np.ndarray, box: np.ndarray) -> None:
    """GPUs of the same box (any labels) talk over NVLink or PCIe, one bandwidth per box."""
    labels, box = np.unique(box, return_inverse=True)
    _overlay(delay, gbps, box, np.full(len(labels), BOX_DELAY_MS), rng.uniform(*BOX_GBPS, len(labels)))


def _fabric(rng: np.random.Generator, devices: int) -> tuple[np.ndarray, np.ndarray]:
    delay = _jitter(rng, np.full((devices, devices), FABRIC_DELAY_MS), 0.05)
    return delay, _jitter(rng, np.full((devices, devices), rng.uniform(*FABRIC_GBPS)), 0.05)


def _globe(rng: np.random.Generator, points: int) -> np.ndarray:
    """Great-circle distances (km) between random points of the inhabited latitudes."""
    lat = np.radians(rng.uniform(-45, 65, points))
    lon = np.radians(rng.uniform(-180, 180, points))
    xyz = np.stack([np.cos(lat) * np.cos(lon), np.cos(lat) * np.sin(lon), np.sin(lat)], axis=1)
    return 6371.0 * np.arccos(np.clip(xyz @ xyz.T, -1.0, 1.0))


def _geo_delay(km: np.ndarray) -> np.ndarray:
    return ROUTE_FACTOR * km / KM_PER_MS


class Swarm(NamedTuple):
    """What a family generator draws: links, GPU speeds (``None``: all alike) and ``places``, label
    arrays from the finest level up (boxes, then data centres or regions): the structure it built,
    which the reference's hand-made layouts use and the search under test never sees."""

    delay_ms: np.ndarray
    bandwidth_gbps: np.ndarray
    compute: np.ndarray | None
    places: list[np.ndarray]


def datacenter(devices: int, rng: np.random.Generator) -> Swarm:
    delay, gbps = _fabric(rng, devices)
    box = np.arange(devices) // min(8, devices // 2)  # tiny ones: two boxes
    _boxed(rng, delay, gbps, box)
    return Swarm(delay, gbps, None, [box])


def spot_mix(devices: int, rng: np.random.Generator) -> Swarm:
    box = np.arange(devices)  # a single GPU is a box of one
    in_boxes = rng.uniform(0.25, 0.6) * devices  # share of the GPUs that sit in multi-GPU boxes
    d = 0
    while (size := int(rng.choice([2, 4, 8], p=[0.2, 0.3, 0.5]))) and d + size <= in_boxes:
        box[d:d + size] = d
        d += size
    delay = np.full((devices, devices), rng.uniform(10.0, 50.0))
    gbps = np.full((devices, devices), rng.uniform(0.5, 5.0))
    _boxed(rng, delay, gbps, box)
    return Swarm(delay, gbps, None, [box])


def two_dc(devices: int, rng: np.random.Generator) -> Swarm:
    dc = (np.arange(devices) >= int(devices * rng.uniform(0.3, 0.7))).astype(int)
    delay = _jitter(rng, np.full((devices, devices), rng.uniform(5.0, 40.0)), 0.05)
    gbps = _jitter(rng, np.full((devices, devices), rng.uniform(5.0, 40.0)), 0.05)
    fabric_delay, fabric_gbps = _fabric(rng, devices)
    same = dc[:, None] == dc[None, :]
    delay[same], gbps[same] = fabric_delay[same], fabric_gbps[same]
    box = np.concatenate([np.arange((dc == k).sum()) // 8 + 1000 * k for k in (0, 1)])
    _boxed(rng, delay, gbps, box)
    return Swarm(delay, gbps, None, [box, dc])


def regions(devices: int, rng: np.random.Generator) -> Swarm:
    k = int(rng.integers(3, 7))
    region = _split(rng, devices, min(k, devices // 2))
    count = region.max() + 1
    pair_delay = np.triu(rng.uniform(20.0, 150.0, (count, count)), 1)
    pair_gbps = np.triu(rng.uniform(0.2, 2.0, (count, count)), 1)
    delay = _jitter(rng, (pair_delay + pair_delay.T)[region][:, region], 0.05)
    gbps = _jitter(rng, (pair_gbps + pair_gbps.T)[region][:, region], 0.05)
    _overlay(delay, gbps, region, rng.uniform(1.0, 5.0, count), rng.uniform(2.0, 10.0, count))
    box = _boxes(rng, devices, (1, 2, 4, 8), (3, 2, 2, 1)) * 1000 + region  # no box straddles two regions
    _boxed(rng, delay, gbps, box)
    return Swarm(delay, gbps, None, [box, region])


def world(devices: int, rng: np.random.Generator) -> Swarm:
    site = _boxes(rng, devices, (1, 2, 4, 8), (4, 2, 2, 1))
    sites = site.max() + 1
    km = _globe(rng, sites)
    uplink = np.exp(rng.uniform(np.log(1.0), np.log(10.0), sites))
    site_gbps = np.minimum(uplink[:, None], uplink[None, :]) / (1 + km / 10_000.0)  # TCP slows with RTT
    delay = _jitter(rng, (2.0 + _geo_delay(km))[site][:, site], 0.05)
    gbps = _jitter(rng, site_gbps[site][:, site], 0.05)
    _boxed(rng, delay, gbps, site)
    speed = rng.choice([0.7, 1.0, 1.5, 2.0], sites)  # one GPU model per site
    return Swarm(delay, gbps, speed[site], [site])


def volunteers(devices: int, rng: np.random.Generator) -> Swarm:
    access_gbps = np.clip(np.exp(rng.normal(np.log(0.3), 0.8, devices)), 0.02, 10.0)
    access_ms = rng.uniform(2.0, 40.0, devices)
    delay = access_ms[:, None] + access_ms[None, :] + _geo_delay(_globe(rng, devices))
    gbps = np.minimum(access_gbps[:, None], access_gbps[None, :])
    return Swarm(delay, gbps, np.exp(rng.uniform(np.log(0.3), np.log(3.0), devices)), [])


FAMILIES: dict[str, Callable[[int, np.random.Generator], Swarm]] = {
    "datacenter": datacenter, "spot_mix": spot_mix, "two_dc": two_dc, "regions": regions, "world": world,
    "volunteers": volunteers}


def job_shape(devices: int, rng: np.random.Generator) -> tuple[int, int]:
    """``(S, R)``: ``S * R <= devices``, half the time all of them when some shape fits exactly.
    8 devices or fewer get tiny shapes that leave devices over, so the exact optimum is enumerable."""
    if devices <= 8:
        shapes = [(s, r) for s, r in ((2, 2), (2, 3), (3, 2)) if s * r <= devices - 2] or [(2, 2)]
    else:
        shapes = [(s, r) for s in range(2, 9) for r in range(2, 17) if devices // 2 <= s * r <= devices]
        full = [(s, r) for s, r in shapes if s * r == devices]
        fewer = [(s, r) for s, r in shapes if s * r < devices]
        shapes = full if full and (not fewer or rng.random() < 0.5) else fewer
    s, r = shapes[int(rng.integers(len(shapes)))]
    return s, r


def scale_job_shape(devices: int, rng: np.random.Generator) -> tuple[int, int]:
    """``(S, R)`` of a volunteer swarm (``devices >= SCALE_FROM``): 2-16 stages, and as many replicas
    as fill 50-100 % of the devices (at 1,024 devices, from 2 x 256 to 16 x 64)."""
    stages = int(rng.integers(2, 17))
    return stages, int(devices * rng.uniform(0.5, 1.0)) // stages


class Instance(NamedTuple):
    topology: Topology
    places: list[np.ndarray]  # as in :class:`Swarm`, in the topology's (shuffled) device ids


def generate(family: str, devices: int, seed: int) -> Instance:
    """One instance: the family's links, a job shape and payloads, device ids shuffled."""
    rng = np.random.default_rng([seed, devices, list(FAMILIES).index(family)])
    swarm = FAMILIES[family](devices, rng)
    stages, replicas = (scale_job_shape if devices >= SCALE_FROM else job_shape)(devices, rng)
    perm = rng.permutation(devices)
    delay = swarm.delay_ms[np.ix_(perm, perm)]
    np.fill_diagonal(delay, 0.0)
    topology = Topology(delay_ms=delay, bandwidth_gbps=swarm.bandwidth_gbps[np.ix_(perm, perm)],
                        stages=stages, replicas=replicas, activation_gb=float(rng.uniform(0.05, 0.4)),
                        gradient_gb=float(rng.uniform(0.2, 2.0)), outer_every=int(rng.choice([1, 10, 50])),
                        compute=None if swarm.compute is None else swarm.compute[perm], stage_seconds=0.5)
    return Instance(topology, [label[perm] for label in swarm.places])


# ------------------------------------------------------------------ references
