"""Streaming outer steps (``sync.fragments = F``; Streaming DiLoCo, Douillard et al. 2025): which slice of a
stage's flat vector an outer step syncs, and that slice's outer step.

The stage's ``n`` parameters are cut into ``F`` contiguous fragments of ``m`` elements each, ``m`` being
``ceil(n / F)`` rounded up to the codec's alignment (so the all-reduce's shards of the fragment start on block
boundaries); the last fragment is shorter (possibly empty) and its vector is zero-padded to ``m``. Outer step
``s`` syncs fragment ``(s - 1) mod F`` only::

    delta_f       <- theta_global[f] - theta_local[f]      (F rounds of inner steps: f was synced F steps ago)
    mean_f        <- all-reduce(pad(delta_f, m))           (m elements: 1/F of the bytes)
    theta_global[f], m[f] <- Nesterov(theta_global[f], m[f], mean_f)     (the other fragments unchanged)
    theta_local[f] <- alpha theta_local[f] + (1 - alpha) theta_global[f]    (the others train on, untouched)

``alpha`` is ``sync.fragment_alpha`` (:func:`mix`): 0 takes the new global values whole; the paper mixes the local
ones back in (its ``alpha``). Only the local copy mixes: ``theta_global`` is the same for every member either way.
With overlapped outer steps the fragment lands a phase later and keeps what that phase trained on it:
``theta_local[f] <- mix(theta_local[f] at the send, theta_global[f]) + (theta_local[f] now - at the send)``.

The step depends only on the step number, so a run resumed from a checkpoint at step ``s`` continues the same
schedule, and every member of a stage commits the same ``theta_global`` and momentum bits, as with ``F = 1``
(which is the plain outer step: :func:`potluck.peer.outer.outer.outer_step` keeps its own path for it). Nesterov is
elementwise, so the step on a slice gives the bits the step on the whole vector gives there.
"""

from __future__ import annotations

import torch

from potluck.peer.outer.diloco import nesterov_step


def fragment_size(n: int, fragments: int, align: int = 1) -> int:
    """``m``: the elements of every fragment's all-reduce vector (``ceil(n / F)`` up to a multiple of ``align``)."""
    if fragments < 1 or align < 1 or n < 0:
        raise ValueError(f"fragment_size({n}, {fragments}, {align}): needs n >= 0, fragments >= 1 and align >= 1")
    m = -(-n // fragments)
    return -(-m // align) * align


def fragment_of(step: int, fragments: int) -> int:
    """The fragment outer step ``step`` (1, 2, ...) syncs."""
    return (step - 1) % fragments


def fragment_bounds(n: int, fragments: int, align: int, f: int) -> tuple[int, int]:
    """``[lo, hi)``: fragment ``f``'s elements of the stage's ``n`` (``hi - lo <= m``; the last may be short)."""
    m = fragment_size(n, fragments, align)
    return min(f * m, n), min((f + 1) * m, n)


def fragment_delta(theta_global: torch.Tensor, theta_local: torch.Tensor, lo: int, hi: int, m: int) -> torch.Tensor:
    """``pad(theta_global[lo:hi] - theta_local[lo:hi], m)``: the fragment's pseudo-gradient, as the all-reduce
    of ``m`` elements takes it (a fresh vector)."""
    out = torch.zeros(m, dtype=torch.float32)
    torch.sub(theta_global[lo:hi], theta_local[lo:hi], out=out[: hi - lo])
    return out


def mix(local: torch.Tensor, global_: torch.Tensor, alpha: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``alpha * local + (1 - alpha) * global_`` (into ``out`` if given): a synced fragment's new local values. At
    ``alpha = 0`` exactly ``global_``'s bits (the plain streaming step)."""
    if alpha == 0.0:
        return global_.clone() if out is None else out.copy_(global_)
    res = local.mul(alpha).add_(global_, alpha=1.0 - alpha)  # (a fresh vector: ``out`` may be ``local`` itself)
    return res if out is None else out.copy_(res)


def fragment_step(theta: torch.Tensor, momentum: torch.Tensor, mean: torch.Tensor, lo: int, hi: int, lr: float,
                  mu: float, nesterov: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """New ``(theta, momentum)`` (fresh vectors): Nesterov on ``[lo, hi)`` from the fragment's averaged
    pseudo-gradient ``mean`` (its padding ignored), every other element copied as it was."""
    new_theta, new_m = theta.clone(), momentum.clone()
    if hi > lo:
        t, m = nesterov_step(theta[lo:hi], momentum[lo:hi], mean[: hi - lo].contiguous(), lr, mu, nesterov)
        new_theta[lo:hi], new_m[lo:hi] = t, m
    return new_theta, new_m
