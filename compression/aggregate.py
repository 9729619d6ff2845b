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
3. Averages what is left in float32, in sender-id order, each weighed by the work in it (see below).

**Weights.** Members of a round train as many inner steps as fit its window (:mod:`potluck.peer.training.window`),
so a contribution carries the samples it was trained on, signed with it, and counts in proportion:
``mean = sum_s w_s x_s / sum_s w_s`` over the kept senders. Clipping compares norms per unit of work,
``|x_s| / w_s ** 0.75``: a pseudo-gradient of more steps is longer, about linearly for a few AdamW steps
and as their square root for many (measured on the built-in model: ``|delta|`` of 1 to 64 steps over
``k ** 0.75`` stays within 0.30-0.44, over ``k`` it falls 3x, over ``sqrt(k)`` it grows 2.5x), so an honest
member even 100x faster or slower than the median is not clipped for its speed, and a poisoner gets no
more room than its claimed work, which the data it was handed bounds. Equal weights take the unweighted
path bit for bit.

Everything is a deterministic function of the decoded contributions, so an owner's result does not
depend on arrival order, and the members (who all apply the owner's one re-quantized result) stay
bit-identical. With one or two contributors there is no majority to measure against: a run of two
peers is only bounded by the codec's value limit.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from potluck.compression.int8 import Codec
from potluck.compression.stream import EncodedStream


@dataclass
class Reduced:
    mean: torch.Tensor
    contributors: list[str]  # those averaged (clipped ones included)
    clipped: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)


WORK_EXPONENT = 0.75  # how a pseudo-gradient's norm grows with the samples in it, for clipping (see the module)
CHUNK = 1 << 16  # elements per pass over the contributions: 256 KB of each, so a pass stays in cache


@dataclass
class Reduction:
    """Who counts in an owner's average and how much: decided from whole-shard statistics, applied
    a chunk at a time by :meth:`mean`, so the owner can encode chunk ``i`` of the result (and send
    it) before chunk ``i + 1`` is summed. Every element of the mean depends only on that element of
    the contributions and the per-sender scales, so any chunking gives the same bits."""

    contributions: Mapping[str, torch.Tensor]
    contributors: list[str]  # kept, in sender-id order: the order of the float32 sum
    clipped: list[str]
    rejected: list[str]
    scales: dict[str, torch.Tensor]  # float32 factor for each clipped contributor
    # float32 factor of each kept sender (its clip scale times its share of the kept weight), when the weights
    # differ; empty: an unweighted mean (sum, then divide by the count)
    factors: dict[str, torch.Tensor] = field(default_factory=dict)

    def mean(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the average, summed in float32 in sender-id order."""
        acc = torch.zeros(hi - lo, dtype=torch.float32)
        if self.factors:
            for s in self.contributors:
                acc += self.contributions[s][lo:hi].float() * self.factors[s]
            return acc
        for s in self.contributors:
            x = self.contributions[s][lo:hi].float()
            acc += x * self.scales[s] if s in self.scales else x
        if self.contributors:
            acc /= len(self.contributors)
        return acc

    def reduced(self, numel: int) -> Reduced:
        return Reduced(self.mean(0, numel), self.contributors, self.clipped, self.rejected)


def reduce_mean(contributions: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
    """Mean of decoded contributions, summed in float32 in sender-id order (so it is reproducible).

    Quantized codes are never summed: each contribution is decoded first, so nothing can wrap or
    lose the scale of another member's block.
    """
    return Reduction(contributions, sorted(contributions), [], [], {}).mean(0, numel)


def robust_mean(contributions: Mapping[str, torch.Tensor], numel: int, clip_factor: float = 4.0,
                reject_below: float | None = -0.1, weights: Mapping[str, int] | None = None) -> Reduced:
    """The owner's average: reject opposed contributions, clip the rest, average (see the module)."""
    return robust_reduction(contributions, numel, clip_factor, reject_below, weights).reduced(numel)


def weight_of(samples: int) -> int:
    """A contribution's weight: the samples it claims, at least 1 (a claim of 0 is the unstated one)."""
    return max(1, int(samples))


def robust_reduction(contributions: Mapping[str, torch.Tensor], numel: int, clip_factor: float = 4.0,
                     reject_below: float | None = -0.1, weights: Mapping[str, int] | None = None) -> Reduction:
    """Decide who is rejected and who clipped from one chunked pass over the contributions. ``weights``: each
    sender's samples (see :func:`weight_of`; a sender not named weighs 1); None or all equal: unweighted."""
    senders = sorted(contributions)
    w = {s: weight_of((weights or {}).get(s, 1)) for s in senders}
    weighted = len(set(w.values())) > 1
    if not weighted:
        w = dict.fromkeys(senders, 1)  # (norms divided by exactly 1.0: the unweighted bits)
    reject = reject_below is not None and len(senders) >= 3
    sq, dots, centers = _statistics([contributions[s] for s in senders], numel, reject)
    rejected = _opposed(senders, sq, dots, centers, reject_below) if reject else []
    kept = [s for s in senders if s not in rejected]
    clipped: list[str] = []
    scale = dict.fromkeys(kept, 1.0)
    if clip_factor > 0 and len(kept) >= 2:
        units = [math.sqrt(sq[senders.index(s)]) / w[s] ** WORK_EXPONENT for s in kept]  # a norm per unit of work
        bound = clip_factor * sorted(units)[(len(kept) - 1) // 2]  # the lower median
        for s, u in zip(kept, units, strict=True):
            if u > bound:
                scale[s] = bound / u
                clipped.append(s)
    scales = {s: torch.tensor(scale[s], dtype=torch.float32) for s in clipped}
    factors: dict[str, torch.Tensor] = {}
    if weighted:
        total = sum(w[s] for s in kept)
        factors = {s: torch.tensor(scale[s] * w[s] / total, dtype=torch.float32) for s in kept}
    return Reduction(contributions, kept, clipped, rejected, scales, factors)


def _opposed(senders: list[str], sq: list[float], dots: list[float], centers: list[float],
             reject_below: float | None) -> list[str]:
    """The senders whose cosine with the others' median is below ``reject_below`` (none without a majority)."""
    rejected: list[str] = []
    for i, s in enumerate(senders):
        na, nb = math.sqrt(sq[i]), math.sqrt(centers[i])
        # nothing to compare (a stalled member's zeros, an all-zero center): not opposed
        if na > 0.0 and nb > 0.0 and dots[i] / (na * nb) < reject_below:  # type: ignore[operator]
            rejected.append(s)
    if len(rejected) * 2 >= len(senders):
        rejected = []  # no majority agrees on a direction: keep everyone (clipping still bounds them)
    return rejected


def _statistics(xs: list[torch.Tensor], numel: int, centers_too: bool) -> tuple[list[float], list[float], list[float]]:
    """Per contribution: its squared norm and, if asked, its dot product with the coordinate-wise lower
    median of the *others* and that center's squared norm, accumulated over chunks in float64.

    One sort per chunk gives every member's center: with ``x_i`` at rank ``r`` of its column, the
    others' lower median (index ``m = (n - 2) // 2`` of the n - 1 others) is the column's value at
    ``m + 1`` if ``r <= m``, else at ``m`` (ties give the same value either way). With three
    contributions the center is simply the smaller of the other two.
    """
    n = len(xs)
    sq, dots, csq = [0.0] * n, [0.0] * n, [0.0] * n
    m = (n - 2) // 2
    for lo in range(0, numel, CHUNK):
        hi = min(numel, lo + CHUNK)
        chunk = [x[lo:hi].float() for x in xs]
        for i, x in enumerate(chunk):
            sq[i] += float(torch.dot(x, x))
        if not centers_too:
            continue
        if n == 3:
            centers = [torch.minimum(chunk[1], chunk[2]), torch.minimum(chunk[0], chunk[2]),
                       torch.minimum(chunk[0], chunk[1])]
        elif n == 4:  # the median of the other three, by min and max (a sort of the stack costs several times more)
            centers = [median3(*(chunk[j] for j in range(4) if j != i)) for i in range(4)]
        else:
            values, order = torch.stack(chunk).sort(dim=0)
            low = order[: m + 1]
            centers = [torch.where((low == i).any(dim=0), values[m + 1], values[m]) for i in range(n)]
        for i, (x, c) in enumerate(zip(chunk, centers, strict=True)):
            dots[i] += float(torch.dot(x, c))
            csq[i] += float(torch.dot(c, c))
    return sq, dots, csq


def median3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Element-wise median of three: one of the three values at each place (the same bits a sort picks)."""
    return torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))


def result_digest(run_id: str, step: int, epoch: int, shard: int, num_shards: int, attempt: int, base_hash: str,
                  contributors: Iterable[str], clipped: Iterable[str], rejected: Iterable[str],
                  digests: Iterable[bytes], inputs: Iterable[tuple[str, bytes]] = (),
                  weights: Iterable[int] = ()) -> bytes:
    """What the reducer of a shard signs: everything a member applies from its result (the
    :func:`tensor_digest` of each of its chunks, in order), and what it was averaged from: each weighed
    contribution's sender and :func:`contribution_digest`, and the weight it gave each (in the order of
    ``inputs``). Signed over all of it, a result is a commitment an auditor can hold its author to
    (:func:`recompute`)."""
    h = hashlib.blake2b(digest_size=32, person=b"potluck-result")
    head = f"{run_id}|{step}|{epoch}|{shard}|{num_shards}|{attempt}|{base_hash}|{','.join(contributors)}|" \
           f"{','.join(clipped)}|{','.join(rejected)}"
    h.update(head.encode())
    for d in digests:
        h.update(d)
    for sender, d in inputs:
        h.update(f"|{sender}|".encode())
        h.update(d)
    h.update(f"|weights|{','.join(str(int(w)) for w in weights)}".encode())
    return h.digest()


def contribution_digest(run_id: str, step: int, epoch: int, shard: int, num_shards: int, attempt: int,
                        base_hash: str, sender: str, digests: Iterable[bytes], samples: int = 0) -> bytes:
    """What a contributor signs over its slice of a shard: the round it is for, the samples it trained on
    (its weight) and each chunk's :func:`tensor_digest`. An owner cannot pass off another slice or another
    weight as this sender's, and an auditor can check that what the owner shows is what the sender sent."""
    h = hashlib.blake2b(digest_size=32, person=b"potluck-contrib")
    h.update(f"{run_id}|{step}|{epoch}|{shard}|{num_shards}|{attempt}|{base_hash}|{sender}|{int(samples)}".encode())
    for d in digests:
        h.update(d)
    return h.digest()


def receipt_digest(contribution: bytes) -> bytes:
    """What an owner signs to acknowledge a contribution (its :func:`contribution_digest`, which names the run,
    step, epoch, shard, attempt, sender, work and chunks): a receipt. A result its owner signs must name every
    contribution it receipted, so a contributor it left out holds a proof (its receipt and the signed result)."""
    h = hashlib.blake2b(digest_size=32, person=b"potluck-receipt")
    h.update(contribution)
    return h.digest()


@dataclass(frozen=True)
class Recomputed:
    """A shard's result as its inputs make it: the digests of its encoded chunks and who counted how."""

    digests: list[bytes]
    contributors: list[str]
    clipped: list[str]
    rejected: list[str]


def recompute(contributions: Mapping[str, torch.Tensor], numel: int, codec: Codec, chunk_bytes: int,
              name: str, clip_factor: float, reject_below: float | None,
              weights: Mapping[str, int] | None = None) -> Recomputed:
    """What an honest owner of these decoded contributions (and their signed weights) signs: the robust average,
    encoded a chunk at a time exactly as :class:`~potluck.compression.stream.EncodedStream` does for the owner.
    Everything is a deterministic function of the contributions, so any two machines get the same digests."""
    red = robust_reduction(contributions, numel, clip_factor, reject_below, weights)
    chunks = EncodedStream(name, numel, red.mean, codec, chunk_bytes)
    return Recomputed(chunks.digests(), red.contributors, red.clipped, red.rejected)
