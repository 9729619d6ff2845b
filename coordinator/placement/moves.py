"""The tasklet search's operators (:mod:`potluck.coordinator.placement.scheduler`): crossover and mutation, and
compound moves for its local search, which change many devices of a pair of groups at once where the
single swaps it tries cross a plateau only one flat step at a time."""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import linear_sum_assignment

from potluck.coordinator.placement.costmodel import CostModel, Topology, canonical
from potluck.coordinator.placement.layouts import Groups

RESPLIT_LOOSEN = (0.0, 0.5)  # of the worse group's devices held for their links, the share let go


def crossover(a: Groups, b: Groups, topology: Topology, rng: np.random.Generator) -> Groups:
    """Group-wise uniform crossover with balance repair: every group ends with exactly ``R`` devices."""
    s = len(a)
    overlap = np.array([[len(set(x) & set(y)) for y in b] for x in a])
    _, match = linear_sum_assignment(-overlap)  # b's group match[i] plays a's group i
    picked = [set(a[i]) if rng.random() < 0.5 else set(b[match[i]]) for i in range(s)]
    taken: set[int] = set()
    for i in rng.permutation(s):
        picked[i] -= taken
        taken |= picked[i]
    pool = [int(d) for d in rng.permutation(topology.devices) if int(d) not in taken]
    for g in picked:
        while len(g) < topology.replicas:
            g.add(pool.pop())
    return canonical(picked)


def mutate(groups: Groups, topology: Topology, rng: np.random.Generator, swaps: int) -> Groups:
    """``swaps`` random swaps, of two devices of two groups or of a device with an unused one."""
    flat = np.array(groups)
    unused = np.setdiff1d(np.arange(topology.devices), flat)
    for _ in range(swaps):
        i = rng.integers(flat.shape[0])
        if len(unused) and rng.random() < len(unused) / topology.devices:
            k, u = rng.integers(flat.shape[1]), rng.integers(len(unused))
            flat[i, k], unused[u] = unused[u], flat[i, k]
        else:
            j = (i + 1 + rng.integers(flat.shape[0] - 1)) % flat.shape[0] if flat.shape[0] > 1 else i
            k, m = rng.integers(flat.shape[1]), rng.integers(flat.shape[1])
            flat[i, k], flat[j, m] = flat[j, m], flat[i, k]
    return canonical(flat)


def compute_resplits(model: CostModel, quality: np.ndarray, a: tuple[int, ...],
                     b: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """New splits of the devices of groups ``a`` and ``b`` (new ``a``, new ``b``) that gather slow
    compute in one of the two and keep each group's worst pipeline device (``quality``: per device,
    higher is a slower link, e.g. its mean pipeline link).

    Why: a stage takes as long as its slowest GPU, so a group sheds that cost only when its *last*
    slow GPU leaves. Moving them one swap at a time changes nothing until the last swap (a plateau
    that the smoothed objective slopes only weakly); at 1,024 volunteers (7 x 81, 10 CPU s) the
    descent found such gatherings for some search seeds (compute term 8.9 of a cost of 55.6) and not
    for others (10.2 of 56.4). This move does it in one step. A pipeline edge costs about its
    slower end's worst link (volunteers: a link is as fast as its slower access link), so the pair's
    worst-link devices stay where they are: the devices no slower than the better group's worst may
    go to either group, the ones between the two worsts stay in the worse group; the free ones are
    then dealt slowest-compute first to one group, then the other (two splits, one per group taking
    the slow ones). Then the same with the better half of those held devices let go too
    (``RESPLIT_LOOSEN``): the better group's worst link gets a little slower, and a stage sheds its
    slow GPUs; the cost model judges the trade. From a plan the descent could not improve (56.10),
    sweeps of the re-splits alone reached 56.10 holding every device, 55.90 with this, 55.85 letting
    go a quarter, half and three quarters (about 4 ms an evaluation; two or four a pair here).
    None without per-device compute speeds, or where a split changes nothing."""
    if model.stage_time is None:
        return []
    sa, sb = np.asarray(a), np.asarray(b)
    swapped = quality[sa].max() < quality[sb].max()
    worse, better = (sb, sa) if swapped else (sa, sb)  # worse: the group holding the pair's worst link
    held = worse[quality[worse] > quality[better].max()]  # slower than the better group's worst
    held = held[np.argsort(-quality[held], kind="stable")]  # worst first
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for share in RESPLIT_LOOSEN:
        fixed = held[: max(1, math.ceil(len(held) * (1 - share)))] if len(held) else held
        loose = np.setdiff1d(np.concatenate([worse, better]), fixed)
        loose = loose[np.argsort(-model.stage_time[loose], kind="stable")]
        room = len(worse) - len(fixed)  # the worse group's places left for loose devices
        for new_worse, new_better in ((np.concatenate([fixed, loose[:room]]), loose[room:]),  # it takes the slow
                                      (np.concatenate([fixed, loose[len(better):]]), loose[: len(better)])):
            w, v = tuple(sorted(new_worse.tolist())), tuple(sorted(new_better.tolist()))
            pair = (v, w) if swapped else (w, v)
            if pair != (a, b) and pair not in out:
                out.append(pair)
    return out
