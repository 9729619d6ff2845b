"""Fuzzing every RPC of a peer with random and mutated protobuf messages (hypothesis).

A peer's real gRPC facade (:class:`potluck.peer.service.PeerService`) runs over a real server with
its real rooms behind it: an all-reduce expecting step 1 with three members, committed state served,
and a pipeline stage waiting for its neighbour. Whatever arrives, the server must answer (or refuse)
without a handler crash (gRPC's INTERNAL), stay up, and change nothing: no contribution or result
kept, the served state the same, no pipeline message queued.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from signing import signed

from potluck.compression.int8 import Int8BlockCodec
from potluck.compression.stream import encode_chunks
from potluck.compression.transfer import SnapshotServer
from potluck.peer.outer.diloco import outer_snapshot
from potluck.peer.pipeline.pipeline import Neighbour, Pipeline
from potluck.peer.pipeline.pipewire import outbound
from potluck.peer.reduce.allreduce import AllReduce, MemberAddr, RoundInfo, shard_bounds
from potluck.peer.service import PeerService
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.identity import Identity
from potluck.protos.net.transport import PeerClient, PeerServer, Traffic

RUN, NUMEL, BASE = "fuzz", 1024, "b" * 32
KEYS = [Identity.generate() for _ in range(3)]
MEMBERS = [k.peer_id for k in KEYS]
STRANGER = Identity.generate().peer_id
EXAMPLES = 320  # per RPC: 7 RPCs, over 2,000 cases in all
CASES = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


class FuzzedPeer:
    def __init__(self) -> None:
        me = MEMBERS[0]
        self.traffic = Traffic()
        self.client = PeerClient(Traffic())
        self.allreduce = AllReduce(run_id=RUN, me=me, numel=NUMEL, codec=Int8BlockCodec(256), client=self.client,
                                   chunk_bytes=4096, rpc_timeout=2.0, ping=lambda pid, t: pb.PingReply(state="training"))
        self.allreduce.expect(1, BASE)
        self.allreduce.inbox.set_round(RoundInfo(1, tuple(MemberAddr(m, "127.0.0.1:1") for m in MEMBERS), me, BASE))
        self.snap = outer_snapshot(torch.arange(NUMEL, dtype=torch.float32), torch.zeros(NUMEL), 3, {"stage": 1})
        self.states = SnapshotServer(RUN, 4096)
        self.states.publish(self.snap)
        cfg = apply_overrides(RunConfig(), {"model.d_model": 16, "model.n_heads": 2, "model.n_layers": 2,
                                            "model.seq_len": 8, "pipeline.stages": 2, "train.batch_size": 4,
                                            "pipeline.pipe_timeout_s": 0.2})
        self.pipeline = Pipeline(run_id=RUN, me=me, stage=1, stages=2, model=cfg.model, cfg=cfg.pipeline,
                                 client=self.client, num_samples=64)
        self.pipeline.begin_round(1, 0, Neighbour(MEMBERS[1], "127.0.0.1:1"), None)
        service = PeerService(RUN, lambda r: pb.PingReply(peer_id=me, sent_at=r.sent_at), lambda: self.allreduce,
                              lambda: self.states, lambda: self.pipeline)
        self.server = PeerServer(service, self.traffic, host="127.0.0.1", port=0, on_reject=lambda *a: None)
        self.address = f"127.0.0.1:{self.server.port}"
        self.channel = grpc.insecure_channel(self.address)

    def unchanged(self) -> bool:
        return (self.allreduce.inbox.pending_contributions() == 0 and self.allreduce.inbox.result_count() == 0
                and self.states.current is self.snap and not self.pipeline.inbox.current().mail)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0.1)
        self.allreduce.close()
        self.pipeline.close()


@pytest.fixture(scope="module")
def peer() -> Iterator[FuzzedPeer]:
    p = FuzzedPeer()
    yield p
    p.close()


text = st.one_of(st.sampled_from([RUN, "", BASE, STRANGER, *MEMBERS[1:], "forward", "int8", "float32", "x" * 300]),
                 st.text(max_size=40))
ints = st.one_of(st.integers(-3, 5), st.integers(-(2**62), 2**62))  # int64 fields
int32s = st.one_of(st.integers(-3, 5), st.integers(-(2**31), 2**31 - 1))
blobs = st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"\x00" * 4, b"\xff" * 1024]))
senders = st.sampled_from([STRANGER, "", "not-an-id"])  # never a member: even a well-formed message is refused

headers = st.builds(pb.Header, run_id=text, sender=senders, step=ints, epoch=ints)
tensors = st.builds(pb.Tensor, name=text, dtype=text, shape=st.lists(ints, max_size=4), codec=text, scales=blobs,
                    payload=blobs, offset=ints, numel=ints, bits=st.integers(-1, 40))
chunks = st.builds(pb.ShardChunk, header=headers, shard=st.integers(-2, 5), num_shards=st.integers(-2, 5),
                   attempt=st.integers(-1, 3), base_hash=text, contributors=st.lists(text, max_size=3),
                   tensor=tensors, clipped=st.lists(text, max_size=2), signer=text, signature=blobs)
packets = st.builds(pb.ActPacket, mode=text, bits=st.integers(-1, 40), shape=st.lists(ints, max_size=4), dtype=text,
                    scales=blobs, payload=blobs)
pipes = st.builds(pb.PipeMessage, header=headers, kind=st.one_of(st.sampled_from(["forward", "backward", "eval"]), text),
                  inner_step=ints, micro=int32s, sample_ids=st.lists(ints, max_size=5), labels=blobs,
                  label_shape=st.lists(ints, max_size=3), versions=st.lists(ints, max_size=5), first=packets,
                  delta=packets, loss=st.floats(allow_nan=True), stage=int32s, replica=int32s)


def call(peer: FuzzedPeer, method: str, request: object, stream: bool = False, response_stream: bool = False) -> None:
    """Send ``request`` (a message, a list of them, or raw bytes) and check the server's answer."""
    path = f"/potluck.v1.PeerService/{method}"

    def ser(m: object) -> bytes:
        return m if isinstance(m, bytes) else m.SerializeToString()  # type: ignore[attr-defined]

    kind = (peer.channel.stream_stream if stream and response_stream else peer.channel.stream_unary if stream
            else peer.channel.unary_stream if response_stream else peer.channel.unary_unary)
    rpc = kind(path, request_serializer=ser, response_deserializer=lambda b: b)
    try:
        out = rpc(iter(request) if stream else request, timeout=5)  # type: ignore[arg-type]
        if response_stream:
            list(out)
    except grpc.RpcError as err:
        assert err.code() != grpc.StatusCode.INTERNAL, f"{method} crashed a handler: {err.details()}"
    assert peer.unchanged(), f"{method} changed the peer's state"


def mutated(message: object, seed: int) -> bytes:
    """A valid message's bytes with a few flipped, cut or duplicated."""
    raw = bytearray(message.SerializeToString())  # type: ignore[attr-defined]
    rng = random.Random(seed)
    for _ in range(rng.randint(1, 4)):
        if raw and rng.random() < 0.6:
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        elif raw:
            i = rng.randrange(len(raw))
            raw = raw[:i] + raw[i:][: rng.randrange(len(raw) - i + 1)] * rng.randint(0, 2)
    return bytes(raw)


def valid_contribution(sender: str) -> list[pb.ShardChunk]:
    """Shard 0 (this peer's) of step 1 exactly as a member would send it (signed by a member's key)."""
    lo, hi = shard_bounds(NUMEL, len(MEMBERS), Int8BlockCodec(256).align)[0]
    chunks = [pb.ShardChunk(header=pb.Header(run_id=RUN, sender=sender, step=1), shard=0, num_shards=3,
                            base_hash=BASE, tensor=t)
              for t in encode_chunks("shard0", torch.randn(hi - lo), Int8BlockCodec(256), 4096)]
    key = next((k for k in KEYS if k.peer_id == sender), None)
    return signed(chunks, key) if key is not None else chunks


@pytest.mark.slow
@CASES
@given(st.builds(pb.PingRequest, header=headers, sent_at=st.floats(allow_nan=True), padding=blobs,
                 reply_bytes=st.integers(-(2**31), 2**31 - 1)))
def test_ping(peer: FuzzedPeer, request: pb.PingRequest) -> None:
    call(peer, "Ping", request)


@pytest.mark.slow
@CASES
@given(st.lists(chunks, min_size=0, max_size=3), st.integers(0, 2**32))
def test_push_contribution(peer: FuzzedPeer, stream: list[pb.ShardChunk], seed: int) -> None:
    call(peer, "PushContribution", stream, stream=True)
    call(peer, "PushContribution", [mutated(c, seed) for c in valid_contribution(STRANGER)], stream=True)


@pytest.mark.slow
@CASES
@given(st.lists(chunks, min_size=0, max_size=3), st.integers(0, 2**32))
def test_push_result(peer: FuzzedPeer, stream: list[pb.ShardChunk], seed: int) -> None:
    call(peer, "PushResult", stream, stream=True)
    call(peer, "PushResult", [mutated(c, seed) for c in valid_contribution(STRANGER)], stream=True)


@pytest.mark.slow
@CASES
@given(st.builds(pb.ResultRequest, header=headers, shard=int32s, num_shards=int32s))
def test_fetch_result(peer: FuzzedPeer, request: pb.ResultRequest) -> None:
    call(peer, "FetchResult", request, response_stream=True)


@pytest.mark.slow
@CASES
@given(st.builds(pb.InputsRequest, header=headers, shard=int32s, num_shards=int32s, attempt=int32s))
def test_fetch_inputs(peer: FuzzedPeer, request: pb.InputsRequest) -> None:
    call(peer, "FetchInputs", request, response_stream=True)


@pytest.mark.slow
@CASES
@given(st.builds(pb.StateInfoRequest, header=headers, stage=st.integers(-3, 3), version=st.one_of(st.none(), ints)))
def test_get_state_info(peer: FuzzedPeer, request: pb.StateInfoRequest) -> None:
    call(peer, "GetStateInfo", request)


@CASES
@given(st.builds(pb.StateRequest, header=headers, version=ints, stage=st.integers(-3, 3),
                 ranges=st.lists(st.builds(pb.Range, name=st.sampled_from(["theta", "momentum", "x", ""]),
                                           offset=ints, numel=ints), max_size=3)))
@pytest.mark.slow
def test_fetch_state(peer: FuzzedPeer, request: pb.StateRequest) -> None:
    call(peer, "FetchState", request, response_stream=True)


@pytest.mark.slow
@CASES
@given(pipes, st.lists(st.integers(-2, 1 << 40), max_size=6), st.integers(0, 2**32))
def test_push_pipe(peer: FuzzedPeer, message: pb.PipeMessage, sizes: list[int], seed: int) -> None:
    """A message's pieces as sent, its pieces mutated, and its head declaring any body sizes (up to a TB)."""
    chunks = list(outbound(message).chunks(64))
    call(peer, "PushPipe", chunks, stream=True)
    call(peer, "PushPipe", [mutated(c, seed + k) for k, c in enumerate(chunks[:4])], stream=True)
    call(peer, "PushPipe", [pb.PipeChunk(head=chunks[0].head, body_bytes=sizes), *chunks[1:]], stream=True)


def test_the_valid_contribution_the_mutations_start_from_is_accepted() -> None:
    """Else the mutated ones above would be refused for the wrong reason, and test nothing."""
    fresh = FuzzedPeer()
    try:
        PeerClient(Traffic()).push_contribution(fresh.address, iter(valid_contribution(MEMBERS[1])), 5)
        assert fresh.allreduce.inbox.pending_contributions() == 1
    finally:
        fresh.close()


def test_the_server_is_still_up_afterwards(peer: FuzzedPeer) -> None:
    reply = PeerClient(Traffic()).ping(peer.address, pb.PingRequest(header=pb.Header(run_id=RUN, sender=STRANGER)), 5)
    assert reply.peer_id == MEMBERS[0] and peer.unchanged()


def test_a_message_that_does_not_parse_is_refused_as_bad_message(peer: FuzzedPeer) -> None:
    from potluck.protos.wire.refusals import refusal_of

    rpc = peer.channel.unary_unary("/potluck.v1.PeerService/Ping", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as caught:
        rpc(b"\x0a\xff\xff\xff\xff\x0f", timeout=5)  # a length prefix far past the message's end
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = refusal_of(caught.value)
    assert info is not None and info.code == pb.BAD_MESSAGE and "malformed" in caught.value.details()


@pytest.mark.parametrize("scale", [3e38, float("inf"), float("nan"), 1e30])
def test_a_members_crafted_scale_is_refused_not_decoded_to_inf(peer: FuzzedPeer, scale: float) -> None:
    """int8 codes x a scale of 3e38 used to decode to Inf and end the receiving process on its re-encode:
    a member's (the sender is a member here) crafted contribution is refused as a bad message."""
    import struct

    from potluck.protos.wire.refusals import refusal_of

    good = valid_contribution(MEMBERS[1])
    crafted = [pb.ShardChunk() for _ in good]
    for c, g in zip(crafted, good, strict=True):
        c.CopyFrom(g)
        c.tensor.scales = struct.pack("<f", scale) * (len(g.tensor.scales) // 4)
    rpc = peer.channel.stream_unary("/potluck.v1.PeerService/PushContribution",
                                    request_serializer=lambda m: m.SerializeToString(), response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as caught:
        rpc(iter(crafted), timeout=5)
    info = refusal_of(caught.value)
    assert info is not None and info.code == pb.BAD_MESSAGE and "scale" in caught.value.details(), caught.value.details()
    assert peer.unchanged()
