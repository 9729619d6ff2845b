"""The receiving half of the outer all-reduce: contributions and results of the expected step, checked.

Messages for a step can arrive before this member reaches it (it may still be running inner steps);
the inbox keeps them, checked, until it does, and drops what the round, once known, shows to come from
non-members. Nothing is stored until a whole stream checks out (run, step, epoch, membership, base
state, shard bounds, signature). The step that ends is kept, with its results and an owner's signed
inputs, for :data:`KEEP_STEPS` steps: audits of it ask for them (FetchResult, FetchInputs).

The procedure (:class:`~potluck.peer.reduce.allreduce.AllReduce`) holds one inbox and reaches it only through its public
methods: it hands over what it makes itself (its own contribution, its own results, what it sent), closes a shard
when it reduces it, and reads what arrived. Both share one condition, which the procedure makes and passes in:
it waits on it for what arrives here, and its :class:`~potluck.peer.reduce.reduceround.ReduceRound` notifies it too.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from potluck.compression.aggregate import contribution_digest, receipt_digest, result_digest
from potluck.compression.audit import ResultClaim, Signed
from potluck.compression.audit import Round as AuditRound
from potluck.compression.int8 import Codec
from potluck.compression.stream import Assembler, WireError, tensor_digest
from potluck.peer.reduce.audit import HeldResult
from potluck.peer.reduce.shards import Buffers, Outcome, RoundInfo, ShardResult, shard_bounds
from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.identity import verify
from potluck.protos.runtime.log import get_logger, short_id
from potluck.protos.testkit.faults import tamper
from potluck.protos.wire.refusals import Rejected

log = get_logger(__name__)

MAX_PENDING_SENDERS = 4096
KEEP_STEPS = 3  # steps kept for audits: encoded results and inputs, about 2 bytes a parameter each


@dataclass(frozen=True)
class Kept:
    """What a member keeps of a step that ended: its results and (an owner's) inputs."""

    step: int
    epoch: int
    base_hash: str
    round: RoundInfo
    results: dict[int, tuple[list[pb.Tensor], Outcome, list[bytes]]]
    inputs: dict[tuple[int, int], dict[str, Signed]]
    sent: dict[tuple[int, int], Signed]


def overclaim(info: RoundInfo, sender: str, samples: int) -> str:
    """Why a contribution claiming ``samples`` is refused ('' if it is not): its replica was handed fewer for the
    step (the coordinator's share, which every member reads from the same round)."""
    handed = info.handed_to(sender)
    if handed is None or samples <= handed:
        return ""
    return (f"{short_id(sender)} claims {samples} samples of step {info.step}; its replica was handed {handed}: "
            "no contribution counts for more work than the data it was given")


class ShardInbox:
    """The receiving half of one peer's outer all-reduce: what arrives for the expected step, checked.

    It holds, for the step it expects (:meth:`expect`), the contributions to the shards this member
    reduces, the owners' results, and the last few steps kept for audits. All of it is guarded by
    ``cond``, a Condition the procedure (:class:`~potluck.peer.reduce.allreduce.AllReduce`) owns and passes in:
    the procedure waits on it for what arrives, and may hold it across several calls here to read one
    consistent view (so its lock must be re-entrant, as a plain ``Condition()``'s is: each method takes it
    again). gRPC handler threads and the procedure's threads touch this state only under it, and every
    arrival notifies it.
    """

    def __init__(self, *, run_id: str, me: str, numel: int, codec: Codec, cond: threading.Condition,
                 sign: Callable[[bytes], bytes] | None = None) -> None:
        self.run_id, self.me, self.numel, self.codec = run_id, me, numel, codec
        self._sign = sign  # (this member's key: each contribution it keeps is receipted; None: no receipts)
        self.tamper = tamper  # (a Byzantine owner's refusals, in tests: POTLUCK_FAULTS owner.refuse)
        self._cond = cond
        self._buffers = Buffers()
        self._step = -1
        self._epoch = 0
        self._base_hash: str | Future[str] = ""  # read _base
        self._round: RoundInfo | None = None
        self._contribs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        # each contribution as its sender signed it, kept to show an auditor what a result was averaged from
        self._inputs: dict[tuple[int, int], dict[str, Signed]] = {}
        # the last few steps: their results and (an owner's) inputs, for audits of them (an auditor learns of its
        # audit from the coordinator's next round, which a peer running ahead on the last plan may see late)
        self._kept: dict[tuple[int, int], Kept] = {}
        self._evidence: dict[tuple[int, int, int, int], dict[str, Signed]] = {}  # inputs fetched in an audit
        # results that left out this member's receipted contribution, kept as they were signed (one not adopted for
        # want of a quorum is gone from the results): the coordinator fetches them to check the proof
        self._evidence_results: dict[tuple[int, int, int, int], tuple[list[pb.Tensor], Outcome, str]] = {}
        self._sent: dict[tuple[int, int], Signed] = {}  # this member's own contributions, as it signed them
        self._closed: set[tuple[int, int]] = set()
        self._results: dict[int, ShardResult] = {}
        # a take-over's result that came while the owner's was still held: it replaces the owner's if that is dropped
        self._later: dict[int, ShardResult] = {}
        self._taken_over: set[int] = set()
        self._abstained: set[str] = set()  # members that said they contribute nothing to the expected step

    # ---------------------------------------------------------------- state of the coming step

    def expect(self, step: int, base_hash: str | Future[str], epoch: int = 0) -> None:
        """Accept messages for ``step`` (of ``epoch``), computed from the theta_global whose hash is
        ``base_hash`` (or will be: it is asked for when the first message comes, long after it is
        computed unless the others' inner phases are shorter than hashing); everything held for
        another step is dropped."""
        with self._cond:
            if self._round is not None and step != self._step:  # the step that ends is kept for its audits
                self._kept[(self._step, self._epoch)] = Kept(
                    self._step, self._epoch, self._base, self._round,
                    {j: (r.chunks, r.outcome, r.digests) for j, r in self._results.items()},
                    {k: dict(v) for k, v in self._inputs.items()}, dict(self._sent))
                for old in sorted(self._kept)[:-KEEP_STEPS]:
                    del self._kept[old]
            self._step, self._base_hash, self._epoch, self._round = step, base_hash, epoch, None
            self._reset()
            self._cond.notify_all()

    def expecting(self) -> tuple[int, str]:
        """The expected step and the hash of the theta_global it is computed from (waited for if still hashed)."""
        with self._cond:
            return self._step, self._base

    @property
    def _base(self) -> str:
        b = self._base_hash
        return b if isinstance(b, str) else b.result()

    def _reset(self) -> None:
        """Forget everything held for the step (under the lock); its buffers serve the next one."""
        self._buffers.give([t for by_sender in self._contribs.values() for s, t in by_sender.items() if s != self.me])
        self._buffers.give([r.values for r in (*self._results.values(), *self._later.values())])
        self._contribs.clear()
        self._inputs.clear()
        self._sent.clear()
        self._closed.clear()
        self._results.clear()
        self._later.clear()
        self._taken_over.clear()
        self._abstained.clear()

    def set_round(self, info: RoundInfo) -> bool:
        """Learn the members of the expected step; drops anything already received from non-members.
        False (and nothing changes) if ``info`` is not of the expected step."""
        with self._cond:
            if info.step != self._step:
                return False
            if info.epoch != self._epoch:  # decided again after a failure: what came for the old epoch is void
                self._epoch = info.epoch
                self._reset()
            self._round = info
            members = set(info.ids)
            for key, by_sender in self._contribs.items():
                for sender in [s for s in by_sender if s not in members]:
                    log.warning("dropping contribution from %s: not a member of step %d", short_id(sender), info.step)
                    del by_sender[sender]
                for sender in list(by_sender):
                    if why := overclaim(info, sender, self._inputs[key][sender].samples):
                        log.warning("dropping contribution from %s: %s", short_id(sender), why)
                        del by_sender[sender]
                        del self._inputs[key][sender]
            for held in (self._results, self._later):
                for shard, res in list(held.items()):
                    try:
                        self._check_signed(shard, info.shards, res.digests, res.outcome, info)
                    except Rejected as err:
                        log.warning("dropping a result received before the round was known: %s", err.reason)
                        del held[shard]
            return True

    def abstains(self, header: pb.Header) -> None:
        """``header.sender`` says it contributes nothing to ``header.step`` (of ``header.epoch``): its owners stop
        waiting for it. (Authenticated by the caller's certificate; it speaks for itself only.)"""
        with self._cond:
            if (header.run_id, header.step, header.epoch) == (self.run_id, self._step, self._epoch):
                self._abstained.add(header.sender)
                self._cond.notify_all()

    def pending_contributions(self) -> int:
        """Contributions held for the expected step (for tests and the status page)."""
        with self._cond:
            return sum(len(v) for v in self._contribs.values())

    def result_count(self) -> int:
        with self._cond:
            return len(self._results)

    # ---------------------------------------------------------------- RPC handlers

    def _check_header(self, chunk: pb.ShardChunk) -> None:
        h = chunk.header
        if h.run_id != self.run_id:
            raise Rejected(pb.UNKNOWN_RUN, f"unknown run id {h.run_id!r}")
        if h.epoch != self._epoch:  # (first: a later epoch is later whatever its step; a rollback's is lower)
            raise Rejected(pb.WRONG_EPOCH, f"message for epoch {h.epoch} of step {h.step}, this peer runs epoch "
                           f"{self._epoch}", at_step=self._step, at_epoch=self._epoch)
        if h.step != self._step:
            raise Rejected(pb.WRONG_STEP, f"message for step {h.step}, this peer is at step {self._step}",
                           at_step=self._step)
        if self._round is not None and h.sender not in self._round.ids:  # who sends it first, then what
            raise Rejected(pb.NOT_A_MEMBER, f"{short_id(h.sender)} is not a member of step {h.step}")
        if chunk.base_hash != self._base:
            raise Rejected(pb.BASE_MISMATCH, f"base hash mismatch: sender computed from {chunk.base_hash[:12]}, "
                           f"this peer holds {self._base[:12]}")
        if self._round is not None:
            if chunk.num_shards != self._round.shards:
                raise Rejected(pb.BAD_MESSAGE, f"num_shards {chunk.num_shards} but step {h.step} has "
                               f"{self._round.shards} shards")
        if not 0 <= chunk.shard < chunk.num_shards:
            raise Rejected(pb.BAD_MESSAGE, f"shard {chunk.shard} outside [0, {chunk.num_shards})")

    def _receive(self, chunks: Iterator[pb.ShardChunk], digests: list[bytes] | None = None,
                 ) -> tuple[pb.ShardChunk, torch.Tensor, list[pb.Tensor], pb.ShardChunk]:
        """Validate and decode a whole stream; nothing is stored until it all checks out. Returns the
        first chunk (its header), the values, the raw tensors and the last chunk (its signature); each
        chunk's digest goes to ``digests`` (a result's, for its signature) as it arrives."""
        first: pb.ShardChunk | None = None
        last: pb.ShardChunk | None = None
        assembler: Assembler | None = None
        kept: list[pb.Tensor] = []
        try:
            for chunk in chunks:
                try:
                    with self._cond:
                        self._check_header(chunk)
                except Rejected as r:
                    r.sender = chunk.header.sender
                    raise
                if first is None:
                    first = chunk
                    start, end = shard_bounds(self.numel, chunk.num_shards, self.codec.align)[chunk.shard]
                    assembler = Assembler(f"shard{chunk.shard}", end - start, self.codec,
                                          out=self._buffers.take(end - start))
                elif (chunk.header.sender, chunk.shard, chunk.num_shards, chunk.attempt, chunk.samples) != (
                    first.header.sender, first.shard, first.num_shards, first.attempt, first.samples
                ):
                    raise Rejected(pb.BAD_MESSAGE, "chunk header changed within one stream")
                assert assembler is not None
                held = assembler.add(chunk.tensor)
                kept.append(chunk.tensor)
                if digests is not None:
                    digests.append(tensor_digest(chunk.tensor, held))
                last = chunk
            if first is None or assembler is None or last is None:
                raise Rejected(pb.BAD_MESSAGE, "empty stream")
            return first, assembler.result(), kept, last
        except WireError as err:
            raise Rejected(pb.BAD_MESSAGE, str(err), first.header.sender if first else "") from None
        except Rejected as r:
            r.sender = r.sender or (first.header.sender if first else "")
            raise

    def on_contribution(self, chunks: Iterator[pb.ShardChunk]) -> pb.Ack:
        digests: list[bytes] = []
        first, values, kept, last = self._receive(chunks, digests)
        key = (first.shard, first.attempt)
        sender = first.header.sender
        signed = contribution_digest(self.run_id, first.header.step, first.header.epoch, first.shard, first.num_shards,
                                     first.attempt, first.base_hash, sender, digests, first.samples)
        if last.signer != sender or not verify(sender, signed, last.signature):
            raise Rejected(pb.BAD_IDENTITY, f"contribution of {short_id(sender)} not signed by it", sender)
        if self.tamper("owner.refuse", first.header.step, False) is True:  # an owner that refuses everything (tests)
            raise Rejected(pb.OVERLOADED, "this owner takes no contribution", sender)
        with self._cond:
            self._check_header(first)  # the step may have moved on while the stream arrived
            if self._round is not None and (why := overclaim(self._round, sender, first.samples)):
                raise Rejected(pb.OVERCLAIM, why, sender)
            if self._round is not None and first.attempt == 0 and first.shard != self._round.shard:
                raise Rejected(pb.NOT_OWNER, f"shard {first.shard} is not owned by this peer")
            if key in self._closed or (first.attempt == 0 and first.shard in self._taken_over):
                raise Rejected(pb.ALREADY_REDUCED, f"shard {first.shard} of step {self._step} is already reduced")
            by_sender = self._contribs.setdefault(key, {})
            if first.header.sender in by_sender:
                raise Rejected(pb.DUPLICATE, f"duplicate contribution from {short_id(first.header.sender)}")
            if self._round is None and sum(len(v) for v in self._contribs.values()) >= MAX_PENDING_SENDERS:
                raise Rejected(pb.OVERLOADED, "too many contributions before the round is known")
            by_sender[first.header.sender] = values
            self._inputs.setdefault(key, {})[sender] = Signed(kept, sender, last.signature, digests, first.samples)
            self._cond.notify_all()
        # (signed once it is kept: this shard's result must now name it, or the sender holds a proof)
        receipt = self._sign(receipt_digest(signed)) if self._sign is not None else b""
        return pb.Ack(received_bytes=sum(t.ByteSize() for t in kept), receipt=receipt)

    def on_result(self, chunks: Iterator[pb.ShardChunk]) -> pb.Ack:
        digests: list[bytes] = []
        first, values, kept, last = self._receive(chunks, digests)
        outcome = Outcome(first.attempt, list(first.contributors), list(first.clipped), list(first.rejected),
                          last.signer, last.signature, list(first.inputs), list(first.input_digests),
                          [int(w) for w in first.weights])
        with self._cond:
            self._check_header(first)
            shard = first.shard
            if self._round is not None:
                self._check_signed(shard, self._round.shards, digests, outcome, self._round)
            if first.attempt == 0 and shard in self._taken_over:
                raise Rejected(pb.TAKEN_OVER, f"shard {shard} of step {self._step} was taken over")
            held = self._results.get(shard)
            if held is None:
                self._results[shard] = ShardResult(values, kept, outcome, digests)
                self._cond.notify_all()
            elif held.outcome.attempt < first.attempt and shard not in self._later:
                # (a take-over's, before this member judged the owner's short: kept for when it does; adopting it
                # now would let members end on different results)
                self._later[shard] = ShardResult(values, kept, outcome, digests)
            elif not torch.equal(held.values, values):
                log.warning("ignoring a second, different result for shard %d of step %d", shard, self._step)
        return pb.Ack(received_bytes=sum(t.ByteSize() for t in kept))

    def _check_signed(self, shard: int, num_shards: int, digests: list[bytes], outcome: Outcome,
                      rnd: RoundInfo) -> None:
        """A result must be signed by its shard's owner (attempt 0, also when a backup forwards it) or, after
        a take-over (attempt > 0), by another member: whoever delivers it, nobody can forge one."""
        owners = rnd.shard_owners
        owner = owners[shard] if shard < len(owners) else ""
        signer = outcome.signer
        if signer not in owners or (outcome.attempt == 0) != (signer == owner):
            raise Rejected(pb.BAD_IDENTITY, f"result of shard {shard} (attempt {outcome.attempt}) signed by "
                           f"{short_id(signer) or 'nobody'}, not by {'its owner' if outcome.attempt == 0 else 'a taker'}")
        if not len(outcome.inputs) == len(outcome.input_digests) == len(outcome.weights):
            raise Rejected(pb.BAD_MESSAGE, f"result of shard {shard} names {len(outcome.inputs)} inputs, "
                           f"{len(outcome.input_digests)} digests and {len(outcome.weights)} weights")
        digest = result_digest(self.run_id, self._step, self._epoch, shard, num_shards, outcome.attempt,
                               self._base, outcome.contributors, outcome.clipped, outcome.rejected, digests,
                               zip(outcome.inputs, outcome.input_digests, strict=True), outcome.weights)
        if not verify(signer, digest, outcome.signature):
            raise Rejected(pb.BAD_IDENTITY, f"bad signature on the result of shard {shard} from {short_id(signer)}")

    def on_fetch_result(self, request: pb.ResultRequest) -> Iterator[pb.ShardChunk]:
        """A result of the running step, or of the step before (for an audit of it)."""
        h = request.header
        with self._cond:
            if h.run_id != self.run_id:
                raise Rejected(pb.UNKNOWN_RUN, f"unknown run id {h.run_id!r}")
            found: tuple[list[pb.Tensor], Outcome] | None = None
            if (e := self._evidence_results.get((h.step, h.epoch, request.shard, request.attempt))) is not None:
                found, step, epoch, base = (e[0], e[1]), h.step, h.epoch, e[2]
            elif h.step == self._step and request.shard in self._results:
                res = self._results[request.shard]
                found, step, epoch, base = (res.chunks, res.outcome), self._step, self._epoch, self._base
            elif (k := self._kept.get((h.step, h.epoch))) is not None and request.shard in k.results:
                chunks, outcome, _ = k.results[request.shard]
                found, step, epoch, base = (chunks, outcome), k.step, k.epoch, k.base_hash
            if found is None:
                raise Rejected(pb.NO_STATE, f"no result for shard {request.shard} of step {h.step}")
            hdr = pb.Header(run_id=self.run_id, sender=self.me, step=step, epoch=epoch)
        yield from result_stream(hdr, request.shard, request.num_shards, base, found[0], found[1])

    def on_fetch_inputs(self, request: pb.InputsRequest) -> Iterator[pb.ShardChunk]:
        """The contributions a shard's result was averaged from, each as its sender signed it: an owner's of the
        step before (or the running one), or the evidence an audit kept."""
        h = request.header
        key = (request.shard, request.attempt)
        with self._cond:
            if h.run_id != self.run_id:
                raise Rejected(pb.UNKNOWN_RUN, f"unknown run id {h.run_id!r}")
            held: dict[str, Signed] | None = self._evidence.get((h.step, h.epoch, request.shard, request.attempt))
            base, num_shards = "", request.num_shards
            if held is None and (k := self._kept.get((h.step, h.epoch))) is not None:
                held, base, num_shards = k.inputs.get(key), k.base_hash, k.round.shards
            elif held is None and (h.step, h.epoch) == (self._step, self._epoch) and key in self._closed:
                held, base = self._inputs.get(key), self._base
            if held is None:
                raise Rejected(pb.NO_STATE, f"no inputs of shard {request.shard} of step {h.step} (epoch {h.epoch})")
        for sender in sorted(set(held) - set(request.skip)):
            c = held[sender]
            hdr = pb.Header(run_id=self.run_id, sender=sender, step=h.step, epoch=h.epoch)
            for i, t in enumerate(c.chunks):
                chunk = pb.ShardChunk(header=hdr, shard=request.shard, num_shards=num_shards, attempt=request.attempt,
                                      base_hash=base, tensor=t, samples=c.samples)
                if i == len(c.chunks) - 1:
                    chunk.signer, chunk.signature, chunk.receipt = c.signer, c.signature, c.receipt
                yield chunk

    def held_result(self, step: int, epoch: int, shard: int) -> HeldResult | None:
        """The signed result of ``shard`` of the step before, as this member received it (for an audit)."""
        with self._cond:
            k = self._kept.get((step, epoch))
            if k is None or shard not in k.results:
                return None
            chunks, o, digests = k.results[shard]
            numel = int(chunks[0].shape[0]) if chunks and chunks[0].shape else 0
            claim = ResultClaim(o.attempt, o.contributors, o.clipped, o.rejected, o.inputs, o.input_digests,
                                Signed(chunks, o.signer, o.signature, digests), o.weights)
            handed = dict(zip(k.round.ids, k.round.handed, strict=True)) if k.round.handed else {}
            return HeldResult(claim, AuditRound(self.run_id, step, epoch, shard, k.round.shards, k.base_hash, numel, handed))

    def own_input(self, step: int, epoch: int, shard: int, attempt: int) -> Signed | None:
        """This member's contribution to a shard of a kept step, as it signed it (an auditor need not fetch it)."""
        with self._cond:
            k = self._kept.get((step, epoch))
            if k is None:
                return None
            return k.sent.get((shard, attempt)) or k.inputs.get((shard, attempt), {}).get(self.me)

    def keep_result_evidence(self, step: int, epoch: int, shard: int, result: ShardResult) -> None:
        """A result that left out this member's receipted contribution, as its signer signed it: served (FetchResult,
        by attempt) even once it is dropped or the step is gone from the kept ones."""
        with self._cond:
            o = result.outcome
            self._evidence_results[(step, epoch, shard, o.attempt)] = (result.chunks, o, self._base)
            for old in sorted(self._evidence_results)[:-4]:
                del self._evidence_results[old]

    def keep_evidence(self, step: int, epoch: int, shard: int, attempt: int, inputs: dict[str, Signed]) -> None:
        """Inputs an audit found a lie with, or this member's own receipted contribution an owner left out: served
        to the coordinator (FetchInputs) for its own check."""
        with self._cond:
            self._evidence[(step, epoch, shard, attempt)] = {**self._evidence.get((step, epoch, shard, attempt), {}),
                                                             **inputs}
            for old in sorted(self._evidence)[:-4]:
                del self._evidence[old]

    # ---------------------------------------------------------------- what the procedure hands in and reads

    def add_own_contribution(self, info: RoundInfo, shard: int, attempt: int, signed: Signed) -> None:
        """This member's own slice of a shard it reduces, encoded and signed as any contributor sends it (by the
        procedure): decoded here like any other, so what it averages is what an auditor can check."""
        lo, hi = shard_bounds(self.numel, info.shards, self.codec.align)[shard]
        asm = Assembler(f"shard{shard}", hi - lo, self.codec, out=self._buffers.take(hi - lo))
        for t in signed.chunks:
            asm.add(t)
        with self._cond:
            self._contribs.setdefault((shard, attempt), {})[self.me] = asm.result()
            self._inputs.setdefault((shard, attempt), {})[self.me] = signed
            self._cond.notify_all()

    def receipted(self, info: RoundInfo, shard: int, attempt: int, receipt: bytes) -> Signed | None:
        """The owner's receipt of this member's contribution to ``shard`` (``attempt``), kept with it; the contribution
        as kept (None if the expected step moved on, or it was never kept)."""
        with self._cond:
            if (info.step, info.epoch) != (self._step, self._epoch) or (shard, attempt) not in self._sent:
                return None
            self._sent[(shard, attempt)] = dataclasses.replace(self._sent[(shard, attempt)], receipt=receipt)
            return self._sent[(shard, attempt)]

    def sent(self, shard: int, attempt: int) -> Signed | None:
        """This member's contribution to ``shard`` (``attempt``) of the expected step, as signed (and receipted)."""
        with self._cond:
            return self._sent.get((shard, attempt))

    def keep_sent(self, info: RoundInfo, shard: int, attempt: int, signed: Signed) -> None:
        """This member's contribution to another owner's shard, as it signed it: an audit of that shard needs it,
        and need not fetch it. (Dropped if the expected step moved on while it was sent.)"""
        with self._cond:
            if (info.step, info.epoch) == (self._step, self._epoch):
                self._sent[(shard, attempt)] = signed

    def store_own_result(self, info: RoundInfo, shard: int, chunks: list[pb.Tensor], outcome: Outcome) -> None:
        """A result this member reduced (or forwards, as a backup taking over), as it distributes it."""
        lo, hi = shard_bounds(self.numel, info.shards, self.codec.align)[shard]
        asm = Assembler(f"shard{shard}", hi - lo, self.codec, out=self._buffers.take(hi - lo))
        for t in chunks:
            asm.add(t)
        with self._cond:
            if shard not in self._results:
                self._results[shard] = ShardResult(asm.result(), chunks, outcome)
            self._cond.notify_all()

    def awaited(self, shard: int, attempt: int, expected: set[str]) -> set[str]:
        """Those of ``expected`` whose contribution to ``shard`` (``attempt``) is not in and who did not abstain."""
        with self._cond:
            return expected - set(self._contribs.get((shard, attempt), {})) - self._abstained

    def close_shard(self, shard: int, attempt: int) -> tuple[dict[str, torch.Tensor], dict[str, Signed]]:
        """This member reduces ``shard`` (``attempt``) now: later contributions to it are refused
        (ALREADY_REDUCED), and its inputs can be fetched. Returns the contributions, decoded and as signed."""
        with self._cond:
            self._closed.add((shard, attempt))
            return dict(self._contribs.get((shard, attempt), {})), dict(self._inputs.get((shard, attempt), {}))

    def take_over(self, shard: int) -> None:
        """This member reduces ``shard`` again (attempt 1): the owner's late result and attempt-0 contributions
        are refused from now (TAKEN_OVER, ALREADY_REDUCED)."""
        with self._cond:
            self._taken_over.add(shard)

    def drop_result(self, shard: int) -> None:
        """The owner's result of ``shard`` is not adopted (short of a quorum): forgotten, and refused from now
        (TAKEN_OVER), as after a take-over: the shard's backup reduces it again."""
        with self._cond:
            self._taken_over.add(shard)
            if (res := self._results.pop(shard, None)) is not None:
                self._buffers.give([res.values])
            if (later := self._later.pop(shard, None)) is not None:  # the take-over's, come before this was judged
                self._results[shard] = later
                self._cond.notify_all()

    def result(self, shard: int) -> ShardResult | None:
        with self._cond:
            return self._results.get(shard)

    def missing_results(self, shards: list[int]) -> list[int]:
        """Those of ``shards`` with no result yet, in the order given."""
        with self._cond:
            return [j for j in shards if j not in self._results]

    def results(self, num_shards: int) -> list[ShardResult]:
        """Every shard's result, in shard order (the caller checked none is missing)."""
        with self._cond:
            return [self._results[j] for j in range(num_shards)]


def result_stream(hdr: pb.Header, shard: int, num_shards: int, base: str, tensors: list[pb.Tensor],
                  o: Outcome) -> Iterator[pb.ShardChunk]:
    """A signed result as it goes on the wire (its outcome in every chunk, the signature in the last): sent by
    its owner or a backup, and served again for an audit (FetchResult)."""
    for i, t in enumerate(tensors):
        chunk = pb.ShardChunk(header=hdr, shard=shard, num_shards=num_shards, attempt=o.attempt, base_hash=base,
                              contributors=o.contributors, clipped=o.clipped, rejected=o.rejected, tensor=t,
                              inputs=o.inputs, input_digests=o.input_digests, weights=o.weights)
        if i == len(tensors) - 1:
            chunk.signer, chunk.signature = o.signer, o.signature
        yield chunk
