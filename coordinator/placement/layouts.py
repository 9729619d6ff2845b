"""Start layouts for the tasklet search: the blocks layout, random assignments, two greedy seeds,
and structured seeds that keep pipeline segments inside the places (boxes, data centers, regions)
read off the measured links. :mod:`potluck.coordinator.placement.scheduler` evaluates and improves them."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from potluck.coordinator.placement.costmodel import CostModel, Topology, canonical, spanning_tree_edges

Groups = list[tuple[int, ...]]


def blocks_layout(topology: Topology) -> np.ndarray:
    """Devices ``0..R-1`` run stage 0, ``R..2R-1`` stage 1, and so on: the layout without a scheduler."""
    return np.arange(topology.stages * topology.replicas).reshape(topology.stages, topology.replicas)


def random_groups(topology: Topology, rng: np.random.Generator) -> Groups:
    s, r = topology.stages, topology.replicas
    return canonical(rng.permutation(topology.devices)[: s * r].reshape(s, r))


def nearest_first(rows: np.ndarray, size: int) -> np.ndarray:
    """``np.argsort(rows, axis=1, kind="stable")[:, :size]`` in linear time per row: partition, then
    keep, of the entries tied with the ``size``-th smallest, the first ones (as a stable sort would)."""
    if size >= rows.shape[1]:
        return np.argsort(rows, axis=1, kind="stable")[:, :size]
    kth = np.partition(rows, size - 1, axis=1)[:, size - 1:size]
    below, tied = rows < kth, rows == kth
    keep = below | (tied & (np.cumsum(tied, axis=1) <= size - below.sum(axis=1, keepdims=True)))
    cols = np.nonzero(keep)[1].reshape(len(rows), size)  # ascending index within each row
    order = np.argsort(np.take_along_axis(rows, cols, axis=1), axis=1, kind="stable")
    return np.take_along_axis(cols, order, axis=1)


def _clusters(link: np.ndarray, count: int, size: int) -> list[list[int]]:
    """``count`` disjoint clusters of ``size`` close devices: each time, the device whose
    ``size - 1`` nearest free neighbours are closest, with those neighbours, in nearest-first order.

    A device's nearest free neighbours change only when one of them is taken, so each round
    re-ranks just those devices (by partial sorts), not all ``N`` of them."""
    free = np.ones(len(link), dtype=bool)
    near = nearest_first(link, size)  # column 0 is the device itself
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
            order = nearest_first(sub, size)
            near[stale] = idx[order]
            spread[stale] = np.take_along_axis(sub, order, axis=1).sum(axis=1)
    return out


def greedy_seeds(model: CostModel, keep: np.ndarray | None = None) -> list[Groups]:
    """Two constructive layouts. Pipeline-first: ``R`` clusters of ``S`` close devices, one per
    replica, ordered as a nearest-neighbour chain, stage ``s`` taking the ``s``-th of each, so
    activations stay inside a cluster. Group-first: ``S`` clusters of ``R``, so all-reduces do.
    ``keep``: build them from these devices only (the others left unused)."""
    t = model.topology
    idx = np.arange(t.devices) if keep is None else keep
    pp_link = model.pp_link if keep is None else model.pp_link[np.ix_(keep, keep)]
    dp_link = model.dp_link if keep is None else model.dp_link[np.ix_(keep, keep)]
    own = np.diag(np.full(len(idx), -1.0))  # a device is its own nearest
    chains = []
    for members in _clusters(pp_link + own, t.replicas, t.stages):
        chain, left = [members[0]], list(members[1:])
        while left:
            chain.append(left.pop(int(pp_link[chain[-1], left].argmin())))
        chains.append(chain)
    pipeline_first = canonical(idx[np.array(chains).T])
    group_first = canonical(idx[np.array(_clusters(dp_link + dp_link.T + own, t.stages, t.replicas))])
    return [pipeline_first, group_first]


def device_quality(model: CostModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per device, lower is better: its mean pipeline link; that plus its mean all-reduce link (per
    ``H``) and its stage time, the terms of the objective together; its stage time."""
    t = model.topology
    pp = model.pp_link.sum(axis=1) / max(t.devices - 1, 1)
    dp = (model.dp_link + model.dp_link.T).sum(axis=1) / max(t.devices - 1, 1)
    stage = np.zeros(t.devices) if model.stage_time is None else model.stage_time
    return pp, 2.0 * pp + dp / t.outer_every + stage, stage


def rank_seeds(model: CostModel) -> list[Groups]:
    """Layouts by device quality, for swarms of single devices (volunteers) where a device's own
    access link, not its place, makes it slow. A pipeline edge is as slow as its slowest hop and an
    all-reduce as its slowest member, so one slow device taxes every group it is in and every edge
    of those groups: the slowest devices are better left unused, and the rest gathered, slow with
    slow, into the same groups (one pipeline end holds the slowest), as consecutive runs of the
    devices sorted by quality (:func:`device_quality`). Four: by the mean pipeline link; the same
    with the two fastest groups split by stage time (below); the same devices grouped by stage
    time (slow compute gathered); by all the terms together.

    The split: in a pipeline ordered slow end to fast end, the fastest group's only edge goes to the
    second fastest, and an edge costs its slower side's bottleneck, so the ``2 R`` fastest devices
    can be shared between those two groups in any way without moving a pipeline bottleneck, while a
    stage costs its slowest member's compute. Sorted by the link alone, both groups hold some slow
    GPU; split by stage time, one holds all of them. A descent needs dozens of swaps that each
    change nothing (the stage's slowest GPU stays until the last one leaves) to find this: at 1,024
    volunteers (7 x 81) it did in 10 s for some search seeds (56.53) and not for others (57.34);
    the split layout costs 56.51 before any search (by the link alone: 57.56)."""
    t = model.topology
    used = t.stages * t.replicas
    pp, overall, stage = device_quality(model)
    fastest = np.argsort(pp, kind="stable")[:used]
    pair = fastest[: 2 * t.replicas]
    split = np.concatenate([pair[np.argsort(-stage[pair], kind="stable")], fastest[2 * t.replicas:]])
    by_compute = fastest[np.argsort(stage[fastest], kind="stable")]
    best = np.argsort(overall, kind="stable")[:used]
    orders = (fastest, split, by_compute, best)
    layouts = [canonical(order.reshape(t.stages, t.replicas)) for order in orders]
    return [g for k, g in enumerate(layouts) if g not in layouts[:k]]  # without compute, three are one


RANKED_GREEDY = ((1, 1.25), (0, 1.1))  # (quality: 0 pipeline, 1 overall; devices kept per tasklet)


def ranked_greedy_seeds(model: CostModel) -> Iterator[Groups]:
    """The greedy seeds built from the best-ranked devices only (a quarter or a tenth more than the
    tasklets; :func:`device_quality`): where devices differ in place *and* in quality (sites of
    uneven uplinks and speeds), clustering everything lets a slow site into a cluster for being
    close, and ranking alone scatters the groups; first dropping the slowest, then clustering,
    does both (at 1,024 sites-of-GPUs devices: 26.8 against 30.0 and 29.6)."""
    t = model.topology
    qualities = device_quality(model)
    for which, share in RANKED_GREEDY:
        kept = int(t.stages * t.replicas * share)
        if kept < t.devices:
            yield from greedy_seeds(model, np.sort(np.argsort(qualities[which], kind="stable")[:kept]))


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
    largest first; after the first, places in the same larger place as the last one come first), and
    pipeline by pipeline (:func:`chained_layout`); plus one stage group per place, for all-reduces
    that stay inside. The levels take turns in the list, each with its pipeline-by-pipeline layouts
    first: a search short of time evaluates the list's head only."""
    return list(iter_segment_seeds(model))


def iter_segment_seeds(model: CostModel) -> Iterator[Groups]:
    """:func:`segment_seeds` built as they are needed: a search out of time never builds the rest."""
    found = places(model.pp_link)
    labels = [_labels(members, model.topology.devices) for members in found]
    yield from _take_turns([_level_seeds(model, found, labels, level) for level in range(len(found))])


def _take_turns(levels: list[Iterable[Groups]]) -> Iterator[Groups]:
    """Level by level in turn (so that a search short of time tries every level), without repeats."""
    seen: set[tuple[tuple[int, ...], ...]] = set()
    for turn in itertools.zip_longest(*levels):
        for groups in turn:
            if groups is not None and tuple(groups) not in seen:
                seen.add(tuple(groups))
                yield groups


def _level_seeds(model: CostModel, found: list[list[list[int]]], labels: list[np.ndarray],
                 level: int) -> Iterator[Groups]:
    t, members = model.topology, found[level]
    parents = [tuple(int(lab[m[0]]) for lab in labels[level + 1:]) for m in members]
    for smallest in (False, True):
        for k in range(t.stages, 0, -1):
            yield chained_layout(t, members, k, smallest, model.pp_link)
    for near, smallest in itertools.product((None, parents), (True, False)):
        for k in range(1, t.stages + 1):
            yield segments_layout(t, members, k, smallest, parents=near)
        yield segments_layout(t, members, 1, smallest, by_group=True, parents=near)


def chained_layout(t: Topology, members: list[list[int]], k: int, smallest: bool, link: np.ndarray) -> Groups:
    """Like :func:`segments_layout`, but pipeline by pipeline: a pipeline's first segment goes to the
    smallest (or largest) place it fits in, each later one to the fitting place closest to the one
    before it (by ``link`` between their first devices): the same place while it still has room. So
    a pipeline spans few places, and its hops between places are short ones, which
    :func:`segments_layout` (every pipeline's first segment, then every second one) does not see."""
    free = [list(m) for m in members]
    left = np.array([len(f) for f in free])
    head = np.array([m[0] for m in members])
    gap = link[np.ix_(head, head)]
    np.fill_diagonal(gap, 0.0)
    sizes = [min(k, t.stages - b) for b in range(0, t.stages, k)]
    chains: list[list[int]] = []
    for _ in range(t.replicas):
        chain: list[int] = []
        prev = -1
        for size in sizes:
            fits = np.flatnonzero(left >= size)
            if len(fits):
                room = left[fits] if smallest else -left[fits]
                i = int(fits[np.lexsort((room,) if prev < 0 else (room, gap[prev, fits]))[0]])
                chain += free[i][:size]
                del free[i][:size]
                left[i] -= size
                prev = i
            else:  # no place holds the whole segment: take from the fullest ones
                for _ in range(size):
                    j = int(left.argmax())
                    chain.append(free[j].pop(0))
                    left[j] -= 1
                prev = j
        chains.append(chain)
    return canonical(np.array(chains).T)


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
