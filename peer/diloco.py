"""DiLoCo's outer step on a flat float32 ``theta_global`` kept on the CPU.

After H inner AdamW steps a member holds ``theta_local``. The pseudo-gradient is
``delta = theta_global - theta_local``; the members average it (:mod:`potluck.peer.allreduce`) and
every member applies the same outer SGD step with Nesterov momentum (Douillard et al. 2023; lr 0.7,
momentum 0.9)::

    m      <- mu * m + delta
    update <- delta + mu * m        (Nesterov)     or   m    (heavy ball)
    theta  <- theta - lr * update

then resets ``theta_local = theta_global``. The formulas are those of ``torch.optim.SGD`` with
``nesterov=True`` and ``dampening=0``.

Each product and sum is a separate float32 operation (no fused multiply-add, no scalar ``alpha``
arguments), so the result depends only on the inputs, never on the CPU's vector units or on the
torch build: members with the same ``theta``, ``m`` and ``delta`` get bit-identical outputs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from potluck.compression.transfer import Snapshot

CHUNK = 1 << 20


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or Inf in ``x``: one NaN or Inf makes the sum NaN or Inf. 50x faster than
    ``isfinite(x).all()`` on a model-sized vector (no bool temporary); a vector whose float32 sum
    overflows (values near 1e38) counts as not finite too, which a pseudo-gradient never is."""
    return bool(torch.isfinite(x.sum()))


def outer_snapshot(theta: torch.Tensor, momentum: torch.Tensor, version: int, meta: dict | None = None) -> Snapshot:
    """What a member commits after an outer step: ``theta_global`` and the outer momentum.

    ``version`` counts committed outer steps; the snapshot's hash is what members compare to know
    they hold identical state.
    """
    if theta.shape != momentum.shape or theta.dim() != 1:
        raise ValueError(f"theta {tuple(theta.shape)} and momentum {tuple(momentum.shape)} must be equal flat vectors")
    return Snapshot.create({"theta": theta, "momentum": momentum}, version, meta)


def nesterov_step(
    theta: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, lr: float, mu: float, nesterov: bool = True,
    consume: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One outer step; returns new ``(theta, momentum)`` and leaves ``theta`` and ``momentum`` untouched.

    ``consume=True`` lets the step write into ``delta``'s buffer (an owned, freshly averaged vector): the
    new theta is returned in it, and the step allocates only the new momentum. Either way the result
    is bit-for-bit that of the plain float32 formula (separate multiplies and adds, no fused ops).
    """
    if not (theta.shape == momentum.shape == delta.shape):
        raise ValueError(f"shapes differ: theta {tuple(theta.shape)}, momentum {tuple(momentum.shape)}, delta {tuple(delta.shape)}")
    if not all_finite(delta):
        raise ValueError("the averaged pseudo-gradient holds NaN or Inf")
    f32 = torch.float32
    mu_t, lr_t = torch.tensor(mu, dtype=f32), torch.tensor(lr, dtype=f32)
    new_m = torch.mul(momentum, mu_t).add_(delta)  # m' = mu * m + delta
    update = delta if consume else torch.empty_like(delta)
    if nesterov:  # update = delta + mu * m', a chunk at a time: no model-sized temporary
        for k in range(0, delta.numel(), CHUNK):
            torch.add(delta[k : k + CHUNK], torch.mul(new_m[k : k + CHUNK], mu_t), out=update[k : k + CHUNK])
    else:
        update.copy_(new_m)
    new_theta = torch.sub(theta, update.mul_(lr_t), out=update)  # theta' = theta - lr * update
    return new_theta, new_m


def flatten_params(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """All parameters as one flat float32 CPU vector, in the given (canonical) order."""
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params])


def load_flat(params: Iterable[nn.Parameter], flat: torch.Tensor) -> None:
    """Copy a flat vector back into the parameters (the inverse of :func:`flatten_params`)."""
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} elements, parameters take {offset}")
