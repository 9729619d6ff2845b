"""Start layouts for the tasklet search: the blocks layout, random assignments, two greedy seeds,
and structured seeds that keep pipeline segments inside the places (boxes, data centers, regions)
read off the measured links. :mod:`potluck.coordinator.scheduler` evaluates and improves them."""

from __future__ import annotations

import itertools
import math

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from potluck.coordinator.costmodel import CostModel, Topology, canonical, spanning_tree_edges

Groups = list[tuple[int, ...]]


def blocks_layout(topology: Topology) -> np.ndarray:
    """Devices ``0..R-1`` run stage 0, ``R..2R-1`` stage 1, and so on: the layout without a scheduler."""
    return np.arange(topology.stages * topology.replicas).reshape(topology.stages, topology.replicas)


def random_groups(topology: Topology, rng: np.random.Generator) -> Groups:
    s, r = topology.stages, topology.replicas
    return canonical(rng.permutation(topology.devices)[: s * r].reshape(s, r))


def _clusters(link: np.ndarray, count: int, size: int) -> list[list[int]]:
    """``count`` disjoint clusters of ``size`` close devices: each time, the device whose
    ``size - 1`` nearest free neighbours are closest, with those neighbours, in nearest-first order.

    A device's nearest free neighbours change only when one of them is taken, so each round
    re-ranks just those devices: ``O(N^2 log N)`` once, then a few rows per round, not all ``N``."""
    n = len(link)
    free = np.ones(n, dtype=bool)
    near = np.argsort(link, axis=1, kind="stable")[:, :size]  # column 0 is the device itself
    spread = np.take_along_axis(link, near, axis=1).sum(axis=1)
    out = []
    for _ in range(count):
        seed = int(np.where(free, spread, np.inf).argmin())
        members = [int(k) for k in near[seed]]
        free[members] = False
        out.append(members)
        idx = np.flatnonzero(free)
        stale = np.flatnonzero(free & np.isin(near, members).any(axis=1))
        if len(stale) and len(idx) >= size:  # fewer free devices than ``size``: no round follows
            sub = link[np.ix_(stale, idx)]
            order = np.argsort(sub, axis=1, kind="stable")[:, :size]
            near[stale] = idx[order]
            spread[stale] = np.take_along_axis(sub, order, axis=1).sum(axis=1)
    return out


def greedy_seeds(model: CostModel) -> list[Groups]:
    """Two constructive layouts. Pipeline-first: ``R`` clusters of ``S`` close devices, one per
    replica, ordered as a nearest-neighbour chain, stage ``s`` taking the ``s``-th of each, so
    activations stay inside a cluster. Group-first: ``S`` clusters of ``R``, so all-reduces do."""
    t = model.topology
    link = model.pp_link + np.diag(np.full(t.devices, -1.0))  # a device is its own nearest
    chains = []
    for members in _clusters(link, t.replicas, t.stages):
        chain, left = [members[0]], list(members[1:])
        while left:
            chain.append(left.pop(int(model.pp_link[chain[-1], left].argmin())))
        chains.append(chain)
    pipeline_first = canonical(np.array(chains).T)
    dp_link = model.dp_link + model.dp_link.T + np.diag(np.full(t.devices, -1.0))
    group_first = canonical(_clusters(dp_link, t.stages, t.replicas))
    return [pipeline_first, group_first]


def places(link: np.ndarray, levels: int = 4, min_ratio: float = 1.25) -> list[list[list[int]]]:
    """Groups of devices joined by clearly faster links than the rest (boxes, data centers, regions),
    finest first: single-linkage components (``link <= threshold``) at the ``levels`` widest relative
    gaps (at least ``min_ratio``) between the sorted link costs, and between the sorted edge costs of a
    minimum spanning tree (which sees the gaps *along* chains of close devices). Found from the
    measured links alone, as the search sees them; each grouping nests in the next."""
    n = len(link)
    if n < 3:
        return []
    thresholds = set()
    for values in (spanning_tree_edges(link), link[~np.eye(n, dtype=bool)]):
        costs = np.unique(np.round(values, 12))
        ratios = costs[1:] / np.maximum(costs[:-1], 1e-12)
        for gap in np.argsort(-ratios, kind="stable")[:levels]:
            if ratios[gap] >= min_ratio:
                thresholds.add(math.sqrt(costs[gap] * costs[gap + 1]))
    out: dict[tuple[int, ...], list[list[int]]] = {}
    for threshold in sorted(thresholds):
        count, label = connected_components(csr_matrix(link <= threshold), directed=False)
        if 1 < count < n:
            out.setdefault(tuple(label), [np.flatnonzero(label == g).tolist() for g in range(count)])
    return list(out.values())


def segment_seeds(model: CostModel) -> list[Groups]:
    """Layouts that keep pipeline *segments* inside places: a pipeline edge is as slow as its slowest
    replica's hop, so it is fast only if every replica crosses it inside a place. For each grouping
    (:func:`places`) and segment length ``k``: cut every pipeline into ``k`` consecutive stages at the
    same boundaries and put each segment inside one place where one fits (smallest place first, and
    largest first; after the first, places in the same larger place as the last one come first);
    plus one stage group per place, for all-reduces that stay inside."""
    t = model.topology
    out: list[Groups] = []
    found = places(model.pp_link)
    labels = [_labels(members, t.devices) for members in found]
    for level, members in enumerate(found):
        parents = [tuple(int(lab[m[0]]) for lab in labels[level + 1:]) for m in members]
        for near, smallest in itertools.product((None, parents), (True, False)):
            out += [segments_layout(t, members, k, smallest, parents=near) for k in range(1, t.stages + 1)]
            out.append(segments_layout(t, members, 1, smallest, by_group=True, parents=near))
    return list({tuple(g): g for g in out}.values())


def _labels(members: list[list[int]], devices: int) -> np.ndarray:
    label = np.empty(devices, dtype=int)
    for i, m in enumerate(members):
        label[m] = i
    return label


def segments_layout(t: Topology, members: list[list[int]], k: int, smallest: bool, by_group: bool = False,
                    parents: list[tuple[int, ...]] | None = None) -> Groups:
    """Pipelines cut into segments of ``k`` stages, each inside one of ``members`` (places) where one
    fits; ``parents[i]`` names the larger places that hold place ``i`` (finest first), and a segment
    goes to a place sharing the most of them with the last place used before any other."""
    free = [list(m) for m in members]
    left = np.array([len(f) for f in free])
    # near[i] = how many larger places place i shares with the last place used; the tie-breaks of
    # the choice below (most shared, then smallest or largest, then first) as one sortable key
    family = np.array(parents, dtype=np.int64).reshape(len(free), -1) if parents else np.zeros((len(free), 0))
    near = np.zeros(len(free), dtype=np.int64)
    weight = 2 * (max(left.max(initial=0), 1) + 1)
    rows, length, count = (t.stages, t.replicas, 1) if by_group else (t.replicas, k, -(-t.stages // k))
    chains: list[list[int]] = [[] for _ in range(rows)]
    for block in range(count):
        size = length if by_group else min(k, t.stages - block * k)
        for chain in chains:
            key = np.where(left >= size, -near * weight + (left if smallest else -left), np.iinfo(np.int64).max)
            i = int(key.argmin())
            if left[i] >= size:
                chain += free[i][:size]
                del free[i][:size]
                left[i] -= size
                if family.shape[1]:
                    near = (family == family[i]).sum(axis=1)
            else:  # no place holds the whole segment: take from the fullest ones
                for _ in range(size):
                    j = int(left.argmax())
                    chain.append(free[j].pop(0))
                    left[j] -= 1
    return canonical(np.array(chains) if by_group else np.array(chains).T)
