"""DiLoCo's outer step for one stage: pseudo-gradient, all-reduce among the stage's replicas, Nesterov.

::

    delta        <- theta_global - theta_local         (nothing if the inner phase stalled or diverged)
    mean         <- all-reduce(delta)                   (int8 over gRPC; every member gets the same bits)
    theta_global <- Nesterov(theta_global, mean)        (lr 0.7, momentum 0.9 by default)

The all-reduce waits for a slow member up to a deadline derived from the measured inner phase
(``deadline_factor`` x its duration, at least ``deadline_floor_s``), never a constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from potluck.compression.transfer import Snapshot
from potluck.peer.allreduce import AllReduce, AllReduceStats, RoundInfo
from potluck.peer.diloco import all_finite, nesterov_step, outer_snapshot
from potluck.protos.config import RunConfig
from potluck.protos.faults import fault, tamper
from potluck.protos.log import get_logger

log = get_logger(__name__)


@dataclass
class OuterResult:
    snapshot: Snapshot  # the new theta_global and momentum, version ``step``
    stats: AllReduceStats
    mean_norm: float


def pseudo_gradient(start: torch.Tensor, theta_local: torch.Tensor) -> torch.Tensor:
    """``start - theta_local``: how far the inner phase moved from where it started, written into
    ``theta_local``'s buffer (the caller's fresh copy, consumed here: one model-sized vector less)."""
    return torch.sub(start, theta_local, out=theta_local)


def outer_step(rc: RunConfig, allreduce: AllReduce, info: RoundInfo, held: Snapshot, delta: torch.Tensor | None,
               inner_seconds: float, meta: dict) -> OuterResult:
    """Average this member's pseudo-gradient ``delta`` with the stage's other members and take the outer
    step from ``held`` (None: nothing valid to contribute; the member still takes the step).

    Raises :class:`~potluck.peer.allreduce.IncompleteRound` when the step cannot be committed.
    """
    fault("outer.start", info.step)
    theta = held.tensors["theta"]
    if delta is not None and not all_finite(delta):
        log.error("local training produced NaN/Inf; contributing nothing to step %d", info.step)
        delta = None
    if delta is not None:
        delta = tamper("outer.delta", info.step, delta)  # a Byzantine peer, in the attack tests only
    s, d = rc.sync, rc.diloco
    wait_s = max(s.deadline_floor_s, s.deadline_factor * inner_seconds)
    mean, stats = allreduce.run(info, delta, wait_s=wait_s, grace_s=max(2.0, 0.25 * wait_s))
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
