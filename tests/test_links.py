"""The emulated network and the link prober, over real gRPC servers in one process.

Two regions 40 ms and 50 Mbps apart (1 ms and 1 Gbps inside each): what the prober measures must
be what the emulator plays, concurrent transfers must share a link, streams must stay pipelined,
probing must stay within its budget, and link reports must travel the DHT signed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from potluck.peer.swarm.links import Bursts, LinkConfig, LinkProber, LinkReport, LinkStat
from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.dhtguard import run_key
from potluck.protos.net.identity import Identity
from potluck.protos.net.swarm import SwarmNode
from potluck.protos.net.transport import PeerClient, PeerServer, Traffic
from potluck.protos.testkit import netem
from potluck.protos.testkit.netem import NetEm, NetemTopology, NetemTopologyError
from potluck.protos.wire.envelope import seal
from potluck.protos.wire.refusals import Rejected

DELAY_MS, MBPS = 40.0, 50.0
BYTES_PER_S = MBPS * 1e6 / 8
TOPOLOGY = {
    "regions": ["eu", "us"],
    "delay_ms": [[1, DELAY_MS], [DELAY_MS, 1]],
    "bandwidth_mbps": {"eu": {"eu": 1000, "us": MBPS}, "us": {"us": 1000}},  # us -> eu falls back to eu -> us
}


class Peer:
    """Answers Ping like the daemon does; streams for the pipelining checks."""

    def ping(self, request: pb.PingRequest) -> pb.PingReply:
        padding = b"\0" * max(0, min(request.reply_bytes, 4 << 20))
        return pb.PingReply(peer_id="p", state="training", sent_at=request.sent_at, padding=padding)

    def push_contribution(self, chunks: Iterator[pb.ShardChunk]) -> pb.Ack:
        n = 0
        for c in chunks:
            if c.header.run_id != "r":
                raise Rejected(pb.UNKNOWN_RUN, "wrong run")
            n += c.ByteSize()
        return pb.Ack(received_bytes=n)

    def fetch_state(self, request: pb.StateRequest) -> Iterator[pb.StateChunk]:
        for r in request.ranges:
            yield pb.StateChunk(version=1, tensor=pb.Tensor(name=r.name, payload=b"\0" * r.numel))


@pytest.fixture(scope="module")
def net() -> Iterator[dict]:
    topo = NetemTopology.from_dict(TOPOLOGY)
    servers = {name: PeerServer(Peer(), Traffic(), host="127.0.0.1", netem=NetEm(topo, region))
               for name, region in (("us", "us"), ("eu", "eu"))}
    client = PeerClient(Traffic(), netem=NetEm(topo, "eu"))
    yield {"client": client, "topo": topo, **{k: f"127.0.0.1:{s.port}" for k, s in servers.items()}}
    client.close()
    for s in servers.values():
        s.stop(0.1)


def timed(fn, *args) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def test_prober_measures_what_the_emulator_plays(net: dict) -> None:
    prober = LinkProber(net["client"], "me", "r", LinkConfig(probe_bytes=512 << 10, budget_bytes_per_min=4 << 20))
    far, near = prober.probe("us", net["us"]), prober.probe("eu", net["eu"])
    assert far is not None and near is not None
    print(f"\nemulated rtt {2 * DELAY_MS:.0f} ms, {MBPS:.0f} Mbps; measured rtt {far.rtt_ms:.1f} ms, "
          f"{far.bandwidth_mbps:.1f} Mbps; in-region rtt {near.rtt_ms:.1f} ms, {near.bandwidth_mbps:.0f} Mbps")
    # never faster than the emulated link; slower by what a loaded box adds (the suite runs this beside a swarm)
    assert 0.9 * 2 * DELAY_MS <= far.rtt_ms <= 1.5 * 2 * DELAY_MS
    assert 0.6 * MBPS <= far.bandwidth_mbps <= 1.1 * MBPS
    # in region nothing is emulated: loopback with TLS, bound by this box's CPU (441-554 Mbps alone, 175 Mbps once
    # under the quick tier's load, which failed a bound of 4x); what it shows is that the emulated 50 Mbps is not applied
    assert near.rtt_ms < 20 and near.bandwidth_mbps > 2 * MBPS


def test_streams_are_pipelined_not_delayed_per_message(net: dict) -> None:
    client, header = net["client"], pb.Header(run_id="r")
    chunks = [pb.ShardChunk(header=header, tensor=pb.Tensor(payload=b"\0" * (128 << 10))) for _ in range(8)]
    pushed = sum(c.ByteSize() for c in chunks)
    push_s = timed(client.push_contribution, net["us"], iter(chunks), 30.0)
    request = pb.StateRequest(ranges=[pb.Range(name=f"t{i}", numel=128 << 10) for i in range(8)])
    fetched = 0

    def fetch() -> None:
        nonlocal fetched
        fetched = sum(m.ByteSize() for m in client.fetch_state(net["us"], request, 30.0))

    fetch_s = timed(fetch)
    # one round trip plus the bytes at link rate; a delay per chunk would add 8 x 40 ms, of which the bound allows
    # half, for what a loaded box adds (the suite runs this beside a swarm)
    for took, nbytes in ((push_s, pushed), (fetch_s, fetched)):
        piped = 2 * DELAY_MS / 1e3 + nbytes / BYTES_PER_S
        assert 0.9 * piped <= took < piped + 4 * DELAY_MS / 1e3, (took, piped)


FAR_S = 0.5  # one way: long enough that a message's place on the link lost for part of a delay shows above a loaded box


@pytest.fixture(scope="module")
def far() -> Iterator[dict]:
    topo = NetemTopology.from_dict({"regions": ["a", "b"], "delay_ms": [[1, FAR_S * 1e3], [FAR_S * 1e3, 1]],
                                    "bandwidth_mbps": [[1000, 1000], [1000, 1000]]})
    server = PeerServer(Peer(), Traffic(), host="127.0.0.1", netem=NetEm(topo, "b"))
    client = PeerClient(Traffic(), netem=NetEm(topo, "a"))
    client.ping(f"127.0.0.1:{server.port}", pb.PingRequest(), 30.0)  # (the channel and its TLS handshake, once)
    yield {"client": client, "b": f"127.0.0.1:{server.port}"}
    client.close()
    server.stop(0.1)


@pytest.mark.parametrize("direction", ["request stream", "reply stream"])
def test_a_streams_next_message_keeps_its_place_on_the_link(far: dict, direction: str) -> None:
    """A stream of two small messages, and another call on the same link that starts while the first message is
    in propagation: the stream's second message was ready first, so it goes first and the stream takes one round
    trip. (The emulator used to book a message's transmission only once the one before it had *arrived*: the other
    call took its place, and the stream ended 0.8 of a delay late; in the WAN benchmark's pipelines that was 40-50 ms
    of every step's first micro-batch, each way.)"""
    client, header = far["client"], pb.Header(run_id="r")
    took: list[float] = []

    def stream() -> None:
        start = time.perf_counter()
        if direction == "request stream":
            client.push_contribution(far["b"], iter([pb.ShardChunk(header=header)] * 2), 30.0)
        else:
            list(client.fetch_state(far["b"], pb.StateRequest(ranges=[pb.Range(name="t", numel=8)] * 2), 30.0))
        took.append(time.perf_counter() - start)

    thread = threading.Thread(target=stream)
    thread.start()
    time.sleep(0.8 * FAR_S)  # the other call: its message is ready after the stream's second one
    client.ping(far["b"], pb.PingRequest(), 30.0)
    thread.join(30)
    assert took, "the stream did not end"
    # one round trip: its second message sent right behind the first; the old booking took 2.8 delays
    assert 0.9 * 2 * FAR_S <= took[0] < 2.4 * FAR_S, took


def test_a_streams_window_is_bytes_not_messages(far: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream holds a window of bytes in flight, as TCP does: 256 small messages go in one round trip (a window of
    64 messages, as the emulator once had, made them pay four delays); a stream of 4x the window goes a window at a
    time. (Each message costs some CPU too: 1,000 of them took 0.3 s more than one round trip on this box.)"""
    client, header = far["client"], pb.Header(run_id="r")
    small = [pb.ShardChunk(header=header, tensor=pb.Tensor(payload=b"\0" * 64)) for _ in range(256)]
    took = timed(client.push_contribution, far["b"], iter(small), 30.0)
    assert 0.9 * 2 * FAR_S <= took < 3 * FAR_S, took
    piece = 16 << 10
    monkeypatch.setattr(netem, "_WINDOW_BYTES", 4 * piece + 1024)  # four pieces and their headers
    big = [pb.ShardChunk(header=header, tensor=pb.Tensor(payload=b"\0" * piece)) for _ in range(16)]
    took = timed(client.push_contribution, far["b"], iter(big), 30.0)
    # four windows, each a delay, then the acknowledgement's way back
    assert 0.9 * 5 * FAR_S <= took < 5.4 * FAR_S, took


def test_concurrent_transfers_share_the_link(net: dict) -> None:
    # 3 MB is half a second on the emulated link, so that a thread that starts late under load (a CI run's
    # started 0.1 s apart beside a swarm) moves the end times by much less than a FIFO without sharing would
    client, size = net["client"], 3 << 20
    request = pb.PingRequest(padding=b"\0" * size)
    alone = timed(client.ping, net["us"], request, 30.0)
    spans: list[tuple[float, float]] = []
    barrier = threading.Barrier(2)

    def one() -> None:
        barrier.wait(30)
        start = time.perf_counter()
        client.ping(net["us"], request, 30.0)
        spans.append((start, time.perf_counter()))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(spans) == 2
    (start_a, end_a), (start_b, end_b) = sorted(spans)
    rtt, wire = 2 * DELAY_MS / 1e3, size / BYTES_PER_S
    # the emulator's floor, and room above it for a loaded box (the suite runs this beside a swarm: one transfer
    # alone once took 0.77 s there against 0.58 s of link)
    assert 0.9 * (rtt + wire) <= alone < 2 * (rtt + wire), (alone, rtt + wire)
    # the link's rate is shared, not doubled: the two together took at least as long as twice the bytes (doubled,
    # they would take rtt + wire), and about one more transfer's time than one alone
    pair = max(end_a, end_b) - start_a
    assert 0.9 * (rtt + 2 * wire) <= pair < alone + 2 * wire, (pair, alone, rtt + 2 * wire)
    # fair sharing: a FIFO pipe would end the two a whole transfer (`wire`) apart; shared slice by slice they end
    # as far apart as they started
    print(f"\nstarted {start_b - start_a:.3f} s apart, ended {abs(end_b - end_a):.3f} s apart; one alone {wire:.3f} s")
    assert abs(end_b - end_a) < wire / 2


def test_errors_cross_the_link_and_keep_their_status(net: dict) -> None:
    bad = [pb.ShardChunk(header=pb.Header(run_id="other"))]
    start = time.perf_counter()
    with pytest.raises(grpc.RpcError) as err:
        net["client"].push_contribution(net["us"], iter(bad), 10.0)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "wrong run" in err.value.details()
    assert time.perf_counter() - start >= 2 * DELAY_MS / 1e3 * 0.9


def test_untagged_clients_are_not_emulated(net: dict) -> None:
    plain = PeerClient(Traffic())
    try:
        plain.ping(net["us"], pb.PingRequest(), 5.0)  # warm the channel
        assert timed(plain.ping, net["us"], pb.PingRequest(), 5.0) < DELAY_MS / 1e3
    finally:
        plain.close()


@pytest.mark.parametrize("change, match", [
    ({"regions": ["eu", "eu"]}, "duplicate region"),
    ({"delay_ms": [[1, 40], [40]]}, r"2x2 matrix"),
    ({"delay_ms": [[1, 40, 3], [40, 1, 3]]}, r"2x2 matrix"),
    ({"delay_ms": [[1, -5], [40, 1]]}, r"delay_ms\[eu\]\[us\] = -5; delays must be >= 0"),
    ({"bandwidth_mbps": [[1000, 0], [50, 1000]]}, r"bandwidth_mbps\[eu\]\[us\] = 0; bandwidth must be > 0"),
    ({"bandwidth_mbps": {"eu": {"eu": 1, "us": -1}, "us": {"us": 1}}}, "bandwidth must be > 0"),
    ({"bandwidth_mbps": {"eu": {"eu": 1, "asia": 5}, "us": {"us": 1}}}, "unknown region 'asia'"),
    ({"bandwidth_mbps": {"eu": {"eu": 1}, "us": {"us": 1}}}, "no value for eu -> us"),
    ({"delay_ms": [[1, "x"], [40, 1]]}, "not a finite number"),
    ({"peers": {"peer-0": "mars"}}, "peer 'peer-0' is placed in unknown region 'mars'"),
    ({"delay_ms": None}, "must be a matrix or a dict"),
])
def test_bad_topologies_are_rejected_with_the_reason(change: dict, match: str) -> None:
    with pytest.raises(NetemTopologyError, match=match):
        NetemTopology.from_dict({**TOPOLOGY, **change}, source="topo.json")


def test_topology_file_and_region_choice(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "topo.json"
    path.write_text(json.dumps({**TOPOLOGY, "peers": {"peer-1": "us", "2": "eu"}}))
    assert NetEm.from_file(path, region="eu").region == "eu"
    assert NetEm.from_file(path, peer="peer-1").region == "us"
    assert NetEm.from_file(path, peer=2).region == "eu"
    assert NetemTopology.from_file(path).link("us", "eu") == (DELAY_MS / 1e3, BYTES_PER_S)
    with pytest.raises(NetemTopologyError, match="unknown region 'asia'"):
        NetEm.from_file(path, region="asia")
    with pytest.raises(NetemTopologyError, match="peer 'peer-9' is not in its 'peers' map"):
        NetEm.from_file(path, peer="peer-9")
    with pytest.raises(NetemTopologyError, match="cannot read topology file"):
        NetEm.from_file(tmp_path / "missing.json", region="eu")
    path.write_text("{not json")
    with pytest.raises(NetemTopologyError, match="not valid JSON"):
        NetEm.from_file(path, region="eu")


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def plain_peer() -> Iterator[str]:
    server = PeerServer(Peer(), Traffic(), host="127.0.0.1")
    yield f"127.0.0.1:{server.port}"
    server.stop(0.1)


def test_probing_stays_within_its_byte_budget(plain_peer: str) -> None:
    traffic, clock = Traffic(), FakeClock()
    cfg = LinkConfig(probe_bytes=64 << 10, budget_bytes_per_min=150 << 10, stale_s=5, retry_s=5)
    prober = LinkProber(PeerClient(traffic), "me", "r", cfg, clock=clock)

    def probe_bytes() -> int:
        sent, received = traffic.snapshot()
        return sent.get("probe", 0) + received.get("probe", 0)

    for _ in range(4):  # every probe is due (stale), but only two bandwidth probes fit in a minute
        assert prober.probe("a", plain_peer) is not None
        clock.t += 6
    assert probe_bytes() <= cfg.budget_bytes_per_min
    assert (64 << 10) * 2 < probe_bytes() < (64 << 10) * 3
    clock.t += 60  # the minute has passed: the budget is back
    before = probe_bytes()
    prober.probe("a", plain_peer)
    assert probe_bytes() - before > 64 << 10


def test_each_round_probes_at_most_k_peers_unmeasured_first(plain_peer: str) -> None:
    clock = FakeClock()
    cfg = LinkConfig(max_probes_per_period=3, period_s=10, pings=1, probe_bytes=1 << 10, stale_s=100)
    prober = LinkProber(PeerClient(Traffic()), "me", "r", cfg, clock=clock)
    peers = {f"p{i}": plain_peer for i in range(7)} | {"me": plain_peer}
    first = prober.probe_round(peers)
    assert len(first) == 3 and "me" not in first
    assert prober.probe_round(peers) == []  # same period: the allowance is spent
    clock.t += 10
    second = prober.probe_round(peers)
    assert len(second) == 3 and not set(first) & set(second)
    clock.t += 10
    assert len(prober.probe_round(peers)) == 1  # the last unmeasured one; the others are fresh
    clock.t += 10
    assert prober.probe_round(peers) == []
    clock.t += 100
    assert set(prober.probe_round(peers)) == set(first)  # stalest first: measured longest ago
    assert set(prober.report().links) == set(peers) - {"me"}


def test_observed_transfers_refresh_bandwidth() -> None:
    prober = LinkProber(PeerClient(Traffic()), "me", "r", LinkConfig(ewma=0.5))
    prober.observe("q", 1000, 0.1)  # too small to say anything about bandwidth
    assert prober.get("q") is None
    prober.observe("q", 1 << 20, 8 * (1 << 20) / 100e6)  # 100 Mbps
    prober.observe("q", 1 << 20, 8 * (1 << 20) / 50e6)  # 50 Mbps
    stat = prober.get("q")
    assert stat is not None and stat.bandwidth_mbps == pytest.approx(75) and stat.samples == 2


def test_link_reports_travel_the_dht_signed() -> None:
    a_id, b_id, mallory = Identity.generate(), Identity.generate(), Identity.generate()
    a = SwarmNode(a_id, coordinator=a_id.peer_id, host="127.0.0.1")
    b = SwarmNode(b_id, coordinator=a_id.peer_id, initial_peers=a.maddrs, host="127.0.0.1")
    try:
        report = LinkReport(peer_id=a_id.peer_id, ts=time.time(), seq=1,
                            links={b_id.peer_id: LinkStat(rtt_ms=80.0, bandwidth_mbps=50.0, samples=3, ts=time.time())})
        assert a.publish_links(report, ttl=60)
        with pytest.raises(ValueError, match="cannot be published"):
            b.publish_links(report, ttl=60)
        # mallory claims to be a peer and signs with her own key; and an unsigned value: no node keeps them
        forged = LinkReport(peer_id=b_id.peer_id, links={a_id.peer_id: LinkStat(rtt_ms=1.0, bandwidth_mbps=1e5)})
        key = run_key(a_id.peer_id, "links")
        assert not b.dht.store(key, seal(mallory, forged, 60), expiration_time=_expire(60), subkey=b_id.peer_id)
        assert not b.dht.store(key, "not signed", expiration_time=_expire(60), subkey=mallory.peer_id)
        reports, refused = b.get_links()
        assert set(reports) == {a_id.peer_id} and not refused
        assert reports[a_id.peer_id].links[b_id.peer_id].bandwidth_mbps == 50.0
        _, refused = b.get_links(min_seq={a_id.peer_id: 2})
        assert any("stale LinkReport" in r for r in refused)
    finally:
        b.shutdown()
        a.shutdown()


def _expire(ttl: float) -> float:
    from hivemind.utils import get_dht_time

    return get_dht_time() + ttl


def test_overlapping_transfers_are_observed_as_one_burst() -> None:
    """Pushes that share a link each take longer than the link needs: a burst reports all its bytes over
    its span (less the longest receiver hold), once; a lone transfer is a burst of one; a failed one alone
    reports nothing."""
    now = [0.0]
    seen: list[tuple[str, int, float]] = []
    bursts = Bursts(lambda peer, n, s: seen.append((peer, n, s)), clock=lambda: now[0])
    bursts.start("a")
    now[0] = 0.1
    bursts.start("a")
    bursts.start("b")
    now[0] = 1.0
    bursts.end("a", 1_000_000)
    bursts.end("b", 0)  # failed: nothing delivered, nothing observed
    assert seen == []
    now[0] = 2.0
    bursts.end("a", 1_000_000, held_s=0.2)
    assert seen == [("a", 2_000_000, pytest.approx(1.8))]
    now[0] = 3.0
    bursts.start("a")
    now[0] = 3.5
    bursts.end("a", 500_000)
    assert seen[1:] == [("a", 500_000, pytest.approx(0.5))]
