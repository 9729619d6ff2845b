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
the receiving half, a :class:`~potluck.peer.reduce.shardinbox.ShardInbox` the procedure holds (``inbox``: the RPC
handlers and what they keep), keeps them, checked, until it does. The procedure owns the condition both
share and passes it in; it reaches the inbox's state only through the inbox's methods. Each run of the
procedure is a value, a :class:`ReduceRound`, handed to every thread that acts for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

import grpc
import torch

from potluck.compression.aggregate import (
    contribution_digest,
    receipt_digest,
    reduce_mean,
    result_digest,
    robust_reduction,
)
from potluck.compression.audit import Signed
from potluck.compression.int8 import Codec
from potluck.compression.stream import EncodedStream
from potluck.peer.outer.diloco import host_vector
from potluck.peer.reduce.pacing import Pacing, paced, round_bytes
from potluck.peer.reduce.reduceround import Phase, ReduceRound
from potluck.peer.reduce.shardinbox import ShardInbox, result_stream
from potluck.peer.reduce.shards import (
    AllReduceStats,
    IncompleteRound,
    MemberAddr,
    Outcome,
    RoundInfo,
    ShardResult,
    shard_bounds,
)
from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.identity import verify
from potluck.protos.net.transport import PeerClient
from potluck.protos.runtime.log import get_logger, short_id
from potluck.protos.testkit.faults import fault, tamper
from potluck.protos.wire.refusals import is_silent, is_unreachable, refusal_of, refused, rpc_reason
from potluck.protos.wire.states import CATCHING_UP, GONE, NOT_PARTICIPATING, PeerState

log = get_logger(__name__)

# (what callers of the all-reduce import from here)
__all__ = ["AllReduce", "AllReduceStats", "IncompleteRound", "MemberAddr", "Outcome", "Phase", "ReduceRound",
           "RoundInfo", "reduce_mean", "result_stream", "shard_bounds"]

PING_S = 2.0
CODEC_WORKERS = 2


def _went_past(err: grpc.RpcError, info: RoundInfo) -> bool:
    """Did a member refuse our message for ``info``'s step because it is past it: a later step of this epoch,
    or a later epoch (the run was rolled back while we were in this step; ours is abandoned)?"""
    refused = refusal_of(err)
    return refused is not None and ((refused.code == pb.WRONG_STEP and refused.at_step > info.step)
                                    or (refused.code == pb.WRONG_EPOCH and refused.at_epoch > info.epoch))


class AllReduce:
    """One peer's outer all-reduce: the procedure (:meth:`run`), which acts for one :class:`ReduceRound` at a
    time, and the receiving half it holds (``inbox``, a :class:`ShardInbox`: the RPC handlers and what they
    keep), which the peer's service hands the all-reduce's RPCs to.

    Its condition is the procedure's: it waits on it for what the inbox receives and for what its round's
    threads mark (members dead or ahead), so it gives it to both, and holds it while it reads the inbox's view
    of a shard. The send and codec pools, the result vector made ahead of time and the plan's newest epoch
    are the procedure's own.
    """

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
        receipts: bool = True,
        quorum: float = 0.5,
        evidence_share: float = 0.0,
    ) -> None:
        """``pinned``: the mean (which becomes theta_global) in page-locked memory, for a GPU peer's copy.
        ``receipts``: sign a receipt for each contribution this member keeps as an owner, and hold owners to theirs
        (off only to measure what they cost: ``benchmarks/verified_reduction.py``). ``evidence_share``: how many
        times a step auditors are expected to fetch an owner's shard inputs, which a paced round budgets
        (:func:`~potluck.peer.reduce.pacing.round_bytes`)."""
        self.run_id, self.me, self.numel, self.codec = run_id, me, numel, codec
        self.pinned = pinned
        self.sign = sign or (lambda digest: b"")
        self.clip_factor, self.reject_below = clip_factor, reject_below
        self.stopping = stopping or threading.Event()
        self.client, self.chunk_bytes, self.rpc_timeout, self._ping = client, chunk_bytes, rpc_timeout, ping
        self._cond = threading.Condition()  # (re-entrant: the inbox's methods take it again while this holds it)
        self.receipts = receipts and sign is not None
        self.quorum = quorum  # (sync.quorum: the share of the step's live contributors an owner's result must name)
        self.inbox = ShardInbox(run_id=run_id, me=me, numel=numel, codec=codec, cond=self._cond,
                                sign=sign if self.receipts else None)
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="allreduce")
        self._out: Future | None = None  # the next result's whole vector, its pages touched ahead of time
        # encodes chunk i + 1 while chunk i is on the wire, and an owner's result a few chunks at a time
        self._codec_pool = ThreadPoolExecutor(max_workers=CODEC_WORKERS, thread_name_prefix="codec")
        # the plan's newest epoch and its first step: a round of an earlier epoch at or past it was abandoned
        self._newest: tuple[int, int] = (0, 0)
        self.tamper = tamper  # POTLUCK_FAULTS' owner.* points (a test may give one member faults of its own)
        self.pacing = Pacing(self.stopping, chunk_bytes)  # sync.pace: the rate this member's sends are held to
        self.evidence_share = evidence_share  # (audits a step of an owner's shard, expected: what pacing budgets)

    # ---------------------------------------------------------------- the coming step

    def expect(self, step: int, base_hash: str | Future[str], epoch: int = 0) -> None:
        """Get ready for ``step`` (of ``epoch``) from the theta_global hashed to ``base_hash``: the inbox accepts
        its messages from now (:meth:`ShardInbox.expect`), and the vector its result goes to is made."""
        self.inbox.expect(step, base_hash, epoch)
        if self._out is None:
            # the result becomes the caller's new theta: a fresh vector, whose first writes would cost
            # page faults inside the round (40 ms for 80 MB here); touched now, while the inner phase runs
            # (a pinned one is resident already, and after the first step torch's host allocator reuses one)
            self._out = self._codec_pool.submit(self._fresh_out)

    def _take_out(self) -> torch.Tensor:
        """The vector the next result is written into (made ahead of time by :meth:`expect`)."""
        out, self._out = (self._out.result() if self._out is not None else torch.empty(self.numel)), None
        return out

    def _fresh_out(self) -> torch.Tensor:
        out = host_vector(self.numel, self.pinned)
        return out if self.pinned and out.is_pinned() else out.zero_()

    def supersede(self, epoch: int, from_step: int) -> None:
        """The plan's newest epoch is ``epoch`` and begins at ``from_step``: a round of an earlier epoch at or past
        that step in progress was abandoned (the run rolled back past it, or that round failed) and stops now
        (:meth:`run`), not at its deadline (which held up a rerun 6 s); one before it still stands.
        (No lock: the heartbeat's thread calls it, and the procedure's waits look every 50 ms.)"""
        if epoch > self._newest[0]:
            self._newest = (epoch, from_step)

    def abandoned(self, info: RoundInfo) -> bool:
        epoch, from_step = self._newest
        return info.epoch < epoch and info.step >= from_step

    # ---------------------------------------------------------------- the procedure

    def run(self, info: RoundInfo, delta: torch.Tensor | None, wait_s: float, grace_s: float = 2.0,
            samples: int = 1, pace_s: float = 0.0) -> tuple[torch.Tensor, AllReduceStats]:
        """Average ``delta`` over the members of ``info``; returns the mean as every member applies it.

        ``delta`` is None when this member has nothing valid to contribute (it still owns its shard
        and gathers the result). ``samples``: the work in ``delta`` (the samples it was trained on), its
        weight in the average, signed with it. Raises :class:`IncompleteRound` if a shard cannot be had in time.
        ``pace_s``: spread this member's contributions and results over about this long (:mod:`potluck.peer.reduce.pacing`).
        """
        t_start = time.monotonic()
        sent_before = self.client.traffic.snapshot()[0].get("outer", 0)
        step, base = self.inbox.expecting()
        if (info.step, info.base_hash) != (step, base):
            raise ValueError(f"round {info.step} from {info.base_hash[:12]} but expecting {step} from {base[:12]}")
        self.inbox.set_round(info)
        deadline = t_start + wait_s
        # a member still fetching the round's base state (a joiner, or one re-assigned) is waited for
        # `grace_s`; the others wait `grace_s` past the deadline for each result: a backup that freezes
        # mid-transfer must not use it all up, or they give up on this shard (and this member) before it
        # tries another
        rnd = ReduceRound(info, self._cond, catch_up_until=min(deadline, t_start + grace_s),
                          backup_timeout=max(PING_S, 0.5 * grace_s), deadline=deadline, samples=samples)
        # what this member sends: its slices of the other shards, its own shard's result to the others, and the
        # evidence auditors will fetch from it
        self.pacing.begin(round_bytes(self.numel, len(info.members), info.shards, self.codec.bytes_per_element,
                                      info.shard is not None, self.evidence_share), pace_s)
        try:
            return self._run(rnd, delta, t_start, deadline, grace_s, sent_before)
        finally:
            rnd.finish()  # whatever still acts for it (a probe, a send) can no longer change anything
            self.pacing.end()

    def _run(self, rnd: ReduceRound, delta: torch.Tensor | None, t_start: float, deadline: float, grace_s: float,
             sent_before: int) -> tuple[torch.Tensor, AllReduceStats]:
        info = rnd.info
        n, me = info.shards, info.shard
        bounds = shard_bounds(self.numel, n, self.codec.align)
        stats = AllReduceStats(step=info.step, members=n)

        def on_send_error(peer: MemberAddr, err: grpc.RpcError) -> None:
            if is_unreachable(err):
                rnd.mark_dead(peer.peer_id)
            elif _went_past(err, info):
                rnd.mark_ahead(peer.peer_id)  # the round went on without us: never average alone
            log.info("send to %s failed: %s", short_id(peer.peer_id), rpc_reason(err))

        # 1. reduce: our slice of every shard goes to its owner, signed (our own shard's too: encoded and
        # signed like any other, so what we average is what an auditor can check)
        sent: list[float] = []  # when each of our contributions was delivered (or given up), since t_start
        if delta is None:  # nothing from us: the owners need not wait for it until their deadline
            self._abstain(info)
        if delta is not None:
            for j, owner in enumerate(info.shard_owners):
                lo, hi = bounds[j]
                if j == me:
                    self._own_contribution(info, j, 0, delta[lo:hi], rnd.samples)
                else:
                    self._submit(self._send, "contribution", rnd, info.address_of(owner), j, 0, delta[lo:hi],
                                 on_send_error).add_done_callback(lambda f: sent.append(time.monotonic() - t_start))
        if me is not None:
            self._reduce_shard(rnd, me, 0, bounds, deadline, stats)

        # 2. gather: wait for the other owners' results
        rnd.enter(Phase.GATHERING)
        result_deadline = deadline + grace_s
        missing = self._wait_results(rnd, result_deadline)
        if self.receipts:  # (before the quorum drops any: a result not adopted still proves its owner's omission)
            stats.omitted = self._omissions(info, {j: r for j in range(n) if (r := self.inbox.result(j)) is not None})
        short = self._drop_short(rnd, [j for j in range(n) if j not in missing])

        # 3. take over the shards of owners that died or never answered -- unless the others already
        # committed this step without us, in which case ours would be a minority result: recover instead
        if rnd.ahead and missing:
            raise IncompleteRound(f"step {info.step}: {short_id(rnd.ahead[0])} already went past it without this peer")
        for j in missing:
            rnd.mark_dead(info.shard_owners[j])
        missing = sorted(set(missing) | set(short))  # (an owner short of a quorum is alive: it gets the backup's result)
        stats.short = short
        stats.unreceipted = sorted(rnd.unreceipted.items())
        if missing:
            rnd.enter(Phase.TAKING_OVER)
            # a member that learned early that an owner is gone still gives its backup, which may only
            # notice at its own result deadline, the time to take the shard over
            takeover_deadline = max(time.monotonic(), result_deadline) + 2 * max(grace_s, 2.0)
            for j in missing:
                self._take_over(rnd, j, bounds, delta, takeover_deadline, stats, short=j in short)
            still = self._wait_results(rnd, takeover_deadline, shards=missing)
            if self.receipts:  # (a taker is held to its receipts too)
                stats.omitted += self._omissions(info, {j: r for j in missing if (r := self.inbox.result(j)) is not None})
            if still:
                raise IncompleteRound(f"step {info.step}: no result for shard(s) {still} after take-over")

        futures_wait(rnd.pending, timeout=grace_s)  # our own broadcasts: finish sending before training on
        with self._cond:
            results = self.inbox.results(n)
            stats.dropped = sorted(rnd.dead)
        stats.seconds = time.monotonic() - t_start
        stats.send_s = max(sent, default=0.0)
        stats.paced_s, stats.pace_bps = self.pacing.held_back()
        stats.bytes_sent = self.client.traffic.snapshot()[0].get("outer", 0) - sent_before
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
        for r in results:  # (an honest contributor claims the same in every shard; the most any shard weighed it)
            for p, w in zip(r.outcome.inputs, r.outcome.weights, strict=False):
                if p in r.outcome.contributors and p in info.ids and info.replica_of(p) in stats.included:
                    rep = info.replica_of(p)
                    stats.samples[rep] = max(stats.samples.get(rep, 0), int(w))
        if stats.partial:  # each shard is still a true mean of its own contributors
            log.warning("step %d: contributions of %s arrived too late for some shards (counted in %s)", info.step,
                        ", ".join(short_id(p) for p in stats.partial),
                        "; ".join(f"shard {j}: {len(c)}" for j, c in enumerate(counted)))
        out = self._take_out()
        return torch.cat([r.values for r in results], out=out), stats

    def _abstain(self, info: RoundInfo) -> None:
        """Tell the other owners this member contributes nothing to the step (gRPC futures: nothing waits)."""
        request = pb.PingRequest(header=pb.Header(run_id=self.run_id, sender=self.me, step=info.step, epoch=info.epoch),
                                 sent_at=time.time(), abstain=True)
        targets = [(info.address_of(o).address, o) for o in info.shard_owners if o != self.me]
        self.client.ping_each(targets, request, PING_S, lambda peer, ok: None)

    def _submit(self, fn: Callable, *args: object) -> Future:
        return self._pool.submit(fn, *args)

    def _contribution_digest(self, info: RoundInfo, shard: int, attempt: int, digests: list[bytes], samples: int) -> bytes:
        return contribution_digest(self.run_id, info.step, info.epoch, shard, info.shards, attempt, info.base_hash,
                                   self.me, digests, samples)

    def _own_contribution(self, info: RoundInfo, shard: int, attempt: int, values: torch.Tensor, samples: int) -> None:
        """This member's slice of a shard it reduces, as any contributor sends it: encoded and signed, then handed
        to the inbox, which decodes it as it does the others'."""
        stream = EncodedStream.of(f"shard{shard}", values, self.codec, self.chunk_bytes, self._codec_pool)
        chunks, digests = list(stream), stream.digests()
        signed = Signed(chunks, self.me, self.sign(self._contribution_digest(info, shard, attempt, digests, samples)),
                        digests, samples)
        self.inbox.add_own_contribution(info, shard, attempt, signed)

    def _chunks(self, info: RoundInfo, shard: int, attempt: int, stream: EncodedStream,
                samples: int) -> Iterator[pb.ShardChunk]:
        """A contribution's chunks, each naming its work (``samples``); the last carries this member's signature
        over all of them and that work."""
        hdr = pb.Header(run_id=self.run_id, sender=self.me, step=info.step, epoch=info.epoch)
        tensors = list(stream)
        digests: list[bytes] = []
        for i, t in enumerate(tensors):
            digests.append(stream.digest(i))
            chunk = pb.ShardChunk(header=hdr, shard=shard, num_shards=info.shards, attempt=attempt,
                                  base_hash=info.base_hash, tensor=t, samples=samples)
            if i == len(tensors) - 1:
                chunk.signer = self.me
                chunk.signature = self.sign(self._contribution_digest(info, shard, attempt, digests, samples))
                self.inbox.keep_sent(info, shard, attempt, Signed(tensors, self.me, chunk.signature, list(digests), samples))
            yield chunk

    def _results_of(self, info: RoundInfo, shard: int, tensors: list[pb.Tensor], outcome: Outcome) -> list[pb.ShardChunk]:
        """A result's messages, made once and sent as they are to each member (each is a copy of its chunk)."""
        hdr = pb.Header(run_id=self.run_id, sender=self.me, step=info.step, epoch=info.epoch)
        return list(result_stream(hdr, shard, info.shards, info.base_hash, tensors, outcome))

    def _halt(self, rnd: ReduceRound) -> None:
        """Raise if the procedure must stop waiting: the peer stops, or ``rnd``'s epoch was abandoned."""
        if self.stopping.is_set():
            raise IncompleteRound("stopping")
        if self.abandoned(rnd.info):
            raise IncompleteRound(f"step {rnd.info.step} of epoch {rnd.info.epoch} was abandoned: the run was "
                                  f"rolled back (epoch {self._newest[0]})")

    def _send(
        self, kind: str, rnd: ReduceRound, peer: MemberAddr, shard: int, attempt: int, values: torch.Tensor,
        on_error: Callable[[MemberAddr, grpc.RpcError], None],
    ) -> bool:
        info = rnd.info
        # (paced, in smaller messages: whole 1 MiB ones would still leave in bursts)
        tensors = EncodedStream.of(f"shard{shard}", values, self.codec, self.pacing.contribution_chunk(),
                                   self._codec_pool)
        while True:
            try:
                ack = self.client.push_contribution(peer.address, paced(self._chunks(info, shard, attempt, tensors,
                                                                                      rnd.samples), self.pacing.round),
                                                    self.rpc_timeout, peer=peer.peer_id)
                if not self._check_receipt(info, peer.peer_id, shard, attempt, ack.receipt) and kind == "contribution":
                    self._withheld(rnd, peer, shard, values, "it acknowledged it without a valid receipt", True)
                return True
            except grpc.RpcError as err:
                refused = refusal_of(err)
                # the owner is behind: at an earlier step, or at this step but not yet holding its base (a member
                # re-assigned to this stage still holds its old stage's state until it fetched this one), waited
                # for the grace period; or in an earlier epoch, yet to see the rollback: waited for to the deadline
                unrolled = refused is not None and refused.code == pb.WRONG_EPOCH and refused.at_epoch < info.epoch
                behind = refused is not None and ((refused.code == pb.WRONG_STEP and refused.at_step < info.step)
                                                  or refused.code == pb.BASE_MISMATCH)
                until = rnd.deadline if unrolled else rnd.catch_up_until if behind else 0.0
                if (time.monotonic() < until and not self.stopping.wait(0.2) and not self.abandoned(info)
                        and rnd.phase is not Phase.DONE and not rnd.is_dead(peer.peer_id)):
                    continue  # the owner is still fetching this round's base state: try again shortly
                on_error(peer, err)
                if kind == "contribution" and (why := self._unreceipted_why(rnd, err)):
                    self._withheld(rnd, peer, shard, values, why[0], why[1])
                return False

    def _unreceipted_why(self, rnd: ReduceRound, err: grpc.RpcError) -> tuple[str, bool] | None:
        """Why an owner's failure to take this member's contribution sends it to the shard's backup: (why, whether the
        owner is to blame: named in this member's report). None for a refusal of the round's own (a step, epoch or base
        the other is not at: the round moved on, or one of the two is behind) or of this member's own making."""
        if is_unreachable(err):
            return "it is unreachable", False  # (gone: the take-over needs it at the backup; nobody is blamed)
        if is_silent(err):
            return f"it did not answer in {self.rpc_timeout:g} s", True
        info = refusal_of(err)
        code = info.code if info is not None else -1
        if code in (pb.OVERLOADED, pb.NOT_OWNER) or (code == pb.ALREADY_REDUCED and time.monotonic() < rnd.deadline):
            return f"it refused it ({pb.Refusal.Name(code)}) before the round's deadline", True
        return None

    def _withheld(self, rnd: ReduceRound, owner: MemberAddr, shard: int, values: torch.Tensor, why: str,
                  blame: bool) -> None:
        """``owner`` neither receipted this member's contribution to ``shard`` nor refused it for the round's reasons:
        sent to the shard's backup at once (attempt 1: the take-over, by want of a quorum or of the owner, then has it,
        and need not wait for it), and, if the owner is to blame, named in this member's report of the step (an owner
        named so in several steps by several members loses its ownership: the coordinator's
        :class:`~potluck.coordinator.trust.integrity.Integrity`)."""
        info = rnd.info
        if blame and rnd.not_receipted(shard, why):
            log.warning("%s did not receipt this peer's contribution to shard %d of step %d: %s; sent to its backup "
                        "and reported", short_id(owner.peer_id), shard, info.step, why)
        backup = next((p for p in info.ring_after(shard) if not rnd.is_dead(p.peer_id)), None)
        if backup is None or backup.peer_id == self.me or rnd.phase is Phase.DONE or self.abandoned(info):
            return  # (this member as the backup adds its own when it takes the shard over)
        if self._send("witness", rnd, backup, shard, 1, values, lambda p, e: None):
            rnd.sent_to_backup(shard, backup.peer_id)

    def _check_receipt(self, info: RoundInfo, owner: str, shard: int, attempt: int, receipt: bytes) -> bool:
        """Keep ``owner``'s receipt of this member's contribution to ``shard``: its result must name that contribution,
        or this member holds a proof (:meth:`_omissions`). False if the owner acknowledged it without a valid receipt
        (said in the log; the caller sends the contribution to the backup and names the owner)."""
        if not self.receipts:
            return True
        mine = self.inbox.sent(shard, attempt)
        if mine is None:
            return True  # (the expected step moved on while it was sent)
        digest = self._contribution_digest(info, shard, attempt, mine.chunk_digests(), mine.samples)
        if receipt and verify(owner, receipt_digest(digest), receipt):
            self.inbox.receipted(info, shard, attempt, receipt)
            return True
        log.warning("%s acknowledged this peer's contribution to shard %d of step %d without a valid receipt",
                    short_id(owner), shard, info.step)
        return False

    def _live(self, n: int) -> set[str]:
        """The step's live contributors as the results held show them: everyone any of them names."""
        out: set[str] = set()
        for j in range(n):
            if (res := self.inbox.result(j)) is not None:
                out |= set(res.outcome.contributors) | set(res.outcome.rejected)
        return out

    def _short(self, res: ShardResult, live: set[str]) -> bool:
        """An owner's result (attempt 0) naming fewer than ``quorum`` of ``live``: not adopted. A taker's is: it
        averaged what was sent to it again, after the owner's was not."""
        named = set(res.outcome.contributors) | set(res.outcome.rejected)
        return res.outcome.attempt == 0 and self.quorum > 0 and len(named) < self.quorum * len(live)

    def _drop_short(self, rnd: ReduceRound, held: list[int]) -> list[int]:
        """The results of ``held`` short of a quorum (:meth:`_short`), dropped: a later delivery of one is refused, and
        the shard's backup takes it over from the contributions sent to it again. An owner that averages only its
        own (or leaves out most of the others) changes nothing that way, receipted or not."""
        info = rnd.info
        out: list[int] = []
        owners = [j for j in held if (r := self.inbox.result(j)) is not None and r.outcome.attempt == 0]
        if self.quorum <= 0 or not owners:
            return out  # (nothing an owner signed to judge: the step's live contributors need not be counted, as the
        live = self._live(info.shards)  # take-over's wait for a taker's result asks every 50 ms)
        for j in owners:
            if (res := self.inbox.result(j)) is None or not self._short(res, live):
                continue
            named = len(set(res.outcome.contributors) | set(res.outcome.rejected))
            log.warning("shard %d of step %d: the result of %s names %d of the step's %d live contributors (sync.quorum "
                        "%.2f): not adopted; its backup takes the shard over", j, info.step,
                        short_id(res.outcome.signer), named, len(live), self.quorum)
            self.inbox.drop_result(j)
            out.append(j)
        return out

    def _omissions(self, info: RoundInfo, results: dict[int, ShardResult]) -> list[tuple[int, int, str]]:
        """The results whose signer receipted this member's contribution and left it out: (shard, attempt, signer)
        each, with the contribution and its receipt kept as evidence for the coordinator's check."""
        out = []
        for j, r in results.items():
            o = r.outcome
            mine = self.inbox.sent(j, o.attempt) if j != info.shard else None
            if mine is None or not mine.receipt:
                continue
            digest = self._contribution_digest(info, j, o.attempt, mine.chunk_digests(), mine.samples)
            if dict(zip(o.inputs, o.input_digests, strict=False)).get(self.me) == digest or not verify(
                    o.signer, receipt_digest(digest), mine.receipt):
                continue  # named, or a result of someone who never receipted it (a taker's)
            log.warning("%s receipted this peer's contribution to shard %d of step %d and left it out of its signed "
                        "result: reported to the coordinator, with the proof", short_id(o.signer), j, info.step)
            self.inbox.keep_evidence(info.step, info.epoch, j, o.attempt, {self.me: mine})
            self.inbox.keep_result_evidence(info.step, info.epoch, j, r)
            out.append((j, o.attempt, o.signer))
        return out

    def _reduce_shard(
        self, rnd: ReduceRound, shard: int, attempt: int, bounds: list[tuple[int, int]], deadline: float,
        stats: AllReduceStats, forwarded_ok: bool = False, patience: dict[str, float] | None = None,
    ) -> None:
        """Collect contributions to ``shard``, then average, encode once and distribute the result. ``patience``: members
        waited for only until the time given (an owner whose result fell short of a quorum: taking its shard over, its
        backup gives its slice a ping's time, not the deadline, for it may be frozen; it counts if it comes in time)."""
        info = rnd.info
        t0 = time.monotonic()
        expected = set(info.ids) - {self.me}  # (our own contribution, if any, is in already)
        patience = patience or {}
        next_ping = 0.0
        with self._cond:  # (held across the inbox's calls: one view of the shard, and nothing arrives unseen)
            while True:
                if forwarded_ok and (held := self.inbox.result(shard)) is not None:
                    if not self._short(held, self._live(info.shards)):
                        break
                    self._drop_short(rnd, [shard])  # (the owner's, short of a quorum: not handed on)
                waiting = self.inbox.awaited(shard, attempt, expected) - rnd.dead
                waiting -= {p for p, until in patience.items() if time.monotonic() >= until}
                if not waiting or time.monotonic() >= deadline or rnd.ahead:
                    break  # (a member already went past this step: it is lost here, stop collecting for it)
                self._halt(rnd)
                if time.monotonic() >= next_ping:
                    next_ping = time.monotonic() + 0.5
                    for pid in waiting:
                        self._submit(self._probe, rnd, pid)
                self._cond.wait(timeout=0.05)
            got, signed = self.inbox.close_shard(shard, attempt)
            forwarded = self.inbox.result(shard) if forwarded_ok else None
        stats.wait_seconds += time.monotonic() - t0
        if forwarded is not None:  # we hold the owner's result already: hand on exactly that (its signature too)
            result_chunks, outcome = forwarded.chunks, forwarded.outcome
        else:
            lo, hi = bounds[shard]
            if (drop := self.tamper("owner.drop", info.step, "")) in ("others", "one"):  # a Byzantine owner (tests):
                gone = sorted(set(got) - {self.me})[:None if drop == "others" else 1]  # receipted, then left out
                got = {s: v for s, v in got.items() if s not in gone}
            weights = {s: signed[s].samples for s in got}  # as each sender signed it (an over-claim was refused)
            if self.me in weights:  # (a Byzantine owner that weighs its own contribution up, in tests: owner.weight)
                weights[self.me] = int(self.tamper("owner.weight", info.step, weights[self.me]))
            red = robust_reduction(got, hi - lo, self.clip_factor, self.reject_below, weights)
            step = info.step

            def mean(a: int, b: int) -> torch.Tensor:  # (a Byzantine owner, in tests: POTLUCK_FAULTS owner.mean)
                return self.tamper("owner.mean", step, red.mean(a, b), a)

            clipped = red.clipped
            if self.tamper("owner.flags", step, False) is True:  # an honest mean, with false flags (tests)
                clipped = sorted(set(red.contributors) - {self.me})
            # summed in float32 and re-quantized a chunk at a time, chunks on the codec workers, each
            # hashed there as soon as it is made (always in chunk_bytes messages: an auditor recomputes the
            # result and compares it chunk for chunk)
            made = EncodedStream(f"shard{shard}", hi - lo, mean, self.codec, self.chunk_bytes, self._codec_pool)
            result_chunks = list(made)
            inputs = sorted(got)  # what this result was averaged from, each sender's contribution by its digest
            input_digests = [contribution_digest(self.run_id, info.step, info.epoch, shard, info.shards, attempt,
                                                 info.base_hash, s, signed[s].digests, signed[s].samples) for s in inputs]
            signed_weights = [signed[s].samples for s in inputs]
            digest = result_digest(self.run_id, info.step, info.epoch, shard, info.shards, attempt,
                                   info.base_hash, red.contributors, clipped, red.rejected,
                                   made.digests(), zip(inputs, input_digests, strict=True), signed_weights)
            outcome = Outcome(attempt, red.contributors, clipped, red.rejected, self.me, self.sign(digest), inputs,
                              input_digests, signed_weights)
            missing = sorted(set(info.ids) - set(got))
            if len(got) < len(expected):
                log.info("shard %d of step %d reduced without %s", shard, info.step, ", ".join(short_id(m) for m in missing))
            if red.clipped or red.rejected:
                log.warning("shard %d of step %d: clipped %s, rejected %s", shard, info.step,
                            [short_id(p) for p in red.clipped], [short_id(p) for p in red.rejected])
        fault("allreduce.reduced", info.step)
        self._distribute(rnd, shard, result_chunks, outcome)

    def _distribute(self, rnd: ReduceRound, shard: int, chunks: list[pb.Tensor], outcome: Outcome) -> None:
        """Backup first, then everyone: nobody can hold a result its shard's backup lacks.

        The backup is the next owner in ring order that is there (one that may take the shard over:
        a member on probation never does): owners whose contribution arrived come first (one that missed
        the deadline is not waited on again), and each is pinged before the transfer, so a member that
        froze since costs a ping, not a transfer timeout.
        """
        info = rnd.info
        ring = info.ring_after(shard)
        came = set(outcome.contributors) | set(outcome.rejected)
        candidates = [p for p in ring if p.peer_id in came] + [p for p in ring if p.peer_id not in came]
        backup_ok, backup = True, None
        pacer = self.pacing.round  # (paced like the rest: its transfer's time out stretched by what the pace takes)
        stretch = pacer.eta(sum(c.ByteSize() for c in chunks)) if pacer is not None else 0.0
        messages = self._results_of(info, shard, chunks, outcome)
        for peer in candidates:
            if rnd.is_dead(peer.peer_id) or peer.peer_id == self.me or not self._answers(rnd, peer.peer_id):
                continue
            try:
                self.client.push_result(peer.address, paced(iter(messages), pacer),
                                        min(self.rpc_timeout, rnd.backup_timeout + stretch), peer=peer.peer_id)
                backup = peer
                break
            except grpc.RpcError as err:
                if is_unreachable(err) or is_silent(err):
                    rnd.mark_dead(peer.peer_id)
                    continue
                if refused(err, pb.TAKEN_OVER):
                    log.info("shard %d of step %d was taken over by %s; dropping our late result", shard, info.step, short_id(peer.peer_id))
                    backup_ok = False
                    break
                if _went_past(err, info):
                    # it committed this step already, so with a result for this shard that is not ours
                    log.info("backup %s went past step %d without our shard %d", short_id(peer.peer_id), info.step, shard)
                    rnd.mark_ahead(peer.peer_id)
                    backup_ok = False
                    break
                log.info("backup %s refused shard %d: %s", short_id(peer.peer_id), shard, rpc_reason(err))
                break
        if not backup_ok:
            return
        self.inbox.store_own_result(info, shard, chunks, outcome)
        for peer in info.members:
            if peer is backup or rnd.is_dead(peer.peer_id) or peer.peer_id == self.me:
                continue
            rnd.pending.append(self._submit(self._push_result, peer, shard, messages))

    def _answers(self, rnd: ReduceRound, peer_id: str) -> bool:
        """Does ``peer_id`` answer a ping now? A stopped or vanished member is marked dead instead."""
        try:
            self._ping(peer_id, PING_S)
            return True
        except grpc.RpcError as err:
            if is_unreachable(err) or is_silent(err):
                rnd.mark_dead(peer_id, f"it does not answer ({rpc_reason(err)})")
                return False
            return True  # it answered, with a refusal: it is there

    def _push_result(self, peer: MemberAddr, shard: int, messages: list[pb.ShardChunk]) -> None:
        try:
            # (paced with the round, as the backup's copy was)
            self.client.push_result(peer.address, paced(iter(messages), self.pacing.round),
                                    self.rpc_timeout, peer=peer.peer_id)
        except grpc.RpcError as err:
            log.info("result of shard %d to %s failed: %s", shard, short_id(peer.peer_id), rpc_reason(err))

    def _probe(self, rnd: ReduceRound, peer_id: str) -> None:
        """Is a member we wait for still coming? Unreachable or not in this step means: stop waiting. (A probe
        that answers after its round ended changes nothing: it acts on its own round only.)"""
        info = rnd.info
        try:
            reply = self._ping(peer_id, 2.0)
        except grpc.RpcError as err:
            if not is_unreachable(err):
                return
            reason = "unreachable"
        else:
            # a state made in an earlier epoch past this round's base: the member has yet to see the rollback
            unrolled = reply.epoch < info.epoch and reply.version >= info.step and reply.state not in GONE
            if reply.epoch > info.epoch or (reply.version >= info.step and not unrolled):
                rnd.mark_ahead(peer_id)  # it committed this step already (without us), or a later epoch's
                return
            if reply.state not in NOT_PARTICIPATING and reply.version == info.step - 1:
                return
            # behind the round's base (fetching it to take part), or holding it and waiting to see the
            # round itself: give it the grace period. A member recovering *from* the base gave up the step.
            catching_up = reply.state in CATCHING_UP and (reply.version < info.step - 1 or reply.state == PeerState.WAITING
                                                          or reply.epoch < info.epoch)  # (just rolled back)
            if unrolled or (catching_up and time.monotonic() < rnd.catch_up_until):
                return  # (one not rolled back yet is waited for to the deadline, as its sends are)
            reason = f"{reply.state} at version {reply.version}"
        rnd.mark_dead(peer_id, f"not waiting for it in step {info.step}: {reason}")

    def _wait_results(self, rnd: ReduceRound, deadline: float, shards: list[int] | None = None) -> list[int]:
        """Wait for results of ``shards`` (default: all); returns those still missing."""
        info = rnd.info
        wanted = list(range(info.shards)) if shards is None else shards
        with self._cond:
            while True:
                if shards is not None:  # (taking over: an owner's late result short of a quorum is not adopted either)
                    self._drop_short(rnd, [j for j in wanted if self.inbox.result(j) is not None])
                missing = self.inbox.missing_results(wanted)
                if not missing or time.monotonic() >= deadline:
                    return missing
                self._halt(rnd)
                if shards is None and all(info.shard_owners[j] in rnd.dead for j in missing):
                    return missing
                if rnd.ahead:
                    return missing
                self._cond.wait(timeout=0.05)

    def _take_over(
        self, rnd: ReduceRound, shard: int, bounds: list[tuple[int, int]], delta: torch.Tensor | None,
        deadline: float, stats: AllReduceStats, short: bool = False,
    ) -> None:
        info = rnd.info
        backup = next((p for p in info.ring_after(shard) if not rnd.is_dead(p.peer_id)), None)
        if backup is None:
            return
        stats.taken_over.append(shard)
        lo, hi = bounds[shard]
        owner = info.shard_owners[shard]
        if backup.peer_id == self.me:
            log.info("taking over shard %d of step %d from %s", shard, info.step, short_id(owner))
            self.inbox.take_over(shard)
            if delta is not None:
                self._own_contribution(info, shard, 1, delta[lo:hi], rnd.samples)
            self._reduce_shard(rnd, shard, 1, bounds, deadline, stats, forwarded_ok=True,  # (the owner is dead, or
                               patience={owner: time.monotonic() + PING_S} if short else None)  # its result fell short)
        elif delta is not None:
            if self.inbox.result(shard) is not None or rnd.backup_holds(shard, backup.peer_id):
                return  # (sent there already: its owner did not receipt it)
            self._submit(self._send, "takeover", rnd, backup, shard, 1, delta[lo:hi], lambda p, e: None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._codec_pool.shutdown(wait=False, cancel_futures=True)
