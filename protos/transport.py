"""gRPC plumbing of a peer: the PeerService server, a client with channel reuse, byte accounting.

The transport knows nothing about training: the server hands each RPC to a :class:`Handlers`
object (the daemon), the client moves protobuf messages. What it adds is what every RPC needs the
same way: deliberate message size limits, counting every byte sent and received by kind (the
figures the logs, ``/metrics`` and the status page show), and turning a handler's
:class:`Rejected` into a gRPC status with a clear reason, logged once on the receiving side.

With a :class:`~potluck.protos.certs.TlsIdentity`, both sides run mutual TLS with certificates
from the run's CA: the server learns who calls from the client certificate and refuses a message
whose ``header.sender`` says otherwise (or whose sender was evicted), and the client names the
peer id it means to reach, so a reply can only come from that key. Every client identity (a
certificate's peer id, else a remote host) may hold at most ``per_client`` calls at once, so an
idle or slow client cannot occupy the server's threads; connections are closed after an hour.

Given a :class:`~potluck.protos.netem.NetEm`, server and client also play an emulated wide-area
network (delay and bandwidth per region pair) through gRPC interceptors, so every RPC, present and
future, crosses it; without one no interceptor is installed.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from typing import Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from potluck.protos import potluck_pb2 as pb
from potluck.protos import potluck_pb2_grpc as pb_grpc
from potluck.protos.certs import TlsIdentity, peer_of
from potluck.protos.errors import check_port_free, explain_bind_failure
from potluck.protos.limits import MAX_MESSAGE_BYTES
from potluck.protos.log import get_logger, short_id
from potluck.protos.netem import NetEm
from potluck.protos.relay import (
    METHODS,
    TARGET_KEY,
    RelayClient,
    RelayError,
    RelayHub,
    relayed_address,
    split_address,
)

log = get_logger(__name__)

PER_CLIENT_CALLS = 12
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

KIND_BY_METHOD = {
    "Ping": "probe",
    "PushContribution": "outer",
    "PushResult": "outer",
    "FetchResult": "outer",
    "FetchInputs": "audit",
    "GetStateInfo": "state",
    "FetchState": "state",
    "PushPipe": "pipeline",
    "Relay": "relay",
}

M = TypeVar("M")


# The gRPC status each refusal travels under: the code gRPC documents for the case, so that a
# status alone still reads right to a generic client. UNAVAILABLE is never used for a refusal: it
# means "the receiver is gone" (connection refused or reset), see :func:`is_unreachable`.
STATUS_OF: dict[int, grpc.StatusCode] = {
    pb.UNKNOWN_RUN: grpc.StatusCode.PERMISSION_DENIED,
    pb.WRONG_STEP: grpc.StatusCode.FAILED_PRECONDITION,
    pb.WRONG_EPOCH: grpc.StatusCode.FAILED_PRECONDITION,
    pb.BASE_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    pb.NOT_A_MEMBER: grpc.StatusCode.PERMISSION_DENIED,
    pb.NOT_OWNER: grpc.StatusCode.INVALID_ARGUMENT,
    pb.ALREADY_REDUCED: grpc.StatusCode.FAILED_PRECONDITION,
    pb.TAKEN_OVER: grpc.StatusCode.ABORTED,
    pb.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    pb.NOT_YET: grpc.StatusCode.FAILED_PRECONDITION,
    pb.BUFFER_MISS: grpc.StatusCode.FAILED_PRECONDITION,
    pb.BAD_MESSAGE: grpc.StatusCode.INVALID_ARGUMENT,
    pb.NO_STATE: grpc.StatusCode.NOT_FOUND,
    pb.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    pb.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    pb.BAD_IDENTITY: grpc.StatusCode.UNAUTHENTICATED,
}
REFUSAL_KEY = "potluck-refusal-bin"
_REPLY_TYPES = {name: m.reply for name, m in METHODS.items()}


class Rejected(Exception):
    """Raised by a handler to refuse a message: a :class:`pb.Refusal` code and a reason for humans.

    It reaches the sender as a gRPC error whose status is ``STATUS_OF[refusal]`` and whose trailing
    metadata carries a :class:`pb.RefusalInfo` (read it back with :func:`refusal_of`).
    """

    def __init__(self, refusal: int, reason: str, sender: str = "", *, at_step: int = 0, at_epoch: int = 0) -> None:
        super().__init__(reason)
        if refusal not in STATUS_OF:
            raise ValueError(f"unknown refusal {refusal!r}")
        self.refusal, self.reason, self.sender = refusal, reason, sender
        self.at_step, self.at_epoch = at_step, at_epoch

    @property
    def code(self) -> grpc.StatusCode:
        return STATUS_OF[self.refusal]

    def info(self) -> pb.RefusalInfo:
        return pb.RefusalInfo(code=self.refusal, at_step=self.at_step, at_epoch=self.at_epoch)  # type: ignore[arg-type]


def refusal_of(err: grpc.RpcError) -> pb.RefusalInfo | None:
    """The refusal a potluck handler attached to ``err``; None for transport errors (and garbage)."""
    try:
        metadata = err.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:  # not a call error (e.g. a test double)
        return None
    for key, value in metadata:
        if key == REFUSAL_KEY and isinstance(value, bytes):
            info = pb.RefusalInfo()
            try:
                info.ParseFromString(value)
            except Exception:
                return None
            return info if info.code != pb.REFUSAL_UNSPECIFIED else None
    return None


def refused(err: grpc.RpcError, *codes: int) -> bool:
    """True when ``err`` is a refusal with one of ``codes``."""
    info = refusal_of(err)
    return info is not None and info.code in codes


class Traffic:
    """Thread-safe byte counters by kind (``outer``, ``state``, ``probe``, ...) and direction."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent: dict[str, int] = defaultdict(int)
        self.received: dict[str, int] = defaultdict(int)
        self.rejected: dict[str, int] = defaultdict(int)

    def add_sent(self, kind: str, n: int) -> None:
        with self._lock:
            self.sent[kind] += n

    def add_received(self, kind: str, n: int) -> None:
        with self._lock:
            self.received[kind] += n

    def add_rejected(self, reason_kind: str) -> None:
        with self._lock:
            self.rejected[reason_kind] += 1

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.sent), dict(self.received)


class Handlers(Protocol):
    """What the daemon implements; each method may raise :class:`Rejected`."""

    def ping(self, request: pb.PingRequest) -> pb.PingReply: ...

    def push_contribution(self, chunks: Iterator[pb.ShardChunk]) -> pb.Ack: ...

    def push_result(self, chunks: Iterator[pb.ShardChunk]) -> pb.Ack: ...

    def fetch_result(self, request: pb.ResultRequest) -> Iterator[pb.ShardChunk]: ...

    def fetch_inputs(self, request: pb.InputsRequest) -> Iterator[pb.ShardChunk]: ...

    def get_state_info(self, request: pb.StateInfoRequest) -> pb.StateInfo: ...

    def fetch_state(self, request: pb.StateRequest) -> Iterator[pb.StateChunk]: ...

    def push_pipe(self, chunks: Iterator[pb.PipeChunk]) -> pb.Ack: ...

    # (Relay is the transport's own: see potluck.protos.relay)


def _counted(messages: Iterable[M], count: Callable[[int], None]) -> Iterator[M]:
    for m in messages:
        count(m.ByteSize())  # type: ignore[attr-defined]
        yield m


class _Malformed:
    """A request that does not parse as its message type: refused as BAD_MESSAGE, never handed on."""

    def __init__(self, size: int, error: str) -> None:
        self.size, self.error = size, error

    def ByteSize(self) -> int:  # noqa: N802 (as a protobuf message, for the byte counts)
        return self.size


def _parser(cls: type[Message]) -> Callable[[bytes], Message | _Malformed]:
    """Parse requests ourselves: gRPC's own parser would answer INTERNAL and log a traceback per bad message."""
    def parse(data: bytes) -> Message | _Malformed:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RecursionError) as err:
            return _Malformed(len(data), str(err)[:200] or "cannot parse")
    return parse


def _rpc_handlers(servicer: object) -> grpc.GenericRpcHandler:
    """The PeerService methods of ``servicer`` as gRPC handlers, from the service's descriptor."""
    service = pb.DESCRIPTOR.services_by_name["PeerService"]
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (True, False): grpc.stream_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return grpc.method_handlers_generic_handler(service.full_name, {
        m.name: kinds[(m.client_streaming, m.server_streaming)](
            getattr(servicer, m.name), request_deserializer=_parser(getattr(pb, m.input_type.name)),
            response_serializer=lambda reply: reply.SerializeToString())
        for m in service.methods})


class _Servicer:
    def __init__(self, handlers: Handlers, traffic: Traffic, on_reject: Callable[[str, str, str], None],
                 tls: bool, revoked: Callable[[str], bool], per_client: int, hub: RelayHub | None = None) -> None:
        self.h, self.traffic, self.on_reject = handlers, traffic, on_reject
        self.tls, self.revoked, self.per_client, self.hub = tls, revoked, per_client, hub
        self._active: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def _enter(self, context: grpc.ServicerContext) -> str:
        """Who calls (the certificate's peer id, or the remote host without TLS); refuse if over its share."""
        who = peer_of(context.auth_context()) if self.tls else context.peer().rsplit(":", 1)[0]
        if self.tls and not who:
            raise Rejected(pb.BAD_IDENTITY, "no client certificate")
        if self.tls and self.revoked(who):
            raise Rejected(pb.BAD_IDENTITY, f"{short_id(who)} was evicted from this run", who)
        with self._lock:
            if self._active[who] >= self.per_client:
                raise Rejected(pb.OVERLOADED, f"{self.per_client} calls of this client are running already", who)
            self._active[who] += 1
        return who

    def _leave(self, who: str) -> None:
        with self._lock:
            self._active[who] -= 1
            if not self._active[who]:
                del self._active[who]

    def _claims(self, who: str, message: object) -> None:
        """A message must parse, and with TLS its sender must be the certificate's peer id."""
        if isinstance(message, _Malformed):
            raise Rejected(pb.BAD_MESSAGE, f"malformed message: {message.error}", who)
        if isinstance(message, pb.PipeChunk):  # the head names the sender; the body's pieces name no one
            if not message.HasField("head"):
                return
            message = message.head
        sender = getattr(getattr(message, "header", None), "sender", "")
        if self.tls and sender != who:
            raise Rejected(pb.BAD_IDENTITY, f"the header says {sender[:64]!r}, the certificate {short_id(who)}", who)

    def _checked(self, who: str, messages: Iterator[M]) -> Iterator[M]:
        for m in messages:
            self._claims(who, m)
            yield m

    def _target(self, context: grpc.ServicerContext) -> str:
        """The peer a call is meant for when it is to be relayed (``x-potluck-to``), else ''."""
        if self.hub is None:
            return ""
        return next((v for k, v in context.invocation_metadata() or () if k == TARGET_KEY), "")

    def _forward(self, method: str, target: str, requests: Iterable, context: grpc.ServicerContext) -> Iterator:
        """Relay a call to ``target``'s tunnel: the caller is authenticated and counted here as for any
        call; the relayed peer checks the messages themselves, with the caller this relay vouches for."""
        who = self._enter(context)
        try:
            deadline = time.monotonic() + (context.time_remaining() or 60.0)

            def data() -> Iterator[bytes]:
                for m in requests:
                    if isinstance(m, _Malformed):
                        raise Rejected(pb.BAD_MESSAGE, f"malformed message: {m.error}", who)
                    self.traffic.add_received("relay", m.ByteSize())
                    yield m.SerializeToString()

            for reply in self.hub.forward(target, method, who, data(), deadline):  # type: ignore[union-attr]
                self.traffic.add_sent("relay", len(reply))
                yield reply
        except Rejected as r:
            self._reject(method, None, r, context)
        except RelayError as err:
            if err.refusal:
                context.set_trailing_metadata(((REFUSAL_KEY, err.refusal),))
            context.abort(err.code, err.details)
        finally:
            self._leave(who)

    def _relayed(self, method: str, requests: Iterable, context: grpc.ServicerContext, streaming: bool) -> object:
        reply = _REPLY_TYPES[method]
        if streaming:
            return (reply.FromString(data) for data in self._forward(method, self._target(context), requests, context))
        replies = list(self._forward(method, self._target(context), requests, context))
        if len(replies) != 1:
            context.abort(grpc.StatusCode.INTERNAL, f"{method}: the relayed peer sent {len(replies)} replies")
        return reply.FromString(replies[0])

    def Relay(self, request_iterator, context):  # noqa: N802 (gRPC names)
        """A peer without inbound reachability holds this stream open; calls for it are sent down it."""
        if self.hub is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server relays no calls; relay through the coordinator")
        who = self._enter(context)
        try:
            frames = _counted(request_iterator, lambda n: self.traffic.add_received("relay", n))
            for frame in self.hub.tunnel(who if self.tls else "", frames):  # type: ignore[union-attr]
                self.traffic.add_sent("relay", frame.ByteSize())
                yield frame
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        finally:
            self._leave(who)

    def _unary(self, method: str, request: object, context: grpc.ServicerContext, fn: Callable) -> object:
        if self._target(context):
            return self._relayed(method, [request], context, streaming=False)
        kind = KIND_BY_METHOD[method]
        self.traffic.add_received(kind, request.ByteSize())  # type: ignore[attr-defined]
        who = ""
        try:
            who = self._enter(context)
            self._claims(who, request)
            reply = fn(request)
        except Rejected as r:
            self._reject(method, request, r, context)
        except Exception as err:  # a bug in a handler must not kill the server thread silently
            log.exception("%s handler failed", method)
            context.abort(grpc.StatusCode.INTERNAL, f"{method} failed: {err}")
        finally:
            if who:
                self._leave(who)
        self.traffic.add_sent(kind, reply.ByteSize())
        return reply

    def _client_stream(self, method: str, it: Iterator, context: grpc.ServicerContext, fn: Callable) -> object:
        if self._target(context):
            return self._relayed(method, it, context, streaming=False)
        kind = KIND_BY_METHOD[method]
        who = ""
        try:
            who = self._enter(context)
            reply = fn(self._checked(who, _counted(it, lambda n: self.traffic.add_received(kind, n))))
        except Rejected as r:
            self._reject(method, None, r, context)
        except grpc.RpcError:  # reading the stream failed: the client cancelled it or went away mid-stream
            log.info("%s from %s: the stream ended early (the sender cancelled it or went away)", method, short_id(who))
            context.abort(grpc.StatusCode.CANCELLED, f"{method}: the stream ended early")
        except Exception as err:
            log.exception("%s handler failed", method)
            context.abort(grpc.StatusCode.INTERNAL, f"{method} failed: {err}")
        finally:
            if who:
                self._leave(who)
        self.traffic.add_sent(kind, reply.ByteSize())
        return reply

    def _server_stream(self, method: str, request: object, context: grpc.ServicerContext, fn: Callable) -> Iterator:
        if self._target(context):
            yield from self._relayed(method, [request], context, streaming=True)  # type: ignore[misc]
            return
        kind = KIND_BY_METHOD[method]
        self.traffic.add_received(kind, request.ByteSize())  # type: ignore[attr-defined]
        who = ""
        try:
            who = self._enter(context)
            self._claims(who, request)
            for m in fn(request):
                self.traffic.add_sent(kind, m.ByteSize())
                yield m
        except Rejected as r:
            self._reject(method, request, r, context)
        except Exception as err:
            log.exception("%s handler failed", method)
            context.abort(grpc.StatusCode.INTERNAL, f"{method} failed: {err}")
        finally:
            if who:
                self._leave(who)

    def _reject(self, method: str, request: object, r: Rejected, context: grpc.ServicerContext) -> None:
        sender = r.sender or getattr(getattr(request, "header", None), "sender", "") or "?"
        self.traffic.add_rejected(method)
        self.on_reject(method, sender, f"{pb.Refusal.Name(r.refusal)}: {r.reason}")
        context.set_trailing_metadata(((REFUSAL_KEY, r.info().SerializeToString()),))
        context.abort(r.code, r.reason)

    def Ping(self, request, context):  # noqa: N802 (gRPC names)
        return self._unary("Ping", request, context, self.h.ping)

    def PushContribution(self, request_iterator, context):  # noqa: N802
        return self._client_stream("PushContribution", request_iterator, context, self.h.push_contribution)

    def PushResult(self, request_iterator, context):  # noqa: N802
        return self._client_stream("PushResult", request_iterator, context, self.h.push_result)

    def FetchResult(self, request, context):  # noqa: N802
        return self._server_stream("FetchResult", request, context, self.h.fetch_result)

    def FetchInputs(self, request, context):  # noqa: N802
        return self._server_stream("FetchInputs", request, context, self.h.fetch_inputs)

    def GetStateInfo(self, request, context):  # noqa: N802
        return self._unary("GetStateInfo", request, context, self.h.get_state_info)

    def FetchState(self, request, context):  # noqa: N802
        return self._server_stream("FetchState", request, context, self.h.fetch_state)

    def PushPipe(self, request_iterator, context):  # noqa: N802
        return self._client_stream("PushPipe", request_iterator, context, self.h.push_pipe)


def _log_reject(method: str, sender: str, reason: str) -> None:
    log.warning("rejected %s from %s: %s", method, short_id(sender) if sender != "?" else "?", reason)


def service_handler(handlers: Handlers, traffic: Traffic, on_reject: Callable[[str, str, str], None] = _log_reject,
                    mtls: bool = True, revoked: Callable[[str], bool] = lambda peer_id: False,
                    per_client: int = PER_CLIENT_CALLS, relay: RelayHub | None = None) -> grpc.GenericRpcHandler:
    """PeerService as a gRPC handler: every request checked (header, sender, revoked peers, per-client calls)
    before ``handlers`` sees it. :class:`PeerServer` serves it on one port; a server of its own may add it too."""
    return _rpc_handlers(_Servicer(handlers, traffic, on_reject, mtls, revoked, per_client, relay))


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
    outbound tunnel to a relay, over which it serves the same handlers (see :mod:`potluck.protos.relay`).
    ``address`` is what it announces."""

    def __init__(self, handlers: Handlers, traffic: Traffic, client: PeerClient, relay_address: str, relay_id: str,
                 run_id: str, me: str, revoked: Callable[[str], bool] = lambda peer_id: False,
                 on_reject: Callable[[str, str, str], None] = _log_reject) -> None:
        servicer = _Servicer(handlers, traffic, on_reject, client.tls is not None, revoked, PER_CLIENT_CALLS)
        self.address, self.port = relayed_address(relay_address, relay_id), 0
        self.tunnel = RelayClient(lambda frames: client.open_relay(relay_address, relay_id, frames), servicer, _parser,
                                  run_id, me, REFUSAL_KEY)
        self.tunnel.start()

    def stop(self, grace: float = 1.0) -> None:
        self.tunnel.stop()


class PeerClient:
    """Calls other peers' PeerService; one channel per address (and peer id), reused across calls.

    With ``tls``, every call names the peer id it means to reach (``peer``): the channel checks the
    server's certificate is that peer's, so a reply can only come from its key. With ``netem``,
    every call is tagged with this process's region, for the receiver to emulate.
    """

    def __init__(self, traffic: Traffic, netem: NetEm | None = None, tls: TlsIdentity | None = None) -> None:
        self.traffic, self.tls = traffic, tls
        self._tag = netem.client_interceptor() if netem else None
        self._lock = threading.Lock()
        self._stubs: dict[tuple[str, str, int], pb_grpc.PeerServiceStub] = {}
        self._channels: dict[tuple[str, str, int], grpc.Channel] = {}

    def stub(self, address: str, peer: str = "") -> pb_grpc.PeerServiceStub:
        return self._route(address, peer)[0]

    def _route(self, address: str, peer: str) -> tuple[pb_grpc.PeerServiceStub, tuple[tuple[str, str], ...]]:
        """The stub for ``address`` and the metadata a call needs: a relayed peer (its address names a
        relay, see :mod:`potluck.protos.relay`) is reached through the relay's channel, the call tagged
        with the peer it is meant for; TLS then checks the relay's certificate."""
        where, via = split_address(address)
        tls = self.tls
        name = via or peer
        if tls is not None and not name:
            raise ValueError(f"a call to {address} over TLS must name the peer id it is meant for")
        key = (where, name if tls is not None else "", tls.generation if tls is not None else 0)
        with self._lock:
            stub = self._stubs.get(key)
            if stub is None:
                if tls is not None:
                    options = [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", name.lower())]
                    channel = grpc.secure_channel(where, tls.channel_credentials(), options=options)
                else:
                    channel = grpc.insecure_channel(where, options=CHANNEL_OPTIONS)
                if self._tag is not None:
                    channel = grpc.intercept_channel(channel, self._tag)
                self._channels[key] = channel
                stub = self._stubs[key] = pb_grpc.PeerServiceStub(channel)
        return stub, (((TARGET_KEY, peer),) if via else ())

    def open_relay(self, address: str, relay: str, frames: Iterator[pb.RelayFrame]) -> Iterator[pb.RelayFrame]:
        """Open a relay tunnel to ``relay`` at ``address`` (see :class:`RelayedServer`)."""
        return _counted(self.stub(address, relay).Relay(_counted(frames, lambda n: self.traffic.add_sent("relay", n))),
                        lambda n: self.traffic.add_received("relay", n))

    def ping(self, address: str, request: pb.PingRequest, timeout: float, peer: str = "") -> pb.PingReply:
        self.traffic.add_sent("probe", request.ByteSize())
        stub, md = self._route(address, peer)
        reply = stub.Ping(request, timeout=timeout, metadata=md)
        self.traffic.add_received("probe", reply.ByteSize())
        return reply

    def push_contribution(self, address: str, chunks: Iterable[pb.ShardChunk], timeout: float, peer: str = "") -> pb.Ack:
        stub, md = self._route(address, peer)
        return stub.PushContribution(_counted(chunks, lambda n: self.traffic.add_sent("outer", n)), timeout=timeout,
                                     metadata=md)

    def push_result(self, address: str, chunks: Iterable[pb.ShardChunk], timeout: float, peer: str = "") -> pb.Ack:
        stub, md = self._route(address, peer)
        return stub.PushResult(_counted(chunks, lambda n: self.traffic.add_sent("outer", n)), timeout=timeout,
                               metadata=md)

    def fetch_result(self, address: str, request: pb.ResultRequest, timeout: float, peer: str = "") -> Iterator[pb.ShardChunk]:
        self.traffic.add_sent("outer", request.ByteSize())
        stub, md = self._route(address, peer)
        return _counted(stub.FetchResult(request, timeout=timeout, metadata=md),
                        lambda n: self.traffic.add_received("outer", n))

    def fetch_inputs(self, address: str, request: pb.InputsRequest, timeout: float, peer: str = "") -> Iterator[pb.ShardChunk]:
        self.traffic.add_sent("audit", request.ByteSize())
        stub, md = self._route(address, peer)
        return _counted(stub.FetchInputs(request, timeout=timeout, metadata=md),
                        lambda n: self.traffic.add_received("audit", n))

    def get_state_info(self, address: str, request: pb.StateInfoRequest, timeout: float, peer: str = "") -> pb.StateInfo:
        self.traffic.add_sent("state", request.ByteSize())
        stub, md = self._route(address, peer)
        info = stub.GetStateInfo(request, timeout=timeout, metadata=md)
        self.traffic.add_received("state", info.ByteSize())
        return info

    def fetch_state(self, address: str, request: pb.StateRequest, timeout: float, peer: str = "") -> Iterator[pb.StateChunk]:
        self.traffic.add_sent("state", request.ByteSize())
        stub, md = self._route(address, peer)
        return _counted(stub.FetchState(request, timeout=timeout, metadata=md),
                        lambda n: self.traffic.add_received("state", n))

    def push_pipe(self, address: str, chunks: Iterable[pb.PipeChunk], timeout: float, peer: str = "") -> pb.Ack:
        """One pipeline message as a stream of pieces (see :mod:`potluck.peer.pipewire`); gRPC's flow control
        paces ``chunks``, so a slow receiver holds the sender to the pieces in flight."""
        stub, md = self._route(address, peer)
        ack = stub.PushPipe(_counted(chunks, lambda n: self.traffic.add_sent("pipeline", n)), timeout=timeout,
                            metadata=md)
        self.traffic.add_received("pipeline", ack.ByteSize())
        return ack

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()


def is_unreachable(err: grpc.RpcError) -> bool:
    """True when the other side is gone (connection refused/reset), not merely slow or refusing."""
    return err.code() == grpc.StatusCode.UNAVAILABLE and refusal_of(err) is None  # type: ignore[attr-defined]


def is_silent(err: grpc.RpcError) -> bool:
    """True when the other side did not answer in time (stopped, overloaded or far away)."""
    return err.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]


def rpc_reason(err: grpc.RpcError) -> str:
    """``STATUS: details`` of an RPC error, for logs (never parsed: see :func:`refusal_of`)."""
    code = err.code()  # type: ignore[attr-defined]
    info = refusal_of(err)
    name = pb.Refusal.Name(info.code) if info is not None else (code.name if code else "UNKNOWN")
    return f"{name}: {err.details()}"  # type: ignore[attr-defined]
