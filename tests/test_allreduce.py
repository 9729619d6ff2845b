"""The outer all-reduce between real gRPC servers in one process: agreement, failures, bad input."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from signing import signed

from potluck.compression.aggregate import result_digest
from potluck.compression.int8 import Int8BlockCodec
from potluck.compression.stream import encode_chunks, tensor_digest
from potluck.peer.reduce.allreduce import (
    AllReduce,
    IncompleteRound,
    MemberAddr,
    Outcome,
    RoundInfo,
    result_stream,
    shard_bounds,
)
from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.identity import Identity
from potluck.protos.net.transport import PeerClient, PeerServer, Traffic
from potluck.protos.wire.refusals import STATUS_OF, refusal_of

RUN, NUMEL, BLOCK = "test-run", 10_000, 256
BASE = "b" * 32


class Member:
    """One all-reduce participant with its own gRPC server, like a peer daemon minus training."""

    def __init__(self) -> None:
        self.identity = Identity.generate()
        self.id = self.identity.peer_id
        self.traffic = Traffic()
        self.client = PeerClient(self.traffic)
        self.state, self.version = "training", 0
        self.pings = 0
        self.addresses: dict[str, str] = {}
        self.ar = AllReduce(
            run_id=RUN, me=self.id, numel=NUMEL, codec=Int8BlockCodec(BLOCK), client=self.client,
            chunk_bytes=4096, rpc_timeout=5.0, ping=self._ping, sign=self.identity.sign,
        )
        self.ar.expect(1, BASE)
        self.server = PeerServer(self, self.traffic, host="127.0.0.1", port=0)
        self.address = f"127.0.0.1:{self.server.port}"

    def _ping(self, peer_id: str, timeout: float) -> pb.PingReply:
        return self.client.ping(self.addresses[peer_id], pb.PingRequest(header=pb.Header(run_id=RUN)), timeout)

    def ping(self, request: pb.PingRequest) -> pb.PingReply:
        self.pings += 1
        return pb.PingReply(peer_id=self.id, state=self.state, version=self.version)

    def push_contribution(self, chunks):  # type: ignore[no-untyped-def]
        return self.ar.inbox.on_contribution(chunks)

    def push_result(self, chunks):  # type: ignore[no-untyped-def]
        return self.ar.inbox.on_result(chunks)

    def fetch_result(self, request):  # type: ignore[no-untyped-def]
        return self.ar.inbox.on_fetch_result(request)

    def close(self) -> None:
        self.server.stop(0.1)
        self.ar.close()
        self.client.close()


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def members() -> Iterator[list[Member]]:
    ms = [Member() for _ in range(3)]
    yield ms
    for m in ms:
        m.close()


def round_for(ms: list[Member], me: Member, addresses: dict[str, str] | None = None, step: int = 1,
              handed: dict[str, int] | None = None) -> RoundInfo:
    order = sorted(ms, key=lambda m: m.id)
    addrs = {m.id: m.address for m in ms} | (addresses or {})
    me.addresses = addrs
    return RoundInfo(step=step, members=tuple(MemberAddr(m.id, addrs[m.id]) for m in order), me=me.id, base_hash=BASE,
                     handed=tuple(handed[m.id] for m in order) if handed else ())


def run_all(ms: list[Member], deltas: dict[str, torch.Tensor], wait_s: float, skip: set[str] = frozenset(),  # type: ignore[no-untyped-def]
            step: int = 1, samples: dict[str, int] | None = None, handed: dict[str, int] | None = None):
    out: dict[str, object] = {}

    def go(m: Member) -> None:
        try:
            out[m.id] = m.ar.run(round_for(ms, m, step=step, handed=handed), deltas[m.id], wait_s=wait_s, grace_s=1.0,
                                 samples=(samples or {}).get(m.id, 1))
        except Exception as err:
            out[m.id] = err

    threads = [threading.Thread(target=go, args=(m,)) for m in ms if m.id not in skip]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def random_deltas(ms: list[Member], seed: int = 0) -> dict[str, torch.Tensor]:
    """Pseudo-gradients like real ones: members trained the same model, so they share a direction."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(NUMEL, generator=gen)
    return {m.id: (common + 0.5 * torch.randn(NUMEL, generator=gen)) * 0.01 for m in ms}


def test_all_members_end_bit_identical(members: list[Member]) -> None:
    deltas = random_deltas(members)
    out = run_all(members, deltas, wait_s=10)
    means = [out[m.id][0] for m in members]
    assert all(torch.equal(means[0], x) for x in means[1:]), "members disagree"
    exact = torch.stack(list(deltas.values())).mean(0)
    assert float((means[0] - exact).abs().max()) < 2 * 0.05 / 127  # two quantizations of |x| < ~0.05
    stats = out[members[0].id][1]
    assert stats.contributors == {0: 3, 1: 3, 2: 3} and not stats.dropped


def test_contributions_count_by_their_samples_and_a_claim_beyond_the_share_is_refused(members: list[Member]) -> None:
    """Members of a round that trained 160, 40 and 80 samples: the mean weighs them so (within the int8 codec), every
    member applies the same bits, and each knows what each contribution claimed. A member that claims 1,000 of a
    share of 160 is refused by every other owner (OVERCLAIM): it is left out of the version, not weighed up."""
    a, b, c = sorted(members, key=lambda m: m.id)
    deltas = random_deltas(members)
    samples, handed = {a.id: 160, b.id: 40, c.id: 80}, dict.fromkeys([a.id, b.id, c.id], 160)
    out = run_all(members, deltas, wait_s=10, samples=samples, handed=handed)
    means = [out[m.id][0] for m in members]
    assert all(torch.equal(means[0], x) for x in means[1:])
    weighted = sum(deltas[p] * w for p, w in samples.items()) / sum(samples.values())
    assert float((means[0] - weighted).abs().max()) < 2 * 0.05 / 127
    assert float((means[0] - torch.stack(list(deltas.values())).mean(0)).abs().max()) > 4 * 0.05 / 127  # not plain
    assert out[a.id][1].samples == {0: 160, 1: 40, 2: 80}
    for m in members:
        m.ar.expect(2, BASE)
        m.version = 1
    greedy = {**samples, c.id: 1000}
    out = run_all(members, deltas, wait_s=2.5, samples=greedy, handed=handed, step=2)  # (c's refused: waited out)
    stats = out[a.id][1]
    assert stats.included == [0, 1] and 2 not in stats.samples, stats  # its slices reached only its own shard
    assert c.id in stats.partial


def test_traffic_is_about_a_quarter_of_fp32(members: list[Member]) -> None:
    out = run_all(members, random_deltas(members), wait_s=10)
    sent = sum(out[m.id][1].bytes_sent for m in members)
    fp32_ring = 3 * 2 * (2 / 3) * 4 * NUMEL
    assert sent / fp32_ring < 0.3


def test_dead_member_is_dropped_at_once_and_its_shard_taken_over(members: list[Member]) -> None:
    a, b, c = members
    c.server.stop(0)  # c died before the outer step
    t0 = time.monotonic()
    out = run_all(members, random_deltas(members), wait_s=20, skip={c.id})
    elapsed = time.monotonic() - t0
    assert elapsed < 10, f"waited {elapsed:.1f} s for a member whose port refuses connections"
    (ma, sa), (mb, sb) = out[a.id], out[b.id]
    assert torch.equal(ma, mb)
    assert c.id in sa.dropped and c.id in sb.dropped
    order = sorted(members, key=lambda m: m.id)
    assert order.index(c) in sa.taken_over


def test_stalled_member_is_dropped_after_the_deadline(members: list[Member]) -> None:
    a, b, c = members  # c answers pings ("training") but never reaches its outer step
    t0 = time.monotonic()
    out = run_all(members, random_deltas(members), wait_s=1, skip={c.id})  # (a and b's contributions: milliseconds)
    elapsed = time.monotonic() - t0
    assert 0.5 < elapsed < 12
    assert torch.equal(out[a.id][0], out[b.id][0])


def test_late_member_within_the_deadline_is_included(members: list[Member]) -> None:
    a, b, c = members
    deltas = random_deltas(members, seed=3)
    result: dict[str, object] = {}
    early = threading.Thread(target=lambda: result.update(run_all(members, deltas, wait_s=20, skip={c.id})))
    early.start()
    # c starts only once both others have pushed their contributions into its mailbox
    deadline = time.monotonic() + 20
    while c.ar.inbox.pending_contributions() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    mc = c.ar.run(round_for(members, c), deltas[c.id], wait_s=20, grace_s=1.0)
    early.join(timeout=60)
    assert torch.equal(result[a.id][0], mc[0]) and torch.equal(result[b.id][0], mc[0])
    assert mc[1].contributors == {0: 3, 1: 3, 2: 3}


def test_a_member_still_fetching_the_rounds_base_is_waited_for(members: list[Member]) -> None:
    """A joiner admitted to step 5 is still downloading v4 when the others finish their inner steps:
    they retry their pushes to it and keep waiting (within the grace period) instead of dropping it."""
    a, b, c = members
    for m in (a, b):
        m.ar.expect(5, BASE)
        m.version = 4
    c.state, c.version = "recovering", 0  # its all-reduce still expects step 1: pushes for step 5 are refused
    deltas = random_deltas(members, seed=5)
    out: dict[str, object] = {}

    def go(m: Member) -> None:
        try:
            out[m.id] = m.ar.run(round_for(members, m, step=5), deltas[m.id], wait_s=20, grace_s=10.0)
        except Exception as err:
            out[m.id] = err

    threads = [threading.Thread(target=go, args=(m,)) for m in (a, b)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while c.pings < 2 and time.monotonic() < deadline:  # both have found it catching up, and kept waiting
        time.sleep(0.01)
    assert c.pings >= 2
    c.ar.expect(5, BASE)  # it has the base state now
    c.state, c.version = "training", 4
    mc = c.ar.run(round_for(members, c, step=5), deltas[c.id], wait_s=20, grace_s=10.0)
    for t in threads:
        t.join(timeout=60)
    assert not isinstance(out[a.id], Exception) and not isinstance(out[b.id], Exception), out
    assert torch.equal(out[a.id][0], mc[0]) and torch.equal(out[b.id][0], mc[0])
    assert mc[1].contributors == {0: 3, 1: 3, 2: 3} and not out[a.id][1].dropped


def test_an_owner_the_round_went_on_without_never_commits_its_own_result(members: list[Member]) -> None:
    """c stalls; a and b take over its shard and commit step 1. When c finally reduces its shard,
    its backup is already at step 2: c must recover, not apply a result for its shard that differs
    from the one a and b applied (split brain)."""
    a, b, c = members
    deltas = random_deltas(members, seed=7)
    done = run_all(members, deltas, wait_s=1, skip={c.id})
    assert torch.equal(done[a.id][0], done[b.id][0]) and c.id in done[a.id][1].dropped
    for m in (a, b):
        m.ar.expect(2, "n" * 32)
    with pytest.raises(IncompleteRound, match="went past it"):
        c.ar.run(round_for(members, c), deltas[c.id], wait_s=1, grace_s=1.0)


def test_a_step_nobody_contributed_to_never_commits(members: list[Member]) -> None:
    """All replicas stalled (a dead pipeline stage): the average of nothing is zeros, which the outer
    momentum would still turn into a step. No member may commit it."""
    out = run_all(members, {m.id: None for m in members}, wait_s=0.5)  # (nothing comes, however long it waits)
    assert all(isinstance(out[m.id], IncompleteRound) and "nothing to average" in str(out[m.id]) for m in members), out


class Frozen(Member):
    """A member whose process froze (SIGSTOP): connections open, nothing answered."""

    def __init__(self) -> None:
        super().__init__()
        self.thaw = threading.Event()

    def ping(self, request: pb.PingRequest) -> pb.PingReply:
        self.thaw.wait(30)
        return super().ping(request)

    def push_contribution(self, chunks):  # type: ignore[no-untyped-def]
        self.thaw.wait(30)
        return super().push_contribution(chunks)

    def push_result(self, chunks):  # type: ignore[no-untyped-def]
        self.thaw.wait(30)
        return super().push_result(chunks)


def test_a_frozen_backup_does_not_get_its_partner_dropped() -> None:
    """The member after b in the ring (b's backup) freezes after contributing. b must hand its result
    to the next member instead of waiting on the frozen one, or a gives up on b's shard and drops b."""
    ms: list[Member] = [Member(), Member(), Frozen()]
    try:
        order = sorted(ms, key=lambda m: m.id)
        frozen = ms[2]
        owner = order[(order.index(frozen) - 1) % 3]  # the member whose backup is the frozen one
        deltas = random_deltas(ms, seed=11)
        out = run_all(ms, deltas, wait_s=3)  # the frozen one's own run sends its contributions, then waits
        live = [m for m in ms if m is not frozen]
        assert all(not isinstance(out[m.id], Exception) for m in live), out
        (m0, s0), (m1, s1) = out[live[0].id], out[live[1].id]
        assert torch.equal(m0, m1)
        assert owner.id not in s0.dropped + s1.dropped and frozen.id in s0.dropped + s1.dropped
        assert s0.contributors[order.index(owner)] == 3  # the frozen member's contribution was in time
    finally:
        ms[2].thaw.set()
        for m in ms:
            m.close()


def test_stopping_interrupts_the_wait(members: list[Member]) -> None:
    a, b, c = members
    a.ar.stopping.set()
    with pytest.raises(IncompleteRound, match="stopping"):
        a.ar.run(round_for(members, a), torch.zeros(NUMEL), wait_s=30)


# ----------------------------------------------------------------------------- bad input


def chunks_for(target: Member, sender: str, identity: Identity | None = None, **over) -> list[pb.ShardChunk]:  # type: ignore[no-untyped-def]
    """A contribution as ``sender`` would send it, signed with ``identity`` (unsigned without one)."""
    out = list(_chunks_for(target, sender, **over))
    return signed(out, identity) if identity is not None else out


def _chunks_for(target: Member, sender: str, **over) -> Iterator[pb.ShardChunk]:  # type: ignore[no-untyped-def]
    shard = over.pop("shard", 0)
    num_shards = over.pop("num_shards", 3)
    lo, hi = shard_bounds(NUMEL, 3, BLOCK)[shard]
    values = over.pop("values", torch.randn(hi - lo) * 0.01)
    run_id, step, base = over.pop("run_id", RUN), over.pop("step", 1), over.pop("base_hash", BASE)
    epoch = over.pop("epoch", 0)
    tensor_over = over.pop("tensor", {})
    for t in encode_chunks(f"shard{shard}", values, Int8BlockCodec(BLOCK), 1 << 20):
        for k, v in tensor_over.items():
            if k == "shape":
                t.shape[:] = v
            elif callable(v):
                setattr(t, k, v(getattr(t, k)))
            else:
                setattr(t, k, v)
        yield pb.ShardChunk(header=pb.Header(run_id=run_id, sender=sender, step=step, epoch=epoch), shard=shard,
                            num_shards=num_shards, base_hash=base, tensor=t)


def NAN_SCALES(scales: bytes) -> bytes:  # noqa: N802 (used like a constant in the table below)
    return np.full(len(scales) // 4, np.nan, np.float32).tobytes()


@pytest.mark.parametrize(
    "over,refusal,match",
    [
        ({"run_id": "other-run"}, pb.UNKNOWN_RUN, "unknown run id"),
        ({"step": 7}, pb.WRONG_STEP, "step 7"),
        ({"epoch": 3}, pb.WRONG_EPOCH, "epoch 3"),
        ({"base_hash": "c" * 32}, pb.BASE_MISMATCH, "base hash mismatch"),
        ({"sender": "stranger"}, pb.NOT_A_MEMBER, "not a member"),
        ({"num_shards": 4}, pb.BAD_MESSAGE, "num_shards"),
        ({"tensor": {"shape": [5]}}, pb.BAD_MESSAGE, "shape"),
        ({"tensor": {"dtype": "float16"}}, pb.BAD_MESSAGE, "dtype"),
        ({"tensor": {"scales": NAN_SCALES}}, pb.BAD_MESSAGE, "finite"),
        ({"tensor": {"payload": b"\x01\x02"}}, pb.BAD_MESSAGE, "payload"),
        ({"tensor": {"codec": "raw"}}, pb.BAD_MESSAGE, "codec"),
        ({"shard": 1}, pb.NOT_OWNER, "not owned"),
        ({"unsigned": True}, pb.BAD_IDENTITY, "not signed by it"),
        ({"forged": True}, pb.BAD_IDENTITY, "not signed by it"),
    ],
)
def test_bad_contribution_is_rejected_and_changes_nothing(members: list[Member], over, refusal, match) -> None:  # type: ignore[no-untyped-def]
    order = sorted(members, key=lambda m: m.id)
    target, sender = order[0], order[1]
    target.ar.inbox.set_round(round_for(members, target))
    sender_id = over.pop("sender", sender.id)
    identity = sender.identity
    if sender_id == "stranger":
        identity = Identity.generate()
        sender_id = identity.peer_id
    unsigned = over.pop("unsigned", False)
    if over.pop("forged", False):
        identity = Identity.generate()  # another key signs it
    chunks = chunks_for(target, sender_id, None if unsigned else identity, **over)
    with pytest.raises(grpc.RpcError) as err:
        sender.client.push_contribution(target.address, iter(chunks), timeout=5)
    info = refusal_of(err.value)  # the protocol's reason, and the gRPC status documented for it
    assert info is not None and info.code == refusal and err.value.code() == STATUS_OF[refusal]
    assert match in err.value.details()
    if refusal == pb.WRONG_STEP:
        assert info.at_step == 1  # the sender learns where the receiver is
    assert target.ar.inbox.pending_contributions() == 0
    assert target.traffic.rejected  # counted for the status page


def test_nan_values_never_leave_a_member(members: list[Member]) -> None:
    bad = torch.zeros(NUMEL)
    bad[5] = float("nan")
    a = members[0]
    with pytest.raises(Exception, match="NaN"):
        list(encode_chunks("x", bad, Int8BlockCodec(BLOCK), 1 << 20))
    assert a.ar.inbox.pending_contributions() == 0


def test_malformed_bytes_are_rejected(members: list[Member]) -> None:
    target = members[0]
    channel = grpc.insecure_channel(target.address)
    call = channel.stream_unary("/potluck.v1.PeerService/PushContribution",
                                request_serializer=lambda b: b, response_deserializer=pb.Ack.FromString)
    with pytest.raises(grpc.RpcError) as err:
        call(iter([b"\xff\xff\xff not a protobuf"]), timeout=5)
    assert err.value.code() != grpc.StatusCode.OK
    assert target.ar.inbox.pending_contributions() == 0
    channel.close()


def forged_result(target: Member, author: Member, shard: int, attempt: int = 0, tamper: bool = False,
                  signer: str | None = None) -> Iterator[pb.ShardChunk]:
    """A result for ``shard`` as ``author`` would send it, signed with ``author``'s key."""
    lo, hi = shard_bounds(NUMEL, 3, BLOCK)[shard]
    tensors = list(encode_chunks(f"shard{shard}", torch.full((hi - lo,), 0.5), Int8BlockCodec(BLOCK), 4096))
    contributors = sorted(m.id for m in [target, author])
    digest = result_digest(RUN, 1, 0, shard, 3, attempt, BASE, contributors, [], [], map(tensor_digest, tensors))
    if tamper:
        tensors[0].payload = bytes(len(tensors[0].payload))
    outcome = Outcome(attempt, contributors, [], [], signer or author.id, author.identity.sign(digest))
    return result_stream(pb.Header(run_id=RUN, sender=author.id, step=1), shard, 3, BASE, tensors, outcome)


@pytest.mark.parametrize("case", ["not-the-owner", "tampered", "claims-the-owner"])
def test_a_forged_result_is_refused(members: list[Member], case: str) -> None:
    """Results carry their reducer's signature: a member cannot pass off its own numbers as another
    owner's shard, nor alter a result it forwards."""
    order = sorted(members, key=lambda m: m.id)
    target, author = order[0], order[1]
    target.ar.inbox.set_round(round_for(members, target))
    owner = order[2]  # shard 2 belongs to order[2]
    chunks = {"not-the-owner": lambda: forged_result(target, author, shard=2),
              "tampered": lambda: forged_result(target, owner, shard=2, tamper=True),
              "claims-the-owner": lambda: forged_result(target, author, shard=2, signer=owner.id)}[case]()
    with pytest.raises(grpc.RpcError) as err:
        author.client.push_result(target.address, chunks, timeout=5)
    assert refusal_of(err.value).code == pb.BAD_IDENTITY, err.value.details()
    assert target.ar.inbox.result_count() == 0
    ok = forged_result(target, owner, shard=2)  # the owner's own, signed result is taken, whoever delivers it
    author.client.push_result(target.address, ok, timeout=5)
    assert target.ar.inbox.result_count() == 1


def test_bad_result_is_rejected(members: list[Member]) -> None:
    order = sorted(members, key=lambda m: m.id)
    target, sender = order[0], order[1]
    target.ar.inbox.set_round(round_for(members, target))
    with pytest.raises(grpc.RpcError) as err:
        sender.client.push_result(target.address, chunks_for(target, sender.id, shard=1, tensor={"dtype": "int8"}), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and refusal_of(err.value).code == pb.BAD_MESSAGE
    assert target.ar.inbox.result_count() == 0
