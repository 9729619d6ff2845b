"""The outer all-reduce: reduce-scatter + all-gather over gRPC, with deadlines and shard take-over.

The members of an outer step (decided by the coordinator, in shard order) cut the flat
pseudo-gradient into one contiguous shard per member. Member ``j`` owns shard ``j``:

1. **Reduce.** Every member sends its encoded slice of shard ``j`` to owner ``j``. The owner decodes
   each contribution to float32 as it arrives, and once it has all of them (or the deadline passed,
   or the missing members are known dead) it sums them in float32, divides by their number and
   quantizes the mean *once*.
2. **Gather.** The owner sends that encoded result first to its *backup* (the next live member in
   ring order) and, once the backup has it, to everyone else. Every member, the owner included,
   uses the decoded result, so all members end with bit-identical parameters.
3. **Take-over.** If an owner dies, the backup finishes its shard: if it already holds the owner's
   result it re-sends that (because of the backup-first rule, nobody else can hold a result the
   backup lacks); otherwise the members re-send their slice to the backup (attempt 1) and it
   reduces them. An owner whose backup already took over does not broadcast its late result.

A member never waits past its deadline, and never on a member that does not answer: before it
hands a result to a backup it pings it, so a stopped backup costs a ping, not a transfer timeout
(which would let the deadline of the others pass and get a healthy owner dropped). A member that
ends without every shard, or with a shard nobody contributed to, has not committed the step and
must recover state from the others (:class:`IncompleteRound`): no member ever applies a
half-averaged update, and an empty average (zeros that momentum would still turn into a step)
never commits.

Messages for a step can arrive before this member reaches it (it may still be running inner steps);
the :class:`AllReduce` keeps them, checked, until it does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

import grpc
import torch

from potluck.compression.aggregate import (  # noqa: F401 (reduce_mean: re-export)
    contribution_digest,
    reduce_mean,
    result_digest,
    robust_reduction,
    tensor_digest,
)
from potluck.compression.audit import ResultClaim, Signed
from potluck.compression.audit import Round as AuditRound
from potluck.compression.int8 import Codec
from potluck.compression.stream import Assembler, EncodedStream, WireError
from potluck.peer.audit import HeldResult
from potluck.peer.diloco import host_vector
from potluck.peer.shards import (
    AllReduceStats,
    Buffers,
    IncompleteRound,
    MemberAddr,
    Outcome,
    RoundInfo,
    ShardResult,
    shard_bounds,
)
from potluck.protos import potluck_pb2 as pb
from potluck.protos.faults import fault, tamper
from potluck.protos.identity import verify
from potluck.protos.log import get_logger, short_id
from potluck.protos.transport import (
    PeerClient,
    Rejected,
    is_silent,
    is_unreachable,
    refusal_of,
    refused,
    rpc_reason,
)

log = get_logger(__name__)

MAX_PENDING_SENDERS = 4096
NOT_PARTICIPATING = {"joining", "recovering", "left", "waiting"}
CATCHING_UP = {"joining", "recovering", "waiting"}


PING_S = 2.0
KEEP_STEPS = 3  # steps kept for audits: encoded results and inputs, about 2 bytes a parameter each
CODEC_WORKERS = 2


@dataclass(frozen=True)
class _Kept:
    """What a member keeps of the step before the running one: its results and (an owner's) inputs."""

    step: int
    epoch: int
    base_hash: str
    round: RoundInfo
    results: dict[int, tuple[list[pb.Tensor], Outcome, list[bytes]]]
    inputs: dict[tuple[int, int], dict[str, Signed]]
    sent: dict[tuple[int, int], Signed]


def _remote_step(err: grpc.RpcError) -> int | None:
    """The step a member is at when it refused our message as WRONG_STEP, or None for other errors."""
    info = refusal_of(err)
    return int(info.at_step) if info is not None and info.code == pb.WRONG_STEP else None


class AllReduce:
    """Both halves of the outer all-reduce for one peer: the RPC handlers and the procedure."""

    def __init__(
        self,
        *,
        run_id: str,
        me: str,
        numel: int,
        codec: Codec,
        client: PeerClient,
        chunk_bytes: int,
        rpc_timeout: float,
        ping: Callable[[str, float], pb.PingReply],
        stopping: threading.Event | None = None,
        sign: Callable[[bytes], bytes] | None = None,
        clip_factor: float = 4.0,
        reject_below: float | None = -0.1,
        pinned: bool = False,
    ) -> None:
        """``pinned``: the mean (which becomes theta_global) in page-locked memory, for a GPU peer's copy."""
        self.run_id, self.me, self.numel, self.codec = run_id, me, numel, codec
        self.pinned = pinned
        self.sign = sign or (lambda digest: b"")
        self.clip_factor, self.reject_below = clip_factor, reject_below
        self.stopping = stopping or threading.Event()
        self.client, self.chunk_bytes, self.rpc_timeout, self._ping = client, chunk_bytes, rpc_timeout, ping
        self._cond = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="allreduce")
        self._buffers = Buffers()
        self._out: Future | None = None  # the next result's whole vector, its pages touched ahead of time
        # encodes chunk i + 1 while chunk i is on the wire, and an owner's result a few chunks at a time
        self._codec_pool = ThreadPoolExecutor(max_workers=CODEC_WORKERS, thread_name_prefix="codec")
        self._step = -1
        self._epoch = 0
        self._base_hash: str | Future[str] = ""  # read _base
        self._round: RoundInfo | None = None
        self._contribs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        # each contribution as its sender signed it, kept to show an auditor what a result was averaged from
        self._inputs: dict[tuple[int, int], dict[str, Signed]] = {}
        # the last few steps: their results and (an owner's) inputs, for audits of them (an auditor learns of its
        # audit from the coordinator's next round, which a peer running ahead on the last plan may see late)
        self._kept: dict[tuple[int, int], _Kept] = {}
        self._evidence: dict[tuple[int, int, int, int], dict[str, Signed]] = {}  # inputs fetched in an audit
        self._sent: dict[tuple[int, int], Signed] = {}  # this member's own contributions, as it signed them
        self._closed: set[tuple[int, int]] = set()
        self._tamper = tamper  # POTLUCK_FAULTS' owner.* points (a test may give one member faults of its own)
        self._results: dict[int, ShardResult] = {}
        self._taken_over: set[int] = set()
        self._pending: list[Future] = []
        self._ahead: list[str] = []  # members already past the running step (it went on without us)
        self._catch_up_until = 0.0  # until then, a member still fetching the round's base is waited for
        self._backup_timeout = PING_S  # seconds a result may take to reach a backup (half the grace period)

    # ---------------------------------------------------------------- state of the coming step

    def expect(self, step: int, base_hash: str | Future[str], epoch: int = 0) -> None:
        """Accept messages for ``step`` (of ``epoch``), computed from the theta_global whose hash is
        ``base_hash`` (or will be: it is asked for when the first message comes, long after it is
        computed unless the others' inner phases are shorter than hashing); everything held for
        another step is dropped."""
        with self._cond:
            if self._round is not None and step != self._step:  # the step that ends is kept for its audits
                self._kept[(self._step, self._epoch)] = _Kept(
                    self._step, self._epoch, self._base, self._round,
                    {j: (r.chunks, r.outcome, r.digests) for j, r in self._results.items()},
                    {k: dict(v) for k, v in self._inputs.items()}, dict(self._sent))
                for old in sorted(self._kept)[:-KEEP_STEPS]:
                    del self._kept[old]
            self._step, self._base_hash, self._epoch, self._round = step, base_hash, epoch, None
            self._reset()
            self._cond.notify_all()
        if self._out is None:
            # the result becomes the caller's new theta: a fresh vector, whose first writes would cost
            # page faults inside the round (40 ms for 80 MB here); touched now, while the inner phase runs
            # (a pinned one is resident already, and after the first step torch's host allocator reuses one)
            self._out = self._codec_pool.submit(self._fresh_out)

    def _fresh_out(self) -> torch.Tensor:
        out = host_vector(self.numel, self.pinned)
        return out if self.pinned and out.is_pinned() else out.zero_()

    @property
    def _base(self) -> str:
        b = self._base_hash
        return b if isinstance(b, str) else b.result()

    def _reset(self) -> None:
        """Forget everything held for the step (under the lock); its buffers serve the next one."""
        self._buffers.give([t for by_sender in self._contribs.values() for s, t in by_sender.items() if s != self.me])
        self._buffers.give([r.values for r in self._results.values()])
        self._contribs.clear()
        self._inputs.clear()
        self._sent.clear()
        self._closed.clear()
        self._results.clear()
        self._taken_over.clear()

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
            for by_sender in self._contribs.values():
                for sender in [s for s in by_sender if s not in members]:
                    log.warning("dropping contribution from %s: not a member of step %d", short_id(sender), info.step)
                    del by_sender[sender]
            for shard, res in list(self._results.items()):
                try:
                    self._check_signed(shard, info.shards, res.digests, res.outcome, info)
                except Rejected as err:
                    log.warning("dropping a result received before the round was known: %s", err.reason)
                    del self._results[shard]
            return True

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
        if h.step != self._step:
            raise Rejected(pb.WRONG_STEP, f"message for step {h.step}, this peer is at step {self._step}",
                           at_step=self._step)
        if h.epoch != self._epoch:
            raise Rejected(pb.WRONG_EPOCH, f"message for epoch {h.epoch} of step {h.step}, this peer runs epoch "
                           f"{self._epoch}", at_step=self._step, at_epoch=self._epoch)
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
                elif (chunk.header.sender, chunk.shard, chunk.num_shards, chunk.attempt) != (
                    first.header.sender, first.shard, first.num_shards, first.attempt
                ):
                    raise Rejected(pb.BAD_MESSAGE, "chunk header changed within one stream")
                assert assembler is not None
                assembler.add(chunk.tensor)
                kept.append(chunk.tensor)
                if digests is not None:
                    digests.append(tensor_digest(chunk.tensor))
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
                                     first.attempt, first.base_hash, sender, digests)
        if last.signer != sender or not verify(sender, signed, last.signature):
            raise Rejected(pb.BAD_IDENTITY, f"contribution of {short_id(sender)} not signed by it", sender)
        with self._cond:
            self._check_header(first)  # the step may have moved on while the stream arrived
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
            self._inputs.setdefault(key, {})[sender] = Signed(kept, sender, last.signature, digests)
            self._cond.notify_all()
        return pb.Ack(received_bytes=sum(t.ByteSize() for t in kept))

    def on_result(self, chunks: Iterator[pb.ShardChunk]) -> pb.Ack:
        digests: list[bytes] = []
        first, values, kept, last = self._receive(chunks, digests)
        outcome = Outcome(first.attempt, list(first.contributors), list(first.clipped), list(first.rejected),
                          last.signer, last.signature, list(first.inputs), list(first.input_digests))
        with self._cond:
            self._check_header(first)
            shard = first.shard
            if self._round is not None:
                self._check_signed(shard, self._round.shards, digests, outcome, self._round)
            if first.attempt == 0 and shard in self._taken_over:
                raise Rejected(pb.TAKEN_OVER, f"shard {shard} of step {self._step} was taken over")
            if shard not in self._results:
                self._results[shard] = ShardResult(values, kept, outcome, digests)
                self._cond.notify_all()
            elif not torch.equal(self._results[shard].values, values):
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
        if len(outcome.inputs) != len(outcome.input_digests):
            raise Rejected(pb.BAD_MESSAGE, f"result of shard {shard} names {len(outcome.inputs)} inputs and "
                           f"{len(outcome.input_digests)} digests")
        digest = result_digest(self.run_id, self._step, self._epoch, shard, num_shards, outcome.attempt,
                               self._base, outcome.contributors, outcome.clipped, outcome.rejected, digests,
                               zip(outcome.inputs, outcome.input_digests, strict=True))
        if not verify(signer, digest, outcome.signature):
            raise Rejected(pb.BAD_IDENTITY, f"bad signature on the result of shard {shard} from {short_id(signer)}")

    def on_fetch_result(self, request: pb.ResultRequest) -> Iterator[pb.ShardChunk]:
        """A result of the running step, or of the step before (for an audit of it)."""
        h = request.header
        with self._cond:
            if h.run_id != self.run_id:
                raise Rejected(pb.UNKNOWN_RUN, f"unknown run id {h.run_id!r}")
            found: tuple[list[pb.Tensor], Outcome] | None = None
            if h.step == self._step and request.shard in self._results:
                res = self._results[request.shard]
                found, step, epoch, base = (res.chunks, res.outcome), self._step, self._epoch, self._base
            elif (k := self._kept.get((h.step, h.epoch))) is not None and request.shard in k.results:
                chunks, outcome, _ = k.results[request.shard]
                found, step, epoch, base = (chunks, outcome), k.step, k.epoch, k.base_hash
            if found is None:
                raise Rejected(pb.NO_STATE, f"no result for shard {request.shard} of step {h.step}")
            hdr = pb.Header(run_id=self.run_id, sender=self.me, step=step, epoch=epoch)
        yield from self._result_chunks(hdr, request.shard, request.num_shards, base, found[0], found[1])

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
                                      base_hash=base, tensor=t)
                if i == len(c.chunks) - 1:
                    chunk.signer, chunk.signature = c.signer, c.signature
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
                                Signed(chunks, o.signer, o.signature, digests))
            return HeldResult(claim, AuditRound(self.run_id, step, epoch, shard, k.round.shards, k.base_hash, numel))

    def own_input(self, step: int, epoch: int, shard: int, attempt: int) -> Signed | None:
        """This member's contribution to a shard of a kept step, as it signed it (an auditor need not fetch it)."""
        with self._cond:
            k = self._kept.get((step, epoch))
            if k is None:
                return None
            return k.sent.get((shard, attempt)) or k.inputs.get((shard, attempt), {}).get(self.me)

    def keep_evidence(self, step: int, epoch: int, shard: int, attempt: int, inputs: dict[str, Signed]) -> None:
        """Inputs an audit found a lie with: served to the coordinator (FetchInputs) for its own check."""
        with self._cond:
            self._evidence[(step, epoch, shard, attempt)] = inputs
            for old in sorted(self._evidence)[:-4]:
                del self._evidence[old]

    @staticmethod
    def _result_chunks(hdr: pb.Header, shard: int, num_shards: int, base: str, tensors: list[pb.Tensor],
                       o: Outcome) -> Iterator[pb.ShardChunk]:
        for i, t in enumerate(tensors):
            chunk = pb.ShardChunk(header=hdr, shard=shard, num_shards=num_shards, attempt=o.attempt, base_hash=base,
                                  contributors=o.contributors, clipped=o.clipped, rejected=o.rejected, tensor=t,
                                  inputs=o.inputs, input_digests=o.input_digests)
            if i == len(tensors) - 1:
                chunk.signer, chunk.signature = o.signer, o.signature
            yield chunk

    # ---------------------------------------------------------------- the procedure

    def run(self, info: RoundInfo, delta: torch.Tensor | None, wait_s: float, grace_s: float = 2.0) -> tuple[torch.Tensor, AllReduceStats]:
        """Average ``delta`` over the members of ``info``; returns the mean as every member applies it.

        ``delta`` is None when this member has nothing valid to contribute (it still owns its shard
        and gathers the result). Raises :class:`IncompleteRound` if a shard cannot be had in time.
        """
        t_start = time.monotonic()
        sent_before = self.client.traffic.snapshot()[0].get("outer", 0)
        with self._cond:
            if (info.step, info.base_hash) != (self._step, self._base):
                raise ValueError(f"round {info.step} from {info.base_hash[:12]} but expecting {self._step} from {self._base[:12]}")
        self.set_round(info)
        self._pending.clear()
        n, me = info.shards, info.shard
        bounds = shard_bounds(self.numel, n, self.codec.align)
        dead: set[str] = set()
        stats = AllReduceStats(step=info.step, members=n)
        deadline = t_start + wait_s
        # a member still fetching the round's base state (a joiner, or one re-assigned) is waited for this long
        self._catch_up_until = min(deadline, t_start + grace_s)
        # the others wait `grace_s` past the deadline for each result: a backup that freezes mid-transfer
        # must not use it all up, or they give up on this shard (and this member) before it tries another
        self._backup_timeout = max(PING_S, 0.5 * grace_s)

        self._ahead = ahead = []

        def on_send_error(peer: MemberAddr, err: grpc.RpcError) -> None:
            at = _remote_step(err)
            with self._cond:
                if is_unreachable(err):
                    dead.add(peer.peer_id)
                elif at is not None and at > info.step:
                    ahead.append(peer.peer_id)  # the round went on without us: never average alone
                self._cond.notify_all()
            log.info("send to %s failed: %s", short_id(peer.peer_id), rpc_reason(err))

        # 1. reduce: our slice of every shard goes to its owner, signed (our own shard's too: encoded and
        # signed like any other, so what we average is what an auditor can check)
        if delta is not None:
            for j, owner in enumerate(info.shard_owners):
                lo, hi = bounds[j]
                if j == me:
                    self._own_contribution(info, j, 0, delta[lo:hi])
                else:
                    self._submit(self._send, "contribution", info, info.address_of(owner), j, 0, delta[lo:hi],
                                 on_send_error)
        if me is not None:
            self._reduce_shard(info, me, 0, bounds, dead, deadline, stats)

        # 2. gather: wait for the other owners' results
        result_deadline = deadline + grace_s
        missing = self._wait_results(info, dead, result_deadline)

        # 3. take over the shards of owners that died or never answered -- unless the others already
        # committed this step without us, in which case ours would be a minority result: recover instead
        if ahead and missing:
            raise IncompleteRound(f"step {info.step}: {short_id(ahead[0])} already went past it without this peer")
        for j in missing:
            dead.add(info.shard_owners[j])
        if missing:
            # a member that learned early that an owner is gone still gives its backup, which may only
            # notice at its own result deadline, the time to take the shard over
            takeover_deadline = max(time.monotonic(), result_deadline) + 2 * max(grace_s, 2.0)
            for j in missing:
                self._take_over(info, j, bounds, dead, delta, takeover_deadline, stats)
            still = self._wait_results(info, dead, takeover_deadline, shards=missing)
            if still:
                raise IncompleteRound(f"step {info.step}: no result for shard(s) {still} after take-over")

        futures_wait(self._pending, timeout=grace_s)  # our own broadcasts: finish sending before training on
        self._pending.clear()
        with self._cond:
            results = [self._results[j] for j in range(n)]
        stats.seconds = time.monotonic() - t_start
        stats.bytes_sent = self.client.traffic.snapshot()[0].get("outer", 0) - sent_before
        stats.dropped = sorted(dead)
        stats.contributors = {j: len(r.outcome.contributors) for j, r in enumerate(results)}
        empty = [j for j, r in enumerate(results) if not r.outcome.contributors]
        if empty:  # an average of nothing is zeros, which momentum would still turn into a step
            raise IncompleteRound(f"step {info.step}: nobody contributed to shard(s) {empty}; nothing to average")
        stats.clipped = sorted({p for r in results for p in r.outcome.clipped})
        stats.rejected = sorted({p for r in results for p in r.outcome.rejected})
        stats.flags = {r.outcome.signer: sorted(set(r.outcome.clipped) | set(r.outcome.rejected)) for r in results}
        counted: list[set[str]] = [set(r.outcome.contributors) | set(r.outcome.rejected) for r in results]
        stats.partial = sorted(set().union(*counted) - counted[0].intersection(*counted[1:]))
        named = [p for r in results for p in set(r.outcome.contributors) if p in info.ids]  # in most shards:
        stats.included = sorted({info.replica_of(p) for p in set(named) if 2 * named.count(p) > len(results)})
        if stats.partial:  # each shard is still a true mean of its own contributors
            log.warning("step %d: contributions of %s arrived too late for some shards (counted in %s)", info.step,
                        ", ".join(short_id(p) for p in stats.partial),
                        "; ".join(f"shard {j}: {len(c)}" for j, c in enumerate(counted)))
        out, self._out = (self._out.result() if self._out is not None else torch.empty(self.numel)), None
        return torch.cat([r.values for r in results], out=out), stats

    def _submit(self, fn: Callable, *args: object) -> Future:
        return self._pool.submit(fn, *args)

    def _chunks(self, info: RoundInfo, shard: int, attempt: int, tensors: Iterable[pb.Tensor]) -> Iterator[pb.ShardChunk]:
        """A contribution's chunks; the last carries this member's signature over all of them."""
        hdr = pb.Header(run_id=self.run_id, sender=self.me, step=info.step, epoch=info.epoch)
        tensors = list(tensors)
        digests: list[bytes] = []
        for i, t in enumerate(tensors):
            digests.append(tensor_digest(t))
            chunk = pb.ShardChunk(header=hdr, shard=shard, num_shards=info.shards, attempt=attempt,
                                  base_hash=info.base_hash, tensor=t)
            if i == len(tensors) - 1:
                chunk.signer, chunk.signature = self.me, self.sign(self._contribution_digest(info, shard, attempt, digests))
                with self._cond:  # kept: an audit of this shard needs this contribution, and need not fetch it
                    if (info.step, info.epoch) == (self._step, self._epoch):
                        self._sent[(shard, attempt)] = Signed(tensors, self.me, chunk.signature, list(digests))
            yield chunk

    def _contribution_digest(self, info: RoundInfo, shard: int, attempt: int, digests: list[bytes]) -> bytes:
        return contribution_digest(self.run_id, info.step, info.epoch, shard, info.shards, attempt, info.base_hash,
                                   self.me, digests)

    def _own_contribution(self, info: RoundInfo, shard: int, attempt: int, values: torch.Tensor) -> None:
        """This member's slice of a shard it reduces, as any contributor sends it: encoded, signed, decoded."""
        chunks = list(EncodedStream.of(f"shard{shard}", values, self.codec, self.chunk_bytes, self._codec_pool))
        digests = [tensor_digest(t) for t in chunks]
        asm = Assembler(f"shard{shard}", values.numel(), self.codec, out=self._buffers.take(values.numel()))
        for t in chunks:
            asm.add(t)
        signed = Signed(chunks, self.me, self.sign(self._contribution_digest(info, shard, attempt, digests)), digests)
        with self._cond:
            self._contribs.setdefault((shard, attempt), {})[self.me] = asm.result()
            self._inputs.setdefault((shard, attempt), {})[self.me] = signed
            self._cond.notify_all()

    def _results_of(self, info: RoundInfo, shard: int, tensors: list[pb.Tensor], outcome: Outcome) -> Iterator[pb.ShardChunk]:
        hdr = pb.Header(run_id=self.run_id, sender=self.me, step=info.step, epoch=info.epoch)
        return self._result_chunks(hdr, shard, info.shards, info.base_hash, tensors, outcome)

    def _send(
        self, kind: str, info: RoundInfo, peer: MemberAddr, shard: int, attempt: int, values: torch.Tensor,
        on_error: Callable[[MemberAddr, grpc.RpcError], None],
    ) -> bool:
        tensors = EncodedStream.of(f"shard{shard}", values, self.codec, self.chunk_bytes, self._codec_pool)
        while True:
            try:
                self.client.push_contribution(peer.address, self._chunks(info, shard, attempt, tensors), self.rpc_timeout,
                                              peer=peer.peer_id)
                return True
            except grpc.RpcError as err:
                at, info_r = _remote_step(err), refusal_of(err)
                # the owner is behind, or at this step but not yet holding its base (a member re-assigned to
                # this stage still holds its old stage's state until it fetched this one)
                behind = (at is not None and at < info.step) or (info_r is not None and (
                    (info_r.code == pb.WRONG_EPOCH and info_r.at_epoch < info.epoch) or info_r.code == pb.BASE_MISMATCH))
                if behind and time.monotonic() < self._catch_up_until and not self.stopping.wait(0.2):
                    continue  # the owner is still fetching this round's base state: try again shortly
                on_error(peer, err)
                return False

    def _reduce_shard(
        self, info: RoundInfo, shard: int, attempt: int, bounds: list[tuple[int, int]], dead: set[str],
        deadline: float, stats: AllReduceStats, forwarded_ok: bool = False,
    ) -> None:
        """Collect contributions to ``shard``, then average, encode once and distribute the result."""
        t0 = time.monotonic()
        expected = set(info.ids) - {self.me}  # (our own contribution, if any, is in already)
        next_ping = 0.0
        with self._cond:
            while True:
                got = self._contribs.get((shard, attempt), {})
                if forwarded_ok and shard in self._results:
                    break
                waiting = expected - set(got) - dead
                if not waiting or time.monotonic() >= deadline or self._ahead:
                    break  # (a member already went past this step: it is lost here, stop collecting for it)
                if self.stopping.is_set():
                    raise IncompleteRound("stopping")
                if time.monotonic() >= next_ping:
                    next_ping = time.monotonic() + 0.5
                    for pid in waiting:
                        self._submit(self._probe, info, pid, dead)
                self._cond.wait(timeout=0.05)
            self._closed.add((shard, attempt))
            forwarded = self._results.get(shard) if forwarded_ok else None
            got = dict(self._contribs.get((shard, attempt), {}))
            signed = dict(self._inputs.get((shard, attempt), {}))
        stats.wait_seconds += time.monotonic() - t0
        if forwarded is not None:  # we hold the owner's result already: hand on exactly that (its signature too)
            result_chunks, outcome = forwarded.chunks, forwarded.outcome
        else:
            lo, hi = bounds[shard]
            red = robust_reduction(got, hi - lo, self.clip_factor, self.reject_below)
            step = info.step

            def mean(a: int, b: int) -> torch.Tensor:  # (a Byzantine owner, in tests: POTLUCK_FAULTS owner.mean)
                return self._tamper("owner.mean", step, red.mean(a, b), a)

            clipped = red.clipped
            if self._tamper("owner.flags", step, False) is True:  # an honest mean, with false flags (tests)
                clipped = sorted(set(red.contributors) - {self.me})
            # summed in float32 and re-quantized a chunk at a time, chunks on the codec workers, each
            # hashed there as soon as it is made
            result_chunks, hashing = [], []
            for t in EncodedStream(f"shard{shard}", hi - lo, mean, self.codec, self.chunk_bytes, self._codec_pool):
                result_chunks.append(t)
                hashing.append(self._codec_pool.submit(tensor_digest, t))
            inputs = sorted(got)  # what this result was averaged from, each sender's contribution by its digest
            input_digests = [contribution_digest(self.run_id, info.step, info.epoch, shard, info.shards, attempt,
                                                 info.base_hash, s, signed[s].digests) for s in inputs]
            digest = result_digest(self.run_id, info.step, info.epoch, shard, info.shards, attempt,
                                   info.base_hash, red.contributors, clipped, red.rejected,
                                   [f.result() for f in hashing], zip(inputs, input_digests, strict=True))
            outcome = Outcome(attempt, red.contributors, clipped, red.rejected, self.me, self.sign(digest), inputs,
                              input_digests)
            missing = sorted(set(info.ids) - set(got))
            if len(got) < len(expected):
                log.info("shard %d of step %d reduced without %s", shard, info.step, ", ".join(short_id(m) for m in missing))
            if red.clipped or red.rejected:
                log.warning("shard %d of step %d: clipped %s, rejected %s", shard, info.step,
                            [short_id(p) for p in red.clipped], [short_id(p) for p in red.rejected])
        fault("allreduce.reduced", info.step)
        self._distribute(info, shard, result_chunks, outcome, dead)

    def _distribute(self, info: RoundInfo, shard: int, chunks: list[pb.Tensor], outcome: Outcome, dead: set[str]) -> None:
        """Backup first, then everyone: nobody can hold a result its shard's backup lacks.

        The backup is the next owner in ring order that is there (one that may take the shard over:
        a member on probation never does): owners whose contribution arrived come first (one that missed
        the deadline is not waited on again), and each is pinged before the transfer, so a member that
        froze since costs a ping, not a transfer timeout.
        """
        ring = info.ring_after(shard)
        came = set(outcome.contributors) | set(outcome.rejected)
        candidates = [p for p in ring if p.peer_id in came] + [p for p in ring if p.peer_id not in came]
        backup_ok, backup = True, None
        for peer in candidates:
            if peer.peer_id in dead or peer.peer_id == self.me or not self._answers(peer.peer_id, dead):
                continue
            try:
                self.client.push_result(peer.address, self._results_of(info, shard, chunks, outcome),
                                        min(self.rpc_timeout, self._backup_timeout), peer=peer.peer_id)
                backup = peer
                break
            except grpc.RpcError as err:
                if is_unreachable(err) or is_silent(err):
                    dead.add(peer.peer_id)
                    continue
                if refused(err, pb.TAKEN_OVER):
                    log.info("shard %d of step %d was taken over by %s; dropping our late result", shard, info.step, short_id(peer.peer_id))
                    backup_ok = False
                    break
                at = _remote_step(err)
                if at is not None and at > info.step:
                    # it committed this step already, so with a result for this shard that is not ours
                    log.info("backup %s went past step %d without our shard %d", short_id(peer.peer_id), info.step, shard)
                    with self._cond:
                        self._ahead.append(peer.peer_id)
                        self._cond.notify_all()
                    backup_ok = False
                    break
                log.info("backup %s refused shard %d: %s", short_id(peer.peer_id), shard, rpc_reason(err))
                break
        if not backup_ok:
            return
        self._store_own_result(info, shard, chunks, outcome)
        for peer in info.members:
            if peer is backup or peer.peer_id in dead or peer.peer_id == self.me:
                continue
            self._pending.append(self._submit(self._push_result, info, peer, shard, chunks, outcome))

    def _answers(self, peer_id: str, dead: set[str]) -> bool:
        """Does ``peer_id`` answer a ping now? A stopped or vanished member is marked dead instead."""
        try:
            self._ping(peer_id, PING_S)
            return True
        except grpc.RpcError as err:
            if is_unreachable(err) or is_silent(err):
                log.info("%s does not answer (%s); skipping it", short_id(peer_id), rpc_reason(err))
                with self._cond:
                    dead.add(peer_id)
                    self._cond.notify_all()
                return False
            return True  # it answered, with a refusal: it is there

    def _store_own_result(self, info: RoundInfo, shard: int, chunks: list[pb.Tensor], outcome: Outcome) -> None:
        lo, hi = shard_bounds(self.numel, info.shards, self.codec.align)[shard]
        asm = Assembler(f"shard{shard}", hi - lo, self.codec, out=self._buffers.take(hi - lo))
        for t in chunks:
            asm.add(t)
        with self._cond:
            if shard not in self._results:
                self._results[shard] = ShardResult(asm.result(), chunks, outcome)
            self._cond.notify_all()

    def _push_result(self, info: RoundInfo, peer: MemberAddr, shard: int, chunks: list[pb.Tensor], outcome: Outcome) -> None:
        try:
            self.client.push_result(peer.address, self._results_of(info, shard, chunks, outcome), self.rpc_timeout,
                                    peer=peer.peer_id)
        except grpc.RpcError as err:
            log.info("result of shard %d to %s failed: %s", shard, short_id(peer.peer_id), rpc_reason(err))

    def _probe(self, info: RoundInfo, peer_id: str, dead: set[str]) -> None:
        """Is a member we wait for still coming? Unreachable or not in this step means: stop waiting."""
        try:
            reply = self._ping(peer_id, 2.0)
        except grpc.RpcError as err:
            if not is_unreachable(err):
                return
            reason = "unreachable"
        else:
            if reply.version >= info.step:
                with self._cond:
                    self._ahead.append(peer_id)  # it committed this step already (without us)
                    self._cond.notify_all()
                return
            if reply.state not in NOT_PARTICIPATING and reply.version >= info.step - 1:
                return
            # behind the round's base (fetching it to take part), or holding it and waiting to see the
            # round itself: give it the grace period. A member recovering *from* the base gave up the step.
            catching_up = reply.state in CATCHING_UP and (reply.version < info.step - 1 or reply.state == "waiting")
            if catching_up and time.monotonic() < self._catch_up_until:
                return
            reason = f"{reply.state} at version {reply.version}"
        with self._cond:
            if peer_id not in dead:
                log.info("not waiting for %s in step %d: %s", short_id(peer_id), info.step, reason)
                dead.add(peer_id)
            self._cond.notify_all()

    def _wait_results(self, info: RoundInfo, dead: set[str], deadline: float, shards: list[int] | None = None) -> list[int]:
        """Wait for results of ``shards`` (default: all); returns those still missing."""
        wanted = list(range(info.shards)) if shards is None else shards
        with self._cond:
            while True:
                missing = [j for j in wanted if j not in self._results]
                if not missing or time.monotonic() >= deadline:
                    return missing
                if self.stopping.is_set():
                    raise IncompleteRound("stopping")
                if shards is None and all(info.shard_owners[j] in dead for j in missing):
                    return missing
                if self._ahead:
                    return missing
                self._cond.wait(timeout=0.05)

    def _take_over(
        self, info: RoundInfo, shard: int, bounds: list[tuple[int, int]], dead: set[str],
        delta: torch.Tensor | None, deadline: float, stats: AllReduceStats,
    ) -> None:
        backup = next((p for p in info.ring_after(shard) if p.peer_id not in dead), None)
        if backup is None:
            return
        stats.taken_over.append(shard)
        lo, hi = bounds[shard]
        owner = info.shard_owners[shard]
        if backup.peer_id == self.me:
            log.info("taking over shard %d of step %d from %s", shard, info.step, short_id(owner))
            with self._cond:
                self._taken_over.add(shard)
            if delta is not None:
                self._own_contribution(info, shard, 1, delta[lo:hi])
            self._reduce_shard(info, shard, 1, bounds, dead | {owner}, deadline, stats, forwarded_ok=True)
        elif delta is not None:
            with self._cond:
                if shard in self._results:
                    return
            self._submit(self._send, "takeover", info, backup, shard, 1, delta[lo:hi], lambda p, e: None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._codec_pool.shutdown(wait=False, cancel_futures=True)
