"""The server side of PeerService: every call checked before a handler sees it.

A :class:`Servicer` stands between gRPC and the daemon's :class:`Handlers`: it parses each request
itself (a malformed one is refused as ``BAD_MESSAGE``, never handed on), learns who calls (the client
certificate's peer id, else the remote host), holds each caller to ``per_client`` calls at once,
checks that a message's ``header.sender`` is the caller, counts the bytes by kind, relays a call meant
for a peer behind this server's :class:`~potluck.protos.net.relay.RelayHub`, and turns a handler's
:class:`~potluck.protos.wire.refusals.Rejected` into a gRPC status with the refusal attached. The servers
themselves (a port, or a relay tunnel) are :mod:`potluck.protos.net.transport`'s.
"""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from potluck.protos import potluck_pb2 as pb
from potluck.protos.net.certs import peer_of
from potluck.protos.net.relay import METHODS, TARGET_KEY, Method, RelayError, RelayHub
from potluck.protos.runtime.log import get_logger, short_id
from potluck.protos.wire.refusals import REFUSAL_KEY, Rejected

if TYPE_CHECKING:  # the servicer only counts into it; the transport builds it
    from potluck.protos.net.transport import Traffic

log = get_logger(__name__)

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

_REPLY_TYPES = {name: m.reply for name, m in METHODS.items()}


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

    # (Relay is the transport's own: see potluck.protos.net.relay)


def counted(messages: Iterable[M], count: Callable[[int], None]) -> Iterator[M]:
    for m in messages:
        count(m.ByteSize())  # type: ignore[attr-defined]
        yield m


class Malformed:
    """A request that does not parse as its message type: refused as BAD_MESSAGE, never handed on."""

    def __init__(self, size: int, error: str) -> None:
        self.size, self.error = size, error

    def ByteSize(self) -> int:  # noqa: N802 (as a protobuf message, for the byte counts)
        return self.size


def parser_for(cls: type[Message]) -> Callable[[bytes], Message | Malformed]:
    """Parse requests ourselves: gRPC's own parser would answer INTERNAL and log a traceback per bad message."""
    def parse(data: bytes) -> Message | Malformed:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RecursionError) as err:
            return Malformed(len(data), str(err)[:200] or "cannot parse")
    return parse


def rpc_handlers(servicer: object) -> grpc.GenericRpcHandler:
    """The PeerService methods of ``servicer`` as gRPC handlers, from the service's descriptor."""
    service = pb.DESCRIPTOR.services_by_name["PeerService"]
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (True, False): grpc.stream_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return grpc.method_handlers_generic_handler(service.full_name, {
        m.name: kinds[(m.client_streaming, m.server_streaming)](
            getattr(servicer, m.name), request_deserializer=parser_for(getattr(pb, m.input_type.name)),
            response_serializer=lambda reply: reply.SerializeToString())
        for m in service.methods})


class Servicer:
    """The PeerService methods gRPC (or a relay tunnel) calls, for one server. ``_lock`` guards ``_active``
    (calls running per caller), entered and left by the server's worker threads."""

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
        if isinstance(message, Malformed):
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
                    if isinstance(m, Malformed):
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
            frames = counted(request_iterator, lambda n: self.traffic.add_received("relay", n))
            for frame in self.hub.tunnel(who if self.tls else "", frames):  # type: ignore[union-attr]
                self.traffic.add_sent("relay", frame.ByteSize())
                yield frame
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        finally:
            self._leave(who)

    @contextmanager
    def _serving(self, method: str, request: object, context: grpc.ServicerContext,
                 reads_stream: bool = False) -> Iterator[str]:
        """One call served here: enter (who calls, within its share), check ``request`` if given, run the
        body, leave. A refusal reaches the caller as its refusal; a handler's bug as INTERNAL, logged (it
        must not kill the server thread silently); with ``reads_stream``, a failed read of the caller's
        stream as CANCELLED (the caller cancelled it or went away mid-stream)."""
        who = ""
        try:
            who = self._enter(context)
            if request is not None:
                self._claims(who, request)
            yield who
        except Rejected as r:
            self._reject(method, request, r, context)
        except Exception as err:
            if reads_stream and isinstance(err, grpc.RpcError):
                log.info("%s from %s: the stream ended early (the sender cancelled it or went away)", method,
                         short_id(who))
                context.abort(grpc.StatusCode.CANCELLED, f"{method}: the stream ended early")
            else:
                log.exception("%s handler failed", method)
                context.abort(grpc.StatusCode.INTERNAL, f"{method} failed: {err}")
        finally:
            if who:
                self._leave(who)

    def _unary(self, method: str, request: object, context: grpc.ServicerContext, fn: Callable) -> object:
        if self._target(context):
            return self._relayed(method, [request], context, streaming=False)
        kind = KIND_BY_METHOD[method]
        self.traffic.add_received(kind, request.ByteSize())  # type: ignore[attr-defined]
        with self._serving(method, request, context):
            reply = fn(request)
        self.traffic.add_sent(kind, reply.ByteSize())
        return reply

    def _client_stream(self, method: str, it: Iterator, context: grpc.ServicerContext, fn: Callable) -> object:
        if self._target(context):
            return self._relayed(method, it, context, streaming=False)
        kind = KIND_BY_METHOD[method]
        with self._serving(method, None, context, reads_stream=True) as who:
            reply = fn(self._checked(who, counted(it, lambda n: self.traffic.add_received(kind, n))))
        self.traffic.add_sent(kind, reply.ByteSize())
        return reply

    def _server_stream(self, method: str, request: object, context: grpc.ServicerContext, fn: Callable) -> Iterator:
        if self._target(context):
            yield from self._relayed(method, [request], context, streaming=True)  # type: ignore[misc]
            return
        kind = KIND_BY_METHOD[method]
        self.traffic.add_received(kind, request.ByteSize())  # type: ignore[attr-defined]
        with self._serving(method, request, context):
            for m in fn(request):
                self.traffic.add_sent(kind, m.ByteSize())
                yield m

    def _reject(self, method: str, request: object, r: Rejected, context: grpc.ServicerContext) -> None:
        sender = r.sender or getattr(getattr(request, "header", None), "sender", "") or "?"
        self.traffic.add_rejected(method)
        self.on_reject(method, sender, f"{pb.Refusal.Name(r.refusal)}: {r.reason}")
        context.set_trailing_metadata(((REFUSAL_KEY, r.info().SerializeToString()),))
        context.abort(r.code, r.reason)


def _served(method: Method) -> Callable:
    """PeerService's ``method`` as gRPC (or a relay tunnel) calls it on a :class:`Servicer`: served the way its
    streaming says, by the handler of its snake_case name (``PushContribution``: ``Handlers.push_contribution``)."""
    serve = (Servicer._client_stream if method.client_streaming else
             Servicer._server_stream if method.server_streaming else Servicer._unary)
    handler = re.sub(r"(?<!^)(?=[A-Z])", "_", method.name).lower()

    def call(self: Servicer, request: object, context: grpc.ServicerContext) -> object:
        return serve(self, method.name, request, context, getattr(self.h, handler))  # type: ignore[arg-type]

    call.__name__ = call.__qualname__ = method.name
    return call


for _method in METHODS.values():  # every method of the service but Relay (the servicer's own, above)
    setattr(Servicer, _method.name, _served(_method))
