"""DiLoCo's outer step for one stage: pseudo-gradient, all-reduce among the stage's replicas, Nesterov.

::

    delta        <- theta_global - theta_local         (nothing if the inner phase stalled or diverged)
    mean         <- all-reduce(delta)                   (int8 over gRPC; every member gets the same bits)
    theta_global <- Nesterov(theta_global, mean)        (lr 0.7, momentum 0.9 by default)

With grouped averaging (``sync.group_size``, :mod:`potluck.coordinator.rounds.groups`) the members of a group
hold different states (each the result of the group it averaged with last), so a group averages whole
outer steps, not only pseudo-gradients::

    theta_i', m_i' <- Nesterov(theta_i, m_i, delta_i)                         (each member, its own state)
    theta', m'     <- base + all-reduce([theta_i' - base.theta, m_i' - base.m])   (int8, 2x the vector)

Nesterov is linear, so this is one outer step on the group's mean state, mean momentum and mean
pseudo-gradient. ``base`` is a state every member of the group holds bit for bit (its GroupBase,
usually the group's common result of two steps before), so what travels is small differences, and
every member adds the same mean to the same base: the group ends bit-identical.

With ``sync.fragments = F > 1`` (:mod:`potluck.peer.outer.fragments`) step ``s`` averages and steps fragment
``(s - 1) mod F`` of the vector only: ``delta`` is that fragment's pseudo-gradient, zero-padded to the
all-reduce's ``m`` elements, and the rest of ``theta_global`` and the momentum is committed as it was.

The all-reduce waits for a slow member up to a deadline derived from the measured inner phase
(``deadline_factor`` x its duration, at least ``deadline_floor_s``), never a constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from potluck.compression.transfer import Snapshot
from potluck.peer.outer.diloco import all_finite, nesterov_step, outer_snapshot
from potluck.peer.outer.fragments import fragment_bounds, fragment_of, fragment_step
from potluck.peer.reduce.allreduce import AllReduce, AllReduceStats, RoundInfo
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.runtime.log import get_logger
from potluck.protos.testkit.faults import fault, tamper

log = get_logger(__name__)


@dataclass
class OuterResult:
    snapshot: Snapshot  # the new theta_global and momentum, version ``step``
    stats: AllReduceStats
    mean_norm: float
    bounds: tuple[int, int] | None = None  # the fragment this step synced (sync.fragments > 1), else the whole


def step_fragment(rc: RunConfig, n: int, align: int, step: int) -> tuple[int, int] | None:
    """``[lo, hi)`` of the ``n``-element vector outer step ``step`` syncs, or None: the whole (``sync.fragments``
    1)."""
    f = rc.sync.fragments
    return fragment_bounds(n, f, align, fragment_of(step, f)) if f > 1 else None


def pseudo_gradient(start: torch.Tensor, theta_local: torch.Tensor) -> torch.Tensor:
    """``start - theta_local``: how far the inner phase moved from where it started, written into
    ``theta_local``'s buffer (the caller's fresh copy, consumed here: one model-sized vector less)."""
    return torch.sub(start, theta_local, out=theta_local)


def claimable(info: RoundInfo, samples: int) -> int:
    """The samples this member's contribution claims: those it trained on, at most what the round it commits under
    hands its replica. More happens honestly: it trained on an earlier decision of the round, whose share was
    longer, and the coordinator decided the round again meanwhile (a member came or went). Its owner refuses
    a claim over the round's share, so it claims the share."""
    handed = info.handed_to(info.me)
    if handed is None or samples <= handed:
        return samples
    log.info("step %d: trained on %d samples; the round hands this replica %d: its contribution claims %d",
             info.step, samples, handed, handed)
    return handed


def outer_step(rc: RunConfig, allreduce: AllReduce, info: RoundInfo, held: Snapshot, delta: torch.Tensor | None,
               inner_seconds: float, meta: dict, base: Snapshot | None = None, samples: int = 1,
               pace_s: float = 0.0) -> OuterResult:
    """Average this member's pseudo-gradient ``delta`` with the stage's other members and take the outer
    step from ``held`` (None: nothing valid to contribute; the member still takes the step). ``samples``: the
    samples ``delta`` was trained on, its weight in the average. With a ``base`` (grouped averaging), average
    whole outer steps as differences from it instead (see the module). ``pace_s``: spread the sends over this
    long (an overlapped step: ``sync.pace``, :mod:`potluck.peer.reduce.pacing`); 0: at line rate.

    Raises :class:`~potluck.peer.reduce.allreduce.IncompleteRound` when the step cannot be committed.
    """
    fault("outer.start", info.step)
    theta = held.tensors["theta"]
    if delta is not None and not all_finite(delta):
        log.error("local training produced NaN/Inf; contributing nothing to step %d", info.step)
        delta = None
    if delta is not None:
        samples = claimable(info, samples)
        delta = tamper("outer.delta", info.step, delta)  # a Byzantine peer, in the attack tests only
        samples = int(tamper("outer.samples", info.step, samples))  # one that claims more work than it did (tests)
    s, d = rc.sync, rc.diloco
    wait_s = max(s.deadline_floor_s, s.deadline_factor * inner_seconds)
    if base is not None:
        return _grouped(rc, allreduce, info, held, base, delta, wait_s, meta, samples)
    mean, stats = allreduce.run(info, delta, wait_s=wait_s, grace_s=max(2.0, 0.25 * wait_s), samples=samples,
                                pace_s=pace_s)
    bounds = step_fragment(rc, theta.numel(), allreduce.codec.align, info.step)
    if bounds is not None:
        lo, hi = bounds
        mean_norm = float(mean[: hi - lo].norm())
        if not math.isfinite(mean_norm):
            raise ValueError("the averaged pseudo-gradient holds NaN or Inf")
        new_theta, new_m = fragment_step(theta, held.tensors["momentum"], mean, lo, hi, d.outer_lr, d.outer_momentum,
                                         d.nesterov)
        snap = outer_snapshot(new_theta, new_m, info.step, {**meta, "epoch": info.epoch}, hash_later=True)
        return OuterResult(snap, stats, mean_norm, bounds)
    # the step needs only the mean (a fresh vector, which it turns into the new theta); delta's buffer, read
    # by nobody once the round is complete, takes the new momentum: no model-sized vector to page in
    spare, delta = delta, None
    momentum = held.tensors["momentum"]
    if spare is None or spare.shape != momentum.shape or spare.dtype != momentum.dtype or not spare.is_contiguous():
        spare = None
    mean_norm = float(mean.norm())  # (NaN or Inf if any value is: the step's own check, one pass less)
    if not math.isfinite(mean_norm):
        raise ValueError("the averaged pseudo-gradient holds NaN or Inf")
    new_theta, new_m = nesterov_step(theta, momentum, mean, d.outer_lr, d.outer_momentum, d.nesterov,
                                     consume=True, momentum_out=spare, checked=True)
    # hashed on the state hasher's thread: the next inner phase starts meanwhile (who reads the hash waits)
    snap = outer_snapshot(new_theta, new_m, info.step, {**meta, "epoch": info.epoch}, hash_later=True)
    return OuterResult(snap, stats, mean_norm)


def grouped_contribution(held: Snapshot, base: Snapshot, delta: torch.Tensor, lr: float, mu: float,
                         nesterov: bool) -> torch.Tensor:
    """``[theta' - base.theta, m' - base.m]``: this member's own outer step from its own state, as a
    difference from the group's base (one vector of twice the stage's parameters)."""
    theta, momentum = held.tensors["theta"], held.tensors["momentum"]
    new_theta, new_m = nesterov_step(theta, momentum, delta, lr, mu, nesterov)
    n = theta.numel()
    out = torch.empty(2 * n, dtype=torch.float32)
    torch.sub(new_theta, base.tensors["theta"], out=out[:n])
    torch.sub(new_m, base.tensors["momentum"], out=out[n:])
    return out


def _grouped(rc: RunConfig, allreduce: AllReduce, info: RoundInfo, held: Snapshot, base: Snapshot,
             delta: torch.Tensor | None, wait_s: float, meta: dict, samples: int) -> OuterResult:
    """The grouped outer step (see the module): every member of the group adds the same mean to the same base."""
    if base.hash != info.base_hash:
        raise ValueError(f"base state {base.hash[:12]} is not the round's {info.base_hash[:12]}")
    d = rc.diloco
    contribution = grouped_contribution(held, base, delta, d.outer_lr, d.outer_momentum, d.nesterov) \
        if delta is not None else None
    delta = None
    mean, stats = allreduce.run(info, contribution, wait_s=wait_s, grace_s=max(2.0, 0.25 * wait_s), samples=samples)
    contribution = None
    n = held.tensors["theta"].numel()
    if not all_finite(mean):
        raise ValueError("the averaged outer step holds NaN or Inf")
    new_theta = torch.add(base.tensors["theta"], mean[:n])
    new_m = torch.add(base.tensors["momentum"], mean[n:])
    mean_norm = float(mean[:n].norm())
    snap = outer_snapshot(new_theta, new_m, info.step, {**meta, "epoch": info.epoch})
    return OuterResult(snap, stats, mean_norm)
