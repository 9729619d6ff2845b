"""DiLoCo's outer step on a flat float32 ``theta_global`` kept on the CPU.

After H inner AdamW steps a member holds ``theta_local``. The pseudo-gradient is
``delta = theta_global - theta_local``; the members average it (:mod:`potluck.peer.reduce.allreduce`) and
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


def outer_snapshot(theta: torch.Tensor, momentum: torch.Tensor, version: int, meta: dict | None = None,
                   hash_later: bool = False) -> Snapshot:
    """What a member commits after an outer step: ``theta_global`` and the outer momentum.

    ``version`` counts committed outer steps; the snapshot's hash is what members compare to know
    they hold identical state (``hash_later``: computed on a background thread, see :class:`Snapshot`).
    """
    if theta.shape != momentum.shape or theta.dim() != 1:
        raise ValueError(f"theta {tuple(theta.shape)} and momentum {tuple(momentum.shape)} must be equal flat vectors")
    return Snapshot.create({"theta": theta, "momentum": momentum}, version, meta, hash_later=hash_later)


def nesterov_step(
    theta: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, lr: float, mu: float, nesterov: bool = True,
    consume: bool = False, momentum_out: torch.Tensor | None = None, checked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One outer step; returns new ``(theta, momentum)`` and leaves ``theta`` and ``momentum`` untouched.

    ``consume=True`` lets the step write into ``delta``'s buffer (an owned, freshly averaged vector): the
    new theta is returned in it. ``momentum_out``: where the new momentum goes (else a new vector).
    Either way the result is bit-for-bit that of the plain float32 formula (separate multiplies and
    adds, no fused ops), computed a cache-sized chunk at a time: each value is read and written once,
    where whole-vector operations would stream the vectors through memory five times. ``checked``: the
    caller already knows ``delta`` is finite (else the step refuses NaN and Inf before writing anything).
    """
    if not (theta.shape == momentum.shape == delta.shape):
        raise ValueError(f"shapes differ: theta {tuple(theta.shape)}, momentum {tuple(momentum.shape)}, delta {tuple(delta.shape)}")
    if momentum_out is not None and momentum_out.shape != momentum.shape:
        raise ValueError(f"momentum_out {tuple(momentum_out.shape)} does not fit momentum {tuple(momentum.shape)}")
    if not checked and not all_finite(delta):
        raise ValueError("the averaged pseudo-gradient holds NaN or Inf")
    f32 = torch.float32
    mu_t, lr_t = torch.tensor(mu, dtype=f32), torch.tensor(lr, dtype=f32)
    new_m = momentum_out if momentum_out is not None else torch.empty_like(momentum)
    update = delta if consume else torch.empty_like(delta)
    scratch = torch.empty(min(CHUNK, delta.numel()), dtype=f32)
    for k in range(0, delta.numel(), CHUNK):
        d, m = delta[k : k + CHUNK], new_m[k : k + CHUNK]
        torch.mul(momentum[k : k + CHUNK], mu_t, out=m).add_(d)  # m' = mu * m + delta
        u = scratch[: d.numel()]
        if nesterov:  # update = delta + mu * m' (float addition commutes: the same bits either way round)
            torch.mul(m, mu_t, out=u).add_(d)
        else:
            u.copy_(m)
        torch.sub(theta[k : k + CHUNK], u.mul_(lr_t), out=update[k : k + CHUNK])  # theta' = theta - lr * update
    return update, new_m


def host_vector(numel: int, pinned: bool = False) -> torch.Tensor:
    """A float32 vector in host memory; ``pinned`` (page-locked) for a CUDA peer: copies to and from the
    device then run asynchronously at the bus's speed instead of through a driver staging buffer, and
    torch's host allocator keeps a freed pinned block for the next request, so after the first outer
    step a vector costs neither an allocation nor page faults."""
    if pinned:
        try:
            return torch.empty(numel, dtype=torch.float32, pin_memory=True)
        except RuntimeError:  # no memory left to lock: pageable still works, only slower
            pass
    return torch.empty(numel, dtype=torch.float32)


def flatten_params(params: Iterable[nn.Parameter], out: torch.Tensor | None = None) -> torch.Tensor:
    """All parameters as one flat float32 CPU vector, in the given (canonical) order, in ``out`` if given.

    From a GPU, one copy per parameter straight into its place in the vector (no per-parameter host
    tensors, no concatenation), asynchronous into a pinned ``out``, with one wait at the end; on CPU,
    one concatenation into ``out`` (copied, and its pages touched, by every thread at once).
    """
    params = list(params)
    numel = sum(p.numel() for p in params)
    if out is None:
        out = torch.empty(numel, dtype=torch.float32)
    elif out.shape != (numel,) or out.dtype != torch.float32 or out.device.type != "cpu":
        raise ValueError(f"out is {out.dtype} {tuple(out.shape)} on {out.device}; the parameters need {numel} float32 on cpu")
    if all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params):  # one parallel copy
        return torch.cat([p.detach().reshape(-1) for p in params], out=out)
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            out[offset : offset + n].view_as(p).copy_(p.detach(), non_blocking=True)
            offset += n
    _wait_for_copies(params)
    return out


def load_flat(params: Iterable[nn.Parameter], flat: torch.Tensor) -> None:
    """Copy a flat vector back into the parameters (the inverse of :func:`flatten_params`); from a pinned
    vector to a GPU, asynchronously, with one wait at the end. A vector of the wrong size changes nothing."""
    params = list(params)
    numel = sum(p.numel() for p in params)
    if flat.numel() != numel:
        raise ValueError(f"flat vector has {flat.numel()} elements, parameters take {numel}")
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p), non_blocking=True)
            offset += n
    _wait_for_copies(params)


def _wait_for_copies(params: list[nn.Parameter]) -> None:
    """Wait for the asynchronous copies to or from the parameters' GPUs (none on CPU): the host may read
    the vector, or let it go, only after."""
    for device in {p.device for p in params if p.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()
