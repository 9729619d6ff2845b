"""gRPC plumbing of a peer: the PeerService server, a client with channel reuse, byte accounting.

The transport knows nothing about training: the server hands each RPC to a :class:`Handlers`
object (the daemon), the client moves protobuf messages. What it adds is what every RPC needs the
same way: deliberate message size limits, counting every byte sent and received by kind (the
figures the logs, ``/metrics`` and the status page show), and turning a handler's
:class:`~potluck.protos.wire.refusals.Rejected` into a gRPC status with a clear reason, logged once on the
receiving side. How each call is checked is :mod:`potluck.protos.net.servicer`'s; what a refusal is,
:mod:`potluck.protos.wire.refusals`'.

With a :class:`~potluck.protos.net.certs.TlsIdentity`, both sides run mutual TLS with certificates
from the run's CA: the server learns who calls from the client certificate and refuses a message
whose ``header.sender`` says otherwise (or whose sender was evicted), and the client names the
peer id it means to reach, so a reply can only come from that key. Every client identity (a
certificate's peer id, else a remote host) may hold at most ``per_client`` calls at once, so an
idle or slow client cannot occupy the server's threads; connections are closed after an hour.

Given a :class:`~potluck.protos.testkit.netem.NetEm`, server and client also play an emulated wide-area
network (delay and bandwidth per region pair) through gRPC interceptors, so every RPC, present and
future, crosses it; without one no interceptor is installed.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from typing import Any

import grpc

from potluck.protos import potluck_pb2 as pb
from potluck.protos import potluck_pb2_grpc as pb_grpc
from potluck.protos.net.certs import TlsIdentity
from potluck.protos.net.errors import check_port_free, explain_bind_failure
from potluck.protos.net.relay import TARGET_KEY, RelayClient, RelayHub, relayed_address, split_address
from potluck.protos.net.servicer import Handlers, Servicer, counted, parser_for, rpc_handlers
from potluck.protos.runtime.log import get_logger, short_id
from potluck.protos.testkit.netem import NetEm
from potluck.protos.wire.limits import MAX_MESSAGE_BYTES
from potluck.protos.wire.refusals import REFUSAL_KEY

log = get_logger(__name__)

PER_CLIENT_CALLS = 12
# A client keeps a channel per peer it calls; in a swarm that churns (a coordinator pings whoever joins), the
# channels of peers long gone are closed once it holds more than KEEP_CHANNELS: those not used for IDLE_CHANNEL_S
# (longer than any call lasts, a state download over a slow link included), so what it holds grows with the
# churn of the last half hour, not with the run's length.
KEEP_CHANNELS = 256
IDLE_CHANNEL_S = 1800.0
SERVER_OPTIONS = [
    ("grpc.max_connection_age_ms", 3_600_000),  # long-lived idle streams end, whatever a client does
    ("grpc.max_connection_age_grace_ms", 600_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # clients ping every 20 s (CHANNEL_OPTIONS) to keep long streams alive, a relay tunnel idle for minutes among
    # them: accept that, where gRPC's default (one ping in 5 minutes) would answer GOAWAY "too many pings"
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
]
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.enable_retries", 0),
]


RATE_WINDOWS = 10  # the send rate is the mean of this many whole seconds


class Traffic:
    """Thread-safe byte counters by kind (``outer``, ``state``, ``probe``, ...) and direction, and the send rate:
    bytes sent in each whole second of ``clock`` (all kinds together: one uplink carries them all), its mean over the
    last :data:`RATE_WINDOWS` seconds and its peak second since the start (what a volunteer's uplink must carry at
    once: an outer step sends its bytes in a burst every H inner steps), with what filled that second, by kind
    (measured: a whole outer step's peak second was the evidence an auditor fetched, a streamed one's its own sends)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self.sent: dict[str, int] = defaultdict(int)
        self.received: dict[str, int] = defaultdict(int)
        self.rejected: dict[str, int] = defaultdict(int)
        self._clock = clock
        self._second = int(clock())  # the second being counted, its bytes, the whole seconds before it
        self._in_second = 0
        self._seconds: list[int] = []
        self._peak = 0
        self._second_kinds: dict[str, int] = defaultdict(int)  # the second being counted, by kind
        self._peak_kinds: dict[str, int] = {}  # the peak second, by kind

    def _roll(self) -> None:
        """(Under the lock) close the seconds that have passed since the last send."""
        now = int(self._clock())
        if now == self._second:
            return
        if self._in_second > self._peak:
            self._peak, self._peak_kinds = self._in_second, dict(self._second_kinds)
        self._second_kinds = defaultdict(int)
        self._seconds = (self._seconds + [self._in_second] + [0] * min(now - self._second - 1, RATE_WINDOWS))[
            -RATE_WINDOWS:]
        self._second, self._in_second = now, 0

    def add_sent(self, kind: str, n: int) -> None:
        with self._lock:
            self.sent[kind] += n
            self._roll()
            self._in_second += n
            self._second_kinds[kind] += n

    def send_rate(self) -> tuple[float, float]:
        """Bytes per second sent: the mean over the last :data:`RATE_WINDOWS` whole seconds (fewer since the start),
        and the peak of any whole second since the start."""
        with self._lock:
            self._roll()
            return (sum(self._seconds) / len(self._seconds) if self._seconds else 0.0), float(self._peak)

    def peak_second(self) -> tuple[float, dict[str, int]]:
        """The peak second (:meth:`send_rate`'s) and its bytes by kind, read together: what the uplink's burst was."""
        with self._lock:
            self._roll()
            return float(self._peak), dict(self._peak_kinds)

    def add_received(self, kind: str, n: int) -> None:
        with self._lock:
            self.received[kind] += n

    def add_rejected(self, reason_kind: str) -> None:
        with self._lock:
            self.rejected[reason_kind] += 1

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.sent), dict(self.received)


def _log_reject(method: str, sender: str, reason: str) -> None:
    log.warning("rejected %s from %s: %s", method, short_id(sender) if sender != "?" else "?", reason)


def service_handler(handlers: Handlers, traffic: Traffic, on_reject: Callable[[str, str, str], None] = _log_reject,
                    mtls: bool = True, revoked: Callable[[str], bool] = lambda peer_id: False,
                    per_client: int = PER_CLIENT_CALLS, relay: RelayHub | None = None) -> grpc.GenericRpcHandler:
    """PeerService as a gRPC handler: every request checked (header, sender, revoked peers, per-client calls)
    before ``handlers`` sees it. :class:`PeerServer` serves it on one port; a server of its own may add it too."""
    return rpc_handlers(Servicer(handlers, traffic, on_reject, mtls, revoked, per_client, relay))


class PeerServer:
    """A PeerService gRPC server bound to ``host:port`` (port 0 picks a free one).

    With ``netem``, calls from clients tagged with a region are delayed and paced as the emulated
    network says; each call then holds its worker thread while it waits.
    """

    def __init__(
        self,
        handlers: Handlers,
        traffic: Traffic,
        host: str = "0.0.0.0",
        port: int = 0,
        workers: int = 64,
        on_reject: Callable[[str, str, str], None] = _log_reject,
        netem: NetEm | None = None,
        tls: TlsIdentity | None = None,
        revoked: Callable[[str], bool] = lambda peer_id: False,
        per_client: int = PER_CLIENT_CALLS,
        relay: RelayHub | None = None,
    ) -> None:
        # gRPC sets SO_REUSEPORT by default: a second server on a taken port would bind silently and
        # get a share of its connections. Probe first (a clear error), and bind without it.
        check_port_free("gRPC port", host, port, "--grpc-port")
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
            options=[*CHANNEL_OPTIONS, *SERVER_OPTIONS, ("grpc.so_reuseport", 0)],
            interceptors=[netem.server_interceptor()] if netem else None,
            maximum_concurrent_rpcs=4 * workers,  # beyond that, callers are told RESOURCE_EXHAUSTED at once
        )
        self.server.add_generic_rpc_handlers((service_handler(handlers, traffic, on_reject, tls is not None, revoked,
                                                              per_client, relay),))
        try:
            where = f"{host}:{port}"
            self.port = (self.server.add_secure_port(where, tls.server_credentials()) if tls is not None
                         else self.server.add_insecure_port(where))
        except RuntimeError:  # newer grpcio raises where older ones returned 0
            self.port = 0
        if self.port == 0:
            self.server.stop(None)
            raise explain_bind_failure("gRPC port", host, port, "--grpc-port")
        self.server.start()

    def stop(self, grace: float = 1.0) -> None:
        self.server.stop(grace).wait(grace + 1.0)


class RelayedServer:
    """What a peer that accepts no connections runs instead of a :class:`PeerServer`: no port, one
    outbound tunnel to a relay, over which it serves the same handlers (see :mod:`potluck.protos.net.relay`).
    ``address`` is what it announces."""

    def __init__(self, handlers: Handlers, traffic: Traffic, client: PeerClient, relay_address: str, relay_id: str,
                 run_id: str, me: str, revoked: Callable[[str], bool] = lambda peer_id: False,
                 on_reject: Callable[[str, str, str], None] = _log_reject) -> None:
        servicer = Servicer(handlers, traffic, on_reject, client.tls is not None, revoked, PER_CLIENT_CALLS)
        self.address, self.port = relayed_address(relay_address, relay_id), 0
        self.tunnel = RelayClient(lambda frames: client.open_relay(relay_address, relay_id, frames), servicer, parser_for,
                                  run_id, me, REFUSAL_KEY)
        self.tunnel.start()

    def stop(self, grace: float = 1.0) -> None:
        self.tunnel.stop()


class PeerClient:
    """Calls other peers' PeerService; one channel per address (and peer id), reused across calls, closed
    when idle past ``IDLE_CHANNEL_S`` once the client holds more than ``KEEP_CHANNELS``.

    With ``tls``, every call names the peer id it means to reach (``peer``): the channel checks the
    server's certificate is that peer's, so a reply can only come from its key. With ``netem``,
    every call is tagged with this process's region, for the receiver to emulate.
    """

    def __init__(self, traffic: Traffic, netem: NetEm | None = None, tls: TlsIdentity | None = None,
                 idle_connection_s: float | None = None) -> None:
        self.traffic, self.tls = traffic, tls
        # (with idle_connection_s, a channel with no call for that long closes its connection, and opens one again
        # for the next call: gRPC's own idleness, so a call in flight, however long, keeps it)
        self._options = CHANNEL_OPTIONS + ([("grpc.client_idle_timeout_ms", int(1000 * idle_connection_s))]
                                           if idle_connection_s is not None else [])
        self._tag = netem.client_interceptor() if netem else None
        self._lock = threading.Lock()
        self._stubs: dict[tuple[str, str, int], pb_grpc.PeerServiceStub] = {}
        self._channels: dict[tuple[str, str, int], grpc.Channel] = {}
        self._used: dict[tuple[str, str, int], float] = {}  # (when each channel was last routed through)
        self._owner: dict[tuple[str, str, int], str] = {}  # (the peer each channel was made for, see forget)

    def stub(self, address: str, peer: str = "") -> pb_grpc.PeerServiceStub:
        return self._route(address, peer)[0]

    def _route(self, address: str, peer: str) -> tuple[pb_grpc.PeerServiceStub, tuple[tuple[str, str], ...]]:
        """The stub for ``address`` and the metadata a call needs: a relayed peer (its address names a
        relay, see :mod:`potluck.protos.net.relay`) is reached through the relay's channel, the call tagged
        with the peer it is meant for; TLS then checks the relay's certificate."""
        where, via = split_address(address)
        tls = self.tls
        name = via or peer
        if tls is not None and not name:
            raise ValueError(f"a call to {address} over TLS must name the peer id it is meant for")
        key = (where, name if tls is not None else "", tls.generation if tls is not None else 0)
        with self._lock:
            stub, self._used[key] = self._stubs.get(key), (now := time.monotonic())
            if stub is None:
                if len(self._channels) >= KEEP_CHANNELS:
                    self._close_idle(now - IDLE_CHANNEL_S)
                if tls is not None:
                    options = [*self._options, ("grpc.ssl_target_name_override", name.lower())]
                    channel = grpc.secure_channel(where, tls.channel_credentials(), options=options)
                else:
                    channel = grpc.insecure_channel(where, options=self._options)
                if self._tag is not None:
                    channel = grpc.intercept_channel(channel, self._tag)
                self._channels[key] = channel
                stub = self._stubs[key] = pb_grpc.PeerServiceStub(channel)
                if peer and not via:  # (a relay's channel is the relay's, whoever a call through it is for)
                    self._owner[key] = peer
        return stub, (((TARGET_KEY, peer),) if via else ())

    def _close_idle(self, before: float) -> None:
        for key in [k for k, used in self._used.items() if used < before]:
            self._drop(key)

    def forget(self, peer: str) -> None:
        """Close the channels made for ``peer`` (one lost to the run or evicted): a coordinator in a swarm with
        churn would otherwise hold a connection to every peer that passed through in the last
        ``IDLE_CHANNEL_S`` (about 120 KB of gRPC and TLS state each: 100 leaving a minute at 1,000 peers make
        370 MB in half an hour). A call that comes later opens a new one; one in flight on it ends."""
        with self._lock:
            for key in [k for k, owner in self._owner.items() if owner == peer]:
                self._drop(key)

    def _drop(self, key: tuple[str, str, int]) -> None:
        self._channels.pop(key).close()
        del self._stubs[key], self._used[key]
        self._owner.pop(key, None)

    def open_relay(self, address: str, relay: str, frames: Iterator[pb.RelayFrame]) -> Iterator[pb.RelayFrame]:
        """Open a relay tunnel to ``relay`` at ``address`` (see :class:`RelayedServer`)."""
        return counted(self.stub(address, relay).Relay(counted(frames, lambda n: self.traffic.add_sent("relay", n))),
                        lambda n: self.traffic.add_received("relay", n))

    def ping(self, address: str, request: pb.PingRequest, timeout: float, peer: str = "") -> pb.PingReply:
        return self._unary("Ping", "probe", address, request, timeout, peer)

    def ping_all(self, targets: Iterable[tuple[str, str]], request: pb.PingRequest, timeout: float) -> list[bool]:
        """Ping every (address, peer id) at once (gRPC futures, no thread each): whether each answered within
        ``timeout``, and not as another peer. A thousand pings take as long as the slowest, not a thousandth of them in turn."""
        calls = [(peer, self._ping_call(address, peer, request, timeout)) for address, peer in targets]
        return [self._pinged(peer, call) for peer, call in calls]

    def ping_each(self, targets: Iterable[tuple[str, str]], request: pb.PingRequest, timeout: float,
                  answered: Callable[[str, bool], None]) -> None:
        """:meth:`ping_all` without waiting: ``answered(peer, ok)`` is called as each answer comes in (on gRPC's
        thread: keep it short), so a slow or dead peer holds up no other's answer."""
        for address, peer in targets:
            if (call := self._ping_call(address, peer, request, timeout)) is None:
                answered(peer, False)
            else:
                call.add_done_callback(lambda done, peer=peer: answered(peer, self._pinged(peer, done)))

    def _ping_call(self, address: str, peer: str, request: pb.PingRequest, timeout: float) -> Any:
        try:
            stub, md = self._route(address, peer)
        except ValueError:  # (an address no channel can be made for: it cannot answer)
            return None
        self.traffic.add_sent("probe", request.ByteSize())
        return stub.Ping.future(request, timeout=timeout, metadata=md)

    def _pinged(self, peer: str, call: Any) -> bool:
        try:
            reply = call.result() if call is not None else None
        except grpc.RpcError:
            reply = None
        if reply is None:
            return False
        self.traffic.add_received("probe", reply.ByteSize())
        return not peer or reply.peer_id in ("", peer)  # (TLS proved who answered; not as another peer)

    def push_contribution(self, address: str, chunks: Iterable[pb.ShardChunk], timeout: float, peer: str = "") -> pb.Ack:
        return self._pushed("PushContribution", "outer", address, chunks, timeout, peer)

    def push_result(self, address: str, chunks: Iterable[pb.ShardChunk], timeout: float, peer: str = "") -> pb.Ack:
        return self._pushed("PushResult", "outer", address, chunks, timeout, peer)

    def fetch_result(self, address: str, request: pb.ResultRequest, timeout: float, peer: str = "") -> Iterator[pb.ShardChunk]:
        return self._streamed("FetchResult", "outer", address, request, timeout, peer)

    def fetch_inputs(self, address: str, request: pb.InputsRequest, timeout: float, peer: str = "") -> Iterator[pb.ShardChunk]:
        return self._streamed("FetchInputs", "audit", address, request, timeout, peer)

    def get_state_info(self, address: str, request: pb.StateInfoRequest, timeout: float, peer: str = "") -> pb.StateInfo:
        return self._unary("GetStateInfo", "state", address, request, timeout, peer)

    def fetch_state(self, address: str, request: pb.StateRequest, timeout: float, peer: str = "") -> Iterator[pb.StateChunk]:
        return self._streamed("FetchState", "state", address, request, timeout, peer)

    def push_pipe(self, address: str, chunks: Iterable[pb.PipeChunk], timeout: float, peer: str = "") -> pb.Ack:
        """One pipeline message as a stream of pieces (see :mod:`potluck.peer.pipeline.pipewire`); gRPC's flow control
        paces ``chunks``, so a slow receiver holds the sender to the pieces in flight."""
        return self._pushed("PushPipe", "pipeline", address, chunks, timeout, peer)

    # Every call's bytes are counted under its kind (Traffic), whichever of gRPC's three shapes it has.

    def _unary(self, method: str, kind: str, address: str, request: Any, timeout: float, peer: str) -> Any:
        self.traffic.add_sent(kind, request.ByteSize())
        stub, md = self._route(address, peer)
        reply = getattr(stub, method)(request, timeout=timeout, metadata=md)
        self.traffic.add_received(kind, reply.ByteSize())
        return reply

    def _streamed(self, method: str, kind: str, address: str, request: Any, timeout: float, peer: str) -> Iterator[Any]:
        """A call answered by a stream."""
        self.traffic.add_sent(kind, request.ByteSize())
        stub, md = self._route(address, peer)
        return counted(getattr(stub, method)(request, timeout=timeout, metadata=md),
                       lambda n: self.traffic.add_received(kind, n))

    def _pushed(self, method: str, kind: str, address: str, chunks: Iterable[Any], timeout: float, peer: str) -> pb.Ack:
        """A stream of pieces answered once."""
        stub, md = self._route(address, peer)
        ack = getattr(stub, method)(counted(chunks, lambda n: self.traffic.add_sent(kind, n)), timeout=timeout, metadata=md)
        self.traffic.add_received(kind, ack.ByteSize())
        return ack

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()
            self._used.clear()
            self._owner.clear()

