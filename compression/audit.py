"""Verified reduction: is a shard's signed result the average of the signed contributions it names?

Robust aggregation (:mod:`potluck.compression.aggregate`) bounds what a *contributor* can do; it
cannot check the *owner* that averages a shard, whose result every member applies. After BTARD
(Gorbunov et al. 2021, "Secure Distributed Training at Scale"), every piece is signed by its author:

* a contributor signs its slice (:func:`~potluck.compression.aggregate.contribution_digest` over each
  encoded chunk and the samples it trained on, its weight), so nobody can pass off other values or another
  weight as its contribution;
* the owner signs its result together with the list of contributions it weighed, each by sender and
  digest (:func:`~potluck.compression.aggregate.result_digest`), before anyone knows who will check it;
* an auditor the coordinator picks after the step gets those contributions (from the owner, who must
  keep them, or from anyone who holds them: the signatures make the holder irrelevant) and
  recomputes the result (:func:`check`).

A mismatch is a proof: the owner's signature over a result, and its contributors' signatures over
inputs that do not make that result. Any machine can check it with this module alone; the
coordinator does before it evicts anyone (an accusation that does not check out costs the accuser
its place instead). Everything here is a pure function of bytes: no network, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from potluck.compression.aggregate import (
    contribution_digest,
    receipt_digest,
    recompute,
    result_digest,
)
from potluck.compression.int8 import Codec
from potluck.compression.stream import Assembler, WireError, tensor_digest
from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.identity import verify
from potluck.protos.runtime.log import short_id


@dataclass(frozen=True)
class Signed:
    """A contribution or a result as its author sent it: the encoded chunks and the signature."""

    chunks: list[pb.Tensor]
    signer: str
    signature: bytes
    digests: list[bytes] = field(default_factory=list)  # each chunk's tensor_digest (computed if empty)
    samples: int = 0  # a contribution's claimed work (its weight, signed with it); unused for a result
    receipt: bytes = b""  # a contribution's receipt: its owner's signature over receipt_digest (b"": none)

    def chunk_digests(self) -> list[bytes]:
        return self.digests or [tensor_digest(t) for t in self.chunks]


@dataclass(frozen=True)
class ResultClaim:
    """What an owner signed about a shard: who it averaged, how, and from which contributions."""

    attempt: int
    contributors: list[str]
    clipped: list[str]
    rejected: list[str]
    inputs: list[str]
    input_digests: list[bytes]
    result: Signed
    weights: list[int] = field(default_factory=list)  # the weight it gave each input, in the order of ``inputs``


@dataclass(frozen=True)
class Round:
    """The round a shard belongs to, as every member signed for it."""

    run_id: str
    step: int
    epoch: int
    shard: int
    num_shards: int
    base_hash: str
    numel: int  # elements of the shard
    handed: Mapping[str, int] = field(default_factory=dict)  # each member's samples of the step (empty: unchecked)


class Unverifiable(ValueError):
    """The material does not allow a verdict (a signature that is not its author's, a result that is not
    the owner's): nobody is proven to have lied by it."""


def result_signed(rnd: Round, claim: ResultClaim) -> bool:
    digest = result_digest(rnd.run_id, rnd.step, rnd.epoch, rnd.shard, rnd.num_shards, claim.attempt, rnd.base_hash,
                           claim.contributors, claim.clipped, claim.rejected, claim.result.chunk_digests(),
                           zip(claim.inputs, claim.input_digests, strict=True), claim.weights)
    return verify(claim.result.signer, digest, claim.result.signature)


def input_digest(rnd: Round, attempt: int, sender: str, contribution: Signed) -> bytes:
    return contribution_digest(rnd.run_id, rnd.step, rnd.epoch, rnd.shard, rnd.num_shards, attempt, rnd.base_hash,
                               sender, contribution.chunk_digests(), contribution.samples)


def check(rnd: Round, claim: ResultClaim, inputs: Mapping[str, Signed], codec: Codec, chunk_bytes: int,
          clip_factor: float, reject_below: float | None) -> str:
    """'' if the signed result is what its signed inputs make; else what the owner lied about, in one line.

    Raises :class:`Unverifiable` when the material proves nothing: the result is not signed by who it
    says, or an input's signature is not its sender's (a forgery by whoever handed it over)."""
    if len(claim.inputs) != len(claim.input_digests) or sorted(claim.inputs) != list(claim.inputs):
        return "its result names its inputs out of order or without their digests"
    if len(claim.weights) != len(claim.inputs):
        return f"its result weighs {len(claim.weights)} of its {len(claim.inputs)} inputs"
    if not result_signed(rnd, claim):
        raise Unverifiable(f"the result of shard {rnd.shard} is not signed by {short_id(claim.result.signer)}")
    named = dict(zip(claim.inputs, claim.input_digests, strict=True))
    if set(claim.contributors) | set(claim.rejected) != set(named) or set(claim.contributors) & set(claim.rejected):
        return "the contributors and rejected it names are not the inputs it signed for"
    decoded: dict[str, torch.Tensor] = {}
    weighed = dict(zip(claim.inputs, claim.weights, strict=True))
    for sender, digest in named.items():
        got = inputs.get(sender)
        if got is None:
            raise Unverifiable(f"no contribution of {short_id(sender)} to shard {rnd.shard} to check")
        shown = input_digest(rnd, claim.attempt, sender, got)  # (every chunk hashed: once)
        if got.signer != sender or not verify(sender, shown, got.signature):
            raise Unverifiable(f"the contribution shown as {short_id(sender)}'s is not signed by it")
        if shown != digest:
            return f"it signed for another contribution of {short_id(sender)} than the one it shows"
        if weighed[sender] != got.samples:
            return (f"it weighed {short_id(sender)}'s contribution as {weighed[sender]} samples; {short_id(sender)} "
                    f"signed it for {got.samples}")
        try:
            asm = Assembler(f"shard{rnd.shard}", rnd.numel, codec)
            for t in got.chunks:
                asm.add(t)
            decoded[sender] = asm.result()
        except WireError as err:
            return f"it averaged a contribution of {short_id(sender)} that does not decode: {err}"
    over = [f"{short_id(s)}'s claim of {inputs[s].samples} samples (it was handed {rnd.handed[s]})" for s in sorted(named)
            if s in rnd.handed and inputs[s].samples > rnd.handed[s]]
    if over:  # (an honest owner refuses such a contribution: it counts for more work than the data it was given)
        return "it averaged " + "; ".join(over)
    honest = recompute({s: decoded[s] for s in named}, rnd.numel, codec, chunk_bytes, f"shard{rnd.shard}",
                       clip_factor, reject_below, {s: inputs[s].samples for s in named})
    lies = []
    for what, said, made in (("contributors", claim.contributors, honest.contributors),
                             ("clipped", claim.clipped, honest.clipped), ("rejected", claim.rejected, honest.rejected)):
        if sorted(said) != sorted(made):
            lies.append(f"it named {', '.join(map(short_id, sorted(said))) or 'nobody'} as {what}; its inputs make "
                        f"{', '.join(map(short_id, sorted(made))) or 'nobody'}")
    got_digests = claim.result.chunk_digests()
    if got_digests != honest.digests:
        wrong = [k for k, (a, b) in enumerate(zip(got_digests, honest.digests, strict=False)) if a != b]
        lies.append(f"its result is not the average of its signed inputs (chunk {wrong[0] if wrong else 0} of "
                    f"{len(honest.digests)} differs{'' if len(got_digests) == len(honest.digests) else ', and their number'})")
    return "; ".join(lies)


def omitted(rnd: Round, claim: ResultClaim, sender: str, contribution: Signed) -> tuple[str, str]:
    """Does a signed result leave out a contribution its signer receipted? ``("lie", what)`` is a proof: the owner
    acknowledged ``sender``'s contribution (its signature over :func:`receipt_digest`) and signed a result that
    does not name it. ``("false", why)`` when the material proves the accusation false: the result names it, or
    the receipt is not the signer's. ``("rightly", why)``: the result does leave it out, and rightly: the
    contribution claims more work than ``rnd`` hands its sender (an honest sender can get there: it trained on an
    earlier decision of the round, and the owner receipted before it knew the round; nobody is to blame). Raises
    :class:`Unverifiable` when it proves nothing either way: the result is not signed by who it says, or the
    contribution is not ``sender``'s."""
    if not result_signed(rnd, claim):
        raise Unverifiable(f"the result of shard {rnd.shard} is not signed by {short_id(claim.result.signer)}")
    digest = input_digest(rnd, claim.attempt, sender, contribution)
    if contribution.signer != sender or not verify(sender, digest, contribution.signature):
        raise Unverifiable(f"the contribution shown as {short_id(sender)}'s is not signed by it")
    owner = claim.result.signer
    if not contribution.receipt or not verify(owner, receipt_digest(digest), contribution.receipt):
        return "false", f"{short_id(sender)} shows no receipt of {short_id(owner)}'s for that contribution"
    named = dict(zip(claim.inputs, claim.input_digests, strict=False))
    if named.get(sender) == digest:
        return "false", f"its result names {short_id(sender)}'s contribution"
    if sender in rnd.handed and contribution.samples > rnd.handed[sender]:
        return "rightly", (f"{short_id(sender)}'s contribution claims {contribution.samples} samples, more than the "
                           f"{rnd.handed[sender]} the round hands it: an owner leaves it out")
    return "lie", (f"it receipted {short_id(sender)}'s contribution to shard {rnd.shard} (attempt {claim.attempt}) "
                  f"and signed a result that {'names another' if sender in named else 'leaves it out'}")


def decode_streams(chunks: Sequence[pb.ShardChunk]) -> dict[str, Signed]:
    """Contributions as they arrive from FetchInputs: each sender's chunks in order, its signature on the last."""
    out: dict[str, Signed] = {}
    pieces: dict[str, list[pb.Tensor]] = {}
    for c in chunks:
        sender = c.header.sender
        if sender in out:
            raise Unverifiable(f"a second contribution of {short_id(sender)} in one answer")
        pieces.setdefault(sender, []).append(c.tensor)
        if c.signature:
            out[sender] = Signed(pieces.pop(sender), c.signer, c.signature, samples=c.samples, receipt=c.receipt)
    if pieces:
        raise Unverifiable(f"unsigned contributions of {', '.join(map(short_id, pieces))}")
    return out
