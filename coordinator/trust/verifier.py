"""The coordinator's own check of an accusation, on a thread of its own, before anyone is evicted.

An auditor that found a lie (:mod:`potluck.peer.reduce.audit`) holds the evidence: the owner's signed result and
the contributions it signed for, each signed by its sender. The coordinator fetches both (from the
auditor, else from the owner and the other members: the signatures make the holder irrelevant) and
rules with :func:`potluck.compression.audit.check`, the same function the auditor ran:

* ``lie``: the owner's signed result is not what its signed inputs make. The owner is evicted and the
  run goes back to before that step (:meth:`potluck.coordinator.rounds.rounds.Rounds.retract`).
* ``false``: the result is what its inputs make. The accusation was a lie of its own: the auditor
  is evicted (so one admitted peer cannot get an honest owner evicted by crying wolf).
* ``unverifiable``: the evidence could not be had or proves nothing (nobody is evicted; the event
  says why).

Fetching and recomputing a shard costs seconds and the shard's bytes; rulings come back through
:meth:`Verifier.results`, so the coordinator's loop never waits on them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace

import grpc

from potluck.compression.audit import ResultClaim, Round, Signed, Unverifiable, check, decode_streams, omitted
from potluck.compression.int8 import Codec
from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.transport import PeerClient
from potluck.protos.runtime.log import get_logger, short_id
from potluck.protos.wire.records import AuditReport
from potluck.protos.wire.refusals import rpc_reason

log = get_logger(__name__)


@dataclass(frozen=True)
class Accusation:
    report: AuditReport
    auditor: str  # '' when the coordinator audits a shard itself (the run's last step: no round comes after it)
    holders: tuple[tuple[str, str], ...]  # (peer id, address): the auditor first, then the owner and others
    num_shards: int
    handed: tuple[tuple[str, int], ...] = ()  # each member's samples of the step: the most work its claim may be


@dataclass(frozen=True)
class Ruling:
    accusation: Accusation
    verdict: str  # lie | false | unverifiable | rightly (an omission that is no fault of anyone's)
    detail: str
    result: str = ""  # the signature (hex) of the result ruled on


class Verifier:
    def __init__(self, client: PeerClient, run_id: str, me: str, codec: Codec, chunk_bytes: int, clip_factor: float,
                 reject_below: float | None, timeout_s: float = 120.0) -> None:
        self.client, self.run_id, self.me, self.codec = client, run_id, me, codec
        self.chunk_bytes, self.clip_factor, self.reject_below, self.timeout_s = (chunk_bytes, clip_factor,
                                                                                 reject_below, timeout_s)
        self._todo: queue.Queue[Accusation | None] = queue.Queue()
        self._done: queue.Queue[Ruling] = queue.Queue()
        self._seen: set[tuple[int, int, int, int, int, str, str, str]] = set()
        self._thread = threading.Thread(target=self._run, name="verifier", daemon=True)
        self._thread.start()

    def want(self, accusation: Accusation) -> bool:
        """Check ``accusation`` (an audit's once per step, epoch, stage, shard and owner; an omission's once per
        accuser too: a false one must not keep a true one, or an audit, from being checked); False if it was seen
        already."""
        r = accusation.report
        key = (r.step, r.epoch, r.stage, r.group, r.shard, r.owner, r.verdict,
               accusation.auditor if r.verdict == "omitted" else "")
        if key in self._seen:
            return False
        self._seen.add(key)
        self._todo.put(accusation)
        return True

    def results(self) -> list[Ruling]:
        out = []
        while not self._done.empty():
            out.append(self._done.get_nowait())
        return out

    def stop(self) -> None:
        self._todo.put(None)

    def _run(self) -> None:
        while (acc := self._todo.get()) is not None:
            try:
                self._done.put(self.rule(acc))
            except Exception as err:  # a bug here must not end the coordinator's checks for good
                log.warning("could not check the accusation against %s: %s", short_id(acc.report.owner), err)
                self._done.put(Ruling(acc, "unverifiable", f"the check failed: {err}"))

    def rule(self, acc: Accusation) -> Ruling:
        if acc.report.verdict == "omitted":
            return self.rule_omission(acc)
        r = acc.report
        failures = []
        for peer, address in acc.holders:
            try:
                claim, rnd = self._result(acc, peer, address)
                inputs = self._inputs(acc, peer, address)
            except (grpc.RpcError, Unverifiable, ValueError) as err:
                failures.append(f"{short_id(peer)}: {rpc_reason(err) if isinstance(err, grpc.RpcError) else err}")
                continue
            try:
                lie = check(rnd, claim, inputs, self.codec, self.chunk_bytes, self.clip_factor, self.reject_below)
            except Unverifiable as err:
                failures.append(f"{short_id(peer)}: {err}")
                continue
            if claim.result.signer != r.owner:
                return Ruling(acc, "unverifiable", f"the result held is signed by {short_id(claim.result.signer)}, "
                              f"not by the accused {short_id(r.owner)}")
            signed = claim.result.signature.hex()
            return (Ruling(acc, "lie", lie, signed) if lie else
                    Ruling(acc, "false", "its result is the average of its signed inputs", signed))
        return Ruling(acc, "unverifiable", "no holder served the evidence (" + "; ".join(failures)[:300] + ")")

    def rule_omission(self, acc: Accusation) -> Ruling:
        """A contributor's proof that an owner left its receipted contribution out of its signed result: the result
        (from the accuser, else any member: its signature makes the holder irrelevant) and the contribution with the
        owner's receipt (only the accuser holds that) ruled with :func:`potluck.compression.audit.omitted`."""
        r, accuser = acc.report, acc.auditor
        address = dict(acc.holders).get(accuser, "")
        try:
            shown = self._inputs(acc, accuser, address).get(accuser)
        except (grpc.RpcError, Unverifiable, ValueError) as err:
            return Ruling(acc, "unverifiable", f"{short_id(accuser)} did not show its receipt: "
                          f"{rpc_reason(err) if isinstance(err, grpc.RpcError) else err}")
        if shown is None:
            return Ruling(acc, "false", f"{short_id(accuser)} shows no contribution of its own to that shard")
        failures = []
        for peer, at in acc.holders:
            try:
                claim, rnd = self._result(acc, peer, at)
                if claim.attempt != r.attempt or claim.result.signer != r.owner:
                    raise Unverifiable(f"its result is attempt {claim.attempt}, signed by {short_id(claim.result.signer)}")
                verdict, detail = omitted(rnd, claim, accuser, shown)
            except (grpc.RpcError, Unverifiable, ValueError) as err:
                failures.append(f"{short_id(peer)}: {rpc_reason(err) if isinstance(err, grpc.RpcError) else err}")
                continue
            return Ruling(acc, verdict, detail)
        return Ruling(acc, "unverifiable", "no holder served the owner's result (" + "; ".join(failures)[:300] + ")")

    def _header(self, r: AuditReport) -> pb.Header:
        return pb.Header(run_id=self.run_id, sender=self.me, step=r.step, epoch=r.epoch)

    def _result(self, acc: Accusation, peer: str, address: str) -> tuple[ResultClaim, Round]:
        r = acc.report
        request = pb.ResultRequest(header=self._header(r), shard=r.shard, num_shards=acc.num_shards, attempt=r.attempt)
        chunks = list(self.client.fetch_result(address, request, self.timeout_s, peer=peer))
        claim, rnd = claim_of(chunks, self.run_id, r.step, r.epoch, r.shard, acc.num_shards)
        return claim, replace(rnd, handed=dict(acc.handed))

    def _inputs(self, acc: Accusation, peer: str, address: str) -> dict[str, Signed]:
        r = acc.report
        request = pb.InputsRequest(header=self._header(r), shard=r.shard, num_shards=acc.num_shards, attempt=r.attempt)
        return decode_streams(list(self.client.fetch_inputs(address, request, self.timeout_s, peer=peer)))


def claim_of(chunks: list[pb.ShardChunk] | Iterator[pb.ShardChunk], run_id: str, step: int, epoch: int, shard: int,
             num_shards: int) -> tuple[ResultClaim, Round]:
    """A result's chunks as its owner signed them, and the round they name (checked against what was asked)."""
    chunks = list(chunks)
    if not chunks or not chunks[-1].signature:
        raise Unverifiable("an empty or unsigned result")
    first, last = chunks[0], chunks[-1]
    if (first.header.step, first.header.epoch, first.shard, first.num_shards) != (step, epoch, shard, num_shards):
        raise Unverifiable(f"a result of another round (step {first.header.step}, shard {first.shard})")
    numel = int(first.tensor.shape[0]) if first.tensor.shape else 0
    rnd = Round(run_id, step, epoch, shard, num_shards, first.base_hash, numel)
    claim = ResultClaim(first.attempt, list(first.contributors), list(first.clipped), list(first.rejected),
                        list(first.inputs), list(first.input_digests),
                        Signed([c.tensor for c in chunks], last.signer, last.signature), list(first.weights))
    return claim, rnd
