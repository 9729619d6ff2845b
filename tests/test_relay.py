"""The relay (NAT traversal) on real gRPC servers with mutual TLS: calls of every kind reach a peer that
listens on no port, refusals come back as they would directly, and bad tunnels and calls are refused."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.certs import CertificateAuthority, TlsIdentity
from potluck.protos.net.identity import Identity
from potluck.protos.net.relay import RelayHub, relayed_address
from potluck.protos.net.transport import PeerClient, PeerServer, RelayedServer, Traffic
from potluck.protos.wire.refusals import Rejected, is_unreachable, refusal_of

RUN = "relay-test"


class Node:
    """An identity certified by the run's CA, with a client."""

    def __init__(self, ca: CertificateAuthority) -> None:
        identity = Identity.generate()
        self.id = identity.peer_id
        self.tls = TlsIdentity.generate()
        self.tls.adopt(ca.issue(self.id, self.tls.public_pem, 3600), ca.cert_pem, self.id)
        self.traffic = Traffic()
        self.client = PeerClient(self.traffic, tls=self.tls)

    def header(self) -> pb.Header:
        return pb.Header(run_id=RUN, sender=self.id)


class Handlers:
    """A relayed peer's handlers: echo who called and what arrived, refuse another run."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.received: list[int] = []

    def ping(self, request: pb.PingRequest) -> pb.PingReply:
        if request.header.run_id != RUN:
            raise Rejected(pb.UNKNOWN_RUN, f"unknown run id {request.header.run_id!r}")
        return pb.PingReply(peer_id=self.me, state="training", version=7, sent_at=request.sent_at)

    def push_contribution(self, chunks: Iterator[pb.ShardChunk]) -> pb.Ack:
        sizes = [len(c.tensor.payload) for c in chunks]
        self.received.extend(sizes)
        return pb.Ack(received_bytes=sum(sizes))

    def fetch_state(self, request: pb.StateRequest) -> Iterator[pb.StateChunk]:
        for k in range(5):
            yield pb.StateChunk(version=request.version, tensor=pb.Tensor(name=f"t{k}", payload=bytes(100_000)))


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[dict]:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca.key", RUN)
    coordinator, natted, caller = Node(ca), Node(ca), Node(ca)
    server = PeerServer(Handlers(coordinator.id), coordinator.traffic, host="127.0.0.1", port=0, tls=coordinator.tls,
                        relay=RelayHub(RUN))
    where = f"127.0.0.1:{server.port}"
    handlers = Handlers(natted.id)
    relayed = RelayedServer(handlers, natted.traffic, natted.client, where, coordinator.id, RUN, natted.id)
    assert relayed.tunnel.connected.wait(10), "the tunnel did not open"
    try:
        yield {"ca": ca, "coordinator": coordinator, "natted": natted, "caller": caller, "where": where,
               "server": server, "relayed": relayed, "handlers": handlers}
    finally:
        relayed.stop()
        server.stop(0.1)
        for node in (coordinator, natted, caller):
            node.client.close()


def test_calls_of_every_kind_reach_a_peer_that_listens_on_no_port(relay: dict) -> None:
    natted, caller, coordinator = relay["natted"], relay["caller"], relay["coordinator"]
    address = relay["relayed"].address
    assert address == relayed_address(relay["where"], coordinator.id)
    reply = caller.client.ping(address, pb.PingRequest(header=caller.header(), sent_at=1.5), 5, peer=natted.id)
    assert (reply.peer_id, reply.version, reply.sent_at) == (natted.id, 7, 1.5)  # unary, answered by the natted peer
    chunks = [pb.ShardChunk(header=caller.header(), tensor=pb.Tensor(payload=bytes(200_000))) for _ in range(40)]
    ack = caller.client.push_contribution(address, iter(chunks), 30, peer=natted.id)  # 8 MB: more than the window
    assert ack.received_bytes == 40 * 200_000 and relay["handlers"].received == [200_000] * 40
    got = list(caller.client.fetch_state(address, pb.StateRequest(header=caller.header(), version=3), 10, peer=natted.id))
    assert [c.tensor.name for c in got] == [f"t{k}" for k in range(5)] and all(c.version == 3 for c in got)
    # what relaying costs shows on both sides
    assert relay["coordinator"].traffic.snapshot()[0]["relay"] > 8_000_000
    assert natted.traffic.snapshot()[1]["relay"] > 8_000_000


def test_concurrent_calls_share_the_tunnel(relay: dict) -> None:
    natted, caller = relay["natted"], relay["caller"]
    address = relay["relayed"].address
    errors: list[Exception] = []

    def ping(k: int) -> None:
        try:
            reply = caller.client.ping(address, pb.PingRequest(header=caller.header(), sent_at=k), 10, peer=natted.id)
            assert reply.sent_at == k
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=ping, args=(k,)) for k in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_a_refusal_comes_back_as_if_the_call_were_direct(relay: dict) -> None:
    natted, caller = relay["natted"], relay["caller"]
    with pytest.raises(grpc.RpcError) as err:
        caller.client.ping(relay["relayed"].address, pb.PingRequest(header=pb.Header(run_id="other", sender=caller.id)),
                           5, peer=natted.id)
    info = refusal_of(err.value)
    assert info is not None and info.code == pb.UNKNOWN_RUN
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_the_relayed_peer_checks_the_caller_the_relay_vouches_for(relay: dict) -> None:
    """A caller cannot claim to be someone else through the relay: the relay names who it authenticated."""
    natted, caller, coordinator = relay["natted"], relay["caller"], relay["coordinator"]
    forged = pb.PingRequest(header=pb.Header(run_id=RUN, sender=coordinator.id))
    with pytest.raises(grpc.RpcError) as err:
        caller.client.ping(relay["relayed"].address, forged, 5, peer=natted.id)
    info = refusal_of(err.value)
    assert info is not None and info.code == pb.BAD_IDENTITY


def test_a_peer_with_no_tunnel_is_unreachable(relay: dict) -> None:
    caller, coordinator = relay["caller"], relay["coordinator"]
    gone = Identity.generate().peer_id
    address = relayed_address(relay["where"], coordinator.id)
    with pytest.raises(grpc.RpcError) as err:
        caller.client.ping(address, pb.PingRequest(header=caller.header()), 5, peer=gone)
    assert is_unreachable(err.value)  # the all-reduce treats it as gone, not as slow


def test_a_tunnel_must_be_opened_by_the_peer_it_names(relay: dict) -> None:
    caller, coordinator = relay["caller"], relay["coordinator"]
    for hello in (pb.RelayFrame(header=pb.Header(run_id=RUN, sender=relay["natted"].id)),  # someone else's
                  pb.RelayFrame(header=pb.Header(run_id="other", sender=caller.id)),  # another run
                  pb.RelayFrame(call=5, header=pb.Header(run_id=RUN, sender=caller.id))):  # not a hello
        frames = caller.client.open_relay(relay["where"], coordinator.id, iter([hello]))
        with pytest.raises(grpc.RpcError) as err:
            list(frames)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # the real tunnel is untouched
    reply = caller.client.ping(relay["relayed"].address, pb.PingRequest(header=caller.header()), 5,
                               peer=relay["natted"].id)
    assert reply.peer_id == relay["natted"].id


def test_a_peer_server_relays_nothing_unless_asked(tmp_path: Path) -> None:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca.key", RUN)
    plain, caller = Node(ca), Node(ca)
    server = PeerServer(Handlers(plain.id), plain.traffic, host="127.0.0.1", port=0, tls=plain.tls)
    try:
        frames = caller.client.open_relay(f"127.0.0.1:{server.port}", plain.id,
                                          iter([pb.RelayFrame(header=caller.header())]))
        with pytest.raises(grpc.RpcError) as err:
            list(frames)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(0.1)
        plain.client.close()
        caller.client.close()


def test_the_tunnel_reopens_after_the_relay_restarts(relay: dict) -> None:
    natted, caller, coordinator = relay["natted"], relay["caller"], relay["coordinator"]
    port = relay["server"].port
    relay["server"].stop(0.1)
    relayed = relay["relayed"]
    assert not relayed.tunnel.connected.wait(0.01) or True  # it notices when the stream breaks
    server = PeerServer(Handlers(coordinator.id), coordinator.traffic, host="127.0.0.1", port=port,
                        tls=coordinator.tls, relay=RelayHub(RUN))
    relay["server"] = server
    from potluck.local import wait_for

    def answers() -> bool:
        try:
            caller.client.ping(relayed.address, pb.PingRequest(header=caller.header()), 2, peer=natted.id)
            return True
        except grpc.RpcError:
            return False

    wait_for(answers, 30, "the relayed peer to answer through the restarted relay", poll=0.2)
