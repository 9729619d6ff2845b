"""How a shard's owner averages its members' contributions, robustly: the math, no network.

An owner holds every contributor's slice of its shard, decoded to float32. A plain mean lets one
member move everyone's parameters as far as it likes (x1000 moved honest peers ~1650x a normal
step), so by default the owner:

1. **Rejects** a contribution that points against the others (cosine with the coordinate-wise
   median of the *other* contributions below ``reject_below``), when at least three contribute:
   a sign-flipped update is a poisoner's cheapest attack and has an ordinary norm.
2. **Clips** every remaining contribution to ``clip_factor`` x the lower median of their norms
   (Karimireddy et al. 2021 clip around a center; the median norm is the center's scale here): a
   scaled-up update counts like a large honest one, never more.
3. Averages what is left in float32, in sender-id order.

Everything is a deterministic function of the decoded contributions, so an owner's result does not
depend on arrival order, and the members (who all apply the owner's one re-quantized result) stay
bit-identical. With one or two contributors there is no majority to measure against: a run of two
peers is only bounded by the codec's value limit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from potluck.protos import potluck_pb2 as pb


@dataclass
class Reduced:
    mean: torch.Tensor
    contributors: list[str]  # those averaged (clipped ones included)
    clipped: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)


def reduce_mean(contributions: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
    """Mean of decoded contributions, summed in float32 in sender-id order (so it is reproducible).

    Quantized codes are never summed: each contribution is decoded first, so nothing can wrap or
    lose the scale of another member's block.
    """
    acc = torch.zeros(numel, dtype=torch.float32)
    for sender in sorted(contributions):
        acc += contributions[sender].float()
    if contributions:
        acc /= len(contributions)
    return acc


def robust_mean(contributions: Mapping[str, torch.Tensor], numel: int, clip_factor: float = 4.0,
                reject_below: float | None = -0.1) -> Reduced:
    """The owner's average: reject opposed contributions, clip the rest, average (see the module)."""
    senders = sorted(contributions)
    xs = {s: contributions[s].float() for s in senders}
    rejected: list[str] = []
    if reject_below is not None and len(senders) >= 3:
        for s in senders:
            others = torch.stack([xs[o] for o in senders if o != s])
            center = others.median(dim=0).values
            if _cosine(xs[s], center) < reject_below:
                rejected.append(s)
        if len(rejected) * 2 >= len(senders):
            rejected = []  # no majority agrees on a direction: keep everyone (clipping still bounds them)
    kept = [s for s in senders if s not in rejected]
    clipped: list[str] = []
    if clip_factor > 0 and len(kept) >= 2:
        norms = torch.stack([xs[s].norm() for s in kept])
        bound = clip_factor * float(norms.sort().values[(len(kept) - 1) // 2])  # the lower median
        for s, n in zip(kept, norms.tolist(), strict=True):
            if n > bound:
                xs[s] = xs[s] * torch.tensor(bound / n, dtype=torch.float32)
                clipped.append(s)
    return Reduced(reduce_mean({s: xs[s] for s in kept}, numel), kept, clipped, rejected)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0:
        return 1.0  # nothing to compare (a stalled member's zeros, an all-zero center): not opposed
    return float(torch.dot(a, b)) / (na * nb)


def result_digest(run_id: str, step: int, epoch: int, shard: int, num_shards: int, attempt: int, base_hash: str,
                  contributors: Iterable[str], clipped: Iterable[str], rejected: Iterable[str],
                  tensors: Iterable[pb.Tensor]) -> bytes:
    """What the reducer of a shard signs: everything a member applies from its result."""
    h = hashlib.blake2b(digest_size=32, person=b"potluck-result")
    head = f"{run_id}|{step}|{epoch}|{shard}|{num_shards}|{attempt}|{base_hash}|{','.join(contributors)}|" \
           f"{','.join(clipped)}|{','.join(rejected)}"
    h.update(head.encode())
    for t in tensors:
        h.update(t.SerializeToString(deterministic=True))
    return h.digest()
