"""NAT traversal: calls to a peer that accepts no connections, relayed over a stream it opened itself.

A peer behind a NAT or a firewall it does not control (``potluck peer --relay``) listens on no port.
It opens one outbound stream, ``PeerService.Relay``, to a *relay* -- the coordinator, which has a
public address and which every peer already trusts, since it certifies them -- and announces the
address :func:`relayed_address` ``(relay address, relay id)``. Everything else is unchanged: other
peers call it as any peer, and :class:`~potluck.protos.net.transport.PeerClient`, seeing an address that
names a relay, connects (mutual TLS) to the relay instead and tags the call with the peer it is meant
for (``x-potluck-to``). The relay checks the caller's certificate as for any call, then forwards each
request message down the tunnel as a :class:`pb.RelayFrame` carrying the caller's id, and streams the
replies back; a refusal comes back with its ``RefusalInfo``, so the caller reads it exactly as if the
call had been direct. At the relayed peer, :class:`RelayClient` hands each call to the same servicer
a direct call reaches, with the caller the relay vouches for in place of a certificate: the checks
are the same (the header's sender is the caller, evicted peers are refused, per-caller limits,
malformed messages).

What it costs: every byte to or from a relayed peer crosses the relay's links too (the coordinator
counts them as ``relay`` traffic, on its status page), and each call one more hop of latency. What
it trusts: the relay reads relayed messages and could alter them; it is the coordinator, which
certifies every peer and which the threat model trusts already (``docs/threat-model.md``); results
of the all-reduce are signed by their reducer whichever way they travel.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import Message

from potluck.protos import potluck_pb2 as pb
from potluck.protos.runtime.log import get_logger, short_id

log = get_logger(__name__)

VIA = "/via/"
TARGET_KEY = "x-potluck-to"
WINDOW = 32  # frames queued per direction before the sender waits: backpressure, not unbounded memory
DELIVER_S = 30.0  # a reply waits this long for its caller to read it before the call is dropped
RECONNECT_S = (0.5, 10.0)  # a relayed peer re-opens a broken tunnel after this, doubling up to the maximum
_END = object()


@dataclass(frozen=True)
class Method:
    name: str
    request: type[Message]
    reply: type[Message]
    client_streaming: bool
    server_streaming: bool


METHODS: dict[str, Method] = {
    m.name: Method(m.name, getattr(pb, m.input_type.name), getattr(pb, m.output_type.name), m.client_streaming,
                   m.server_streaming)
    for m in pb.DESCRIPTOR.services_by_name["PeerService"].methods if m.name != "Relay"
}


def relayed_address(relay_address: str, relay_id: str) -> str:
    """The address a relayed peer announces: the relay's, and whose it is (its certificate's id)."""
    return f"{relay_address}{VIA}{relay_id}"


def split_address(address: str) -> tuple[str, str]:
    """``(where to connect, the relay's id)``; the id is '' for a peer reached directly."""
    where, _, relay = address.partition(VIA)
    return where, relay


class RelayError(Exception):
    """A relayed call that ended with a non-OK status (re-raised to the caller as that status)."""

    def __init__(self, code: grpc.StatusCode, details: str, refusal: bytes = b"") -> None:
        super().__init__(details)
        self.code, self.details, self.refusal = code, details, refusal


_CODES = {c.value[0]: c for c in grpc.StatusCode}


# ------------------------------------------------------------------------------------------- relay side


@dataclass
class _Call:
    replies: queue.Queue = field(default_factory=lambda: queue.Queue(WINDOW))


class _Tunnel:
    """One relayed peer's stream, as the relay holds it: frames out, replies routed to their calls."""

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id
        self.outbox: queue.Queue = queue.Queue(WINDOW)
        self.calls: dict[int, _Call] = {}
        self.lock = threading.Lock()
        self.closed = threading.Event()

    def deliver(self, frame: pb.RelayFrame) -> None:
        """Hand a reply to its call. A call whose caller stopped reading (it cancelled, or went away) is
        dropped after ``DELIVER_S`` rather than block this tunnel's reader, and with it every other call."""
        with self.lock:
            call = self.calls.get(frame.call)
        if call is None:
            return
        try:
            call.replies.put(frame, timeout=DELIVER_S)
        except queue.Full:
            log.info("dropping relayed call %d to %s: its caller stopped reading", frame.call, short_id(self.peer_id))
            with self.lock:
                self.calls.pop(frame.call, None)

    def close(self) -> None:
        self.closed.set()
        with self.lock:
            calls = list(self.calls.values())
        for call in calls:  # every call still waiting learns the peer is gone
            try:
                call.replies.put_nowait(pb.RelayFrame(end=True, status=grpc.StatusCode.UNAVAILABLE.value[0],
                                                      details="the relayed peer's tunnel closed"))
            except queue.Full:  # its caller stopped reading: nobody waits for this
                pass
        try:
            self.outbox.put_nowait(_END)
        except queue.Full:
            pass


class RelayHub:
    """The relay's side: the tunnels relayed peers hold open, and calls forwarded down them."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._tunnels: dict[str, _Tunnel] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def relayed(self) -> list[str]:
        with self._lock:
            return sorted(self._tunnels)

    def tunnel(self, who: str, frames: Iterator[pb.RelayFrame]) -> Iterator[pb.RelayFrame]:
        """Serve the tunnel ``who`` opened (its certificate's id; '' without TLS, when the hello names
        the peer): yields the frames to send down it."""
        hello = next(frames, None)
        if hello is None or hello.call != 0 or hello.header.run_id != self.run_id or (who and hello.header.sender != who):
            raise ValueError("a relay tunnel starts with a hello of this run from the certificate's peer")
        peer = who or hello.header.sender
        tunnel = _Tunnel(peer)
        with self._lock:
            old, self._tunnels[peer] = self._tunnels.get(peer), tunnel
        if old is not None:
            old.close()  # the peer reconnected: calls on the old stream fail, new ones take the new one
        log.info("relaying calls to %s", short_id(peer))
        tunnel.outbox.put(pb.RelayFrame(call=0))  # the tunnel is open: the peer may announce its address

        def read() -> None:
            try:
                for frame in frames:
                    tunnel.deliver(frame)
            except grpc.RpcError:
                pass
            finally:
                tunnel.close()

        threading.Thread(target=read, name=f"relay-{short_id(peer)}", daemon=True).start()
        try:
            while True:
                frame = tunnel.outbox.get()
                if frame is _END:
                    return
                yield frame
        finally:
            tunnel.close()
            with self._lock:
                if self._tunnels.get(peer) is tunnel:
                    del self._tunnels[peer]
            log.info("stopped relaying calls to %s", short_id(peer))

    def forward(self, target: str, method: str, caller: str, requests: Iterable[bytes],
                deadline: float) -> Iterator[bytes]:
        """Send one call down ``target``'s tunnel; yields its reply messages. Raises :class:`RelayError`."""
        with self._lock:
            tunnel = self._tunnels.get(target)
        if tunnel is None or tunnel.closed.is_set():
            raise RelayError(grpc.StatusCode.UNAVAILABLE, f"{short_id(target)} holds no tunnel to this relay")
        call_id, call = next(self._ids), _Call()
        with tunnel.lock:
            tunnel.calls[call_id] = call
        try:
            first = True
            for message in requests:
                self._put(tunnel, pb.RelayFrame(call=call_id, method=method if first else "",
                                                caller=caller if first else "", message=message), deadline)
                first = False
            self._put(tunnel, pb.RelayFrame(call=call_id, method=method if first else "",
                                            caller=caller if first else "", end=True), deadline)
            while True:
                try:
                    frame = call.replies.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise RelayError(grpc.StatusCode.DEADLINE_EXCEEDED, "the relayed peer did not answer in time") from None
                if frame.message:
                    yield frame.message
                if frame.end:
                    if frame.status:
                        raise RelayError(_CODES.get(frame.status, grpc.StatusCode.UNKNOWN), frame.details, frame.refusal)
                    return
        finally:
            with tunnel.lock:
                tunnel.calls.pop(call_id, None)

    @staticmethod
    def _put(tunnel: _Tunnel, frame: pb.RelayFrame, deadline: float) -> None:
        while not tunnel.closed.is_set():
            try:
                tunnel.outbox.put(frame, timeout=min(0.5, max(0.01, deadline - time.monotonic())))
                return
            except queue.Full:
                if time.monotonic() >= deadline:
                    raise RelayError(grpc.StatusCode.DEADLINE_EXCEEDED, "the relayed peer's tunnel is full") from None
        raise RelayError(grpc.StatusCode.UNAVAILABLE, "the relayed peer's tunnel closed")


# ------------------------------------------------------------------------------------ relayed peer side


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, refusal: bytes) -> None:
        super().__init__(details)
        self.code, self.details, self.refusal = code, details, refusal


class RelayedContext:
    """What a servicer method needs of a gRPC context, for a call that came through the relay: the
    caller is the one the relay authenticated, and ``abort`` ends the relayed call with that status."""

    def __init__(self, caller: str, deadline: float, refusal_key: str) -> None:
        self.caller, self.deadline, self.refusal_key = caller, deadline, refusal_key
        self._trailing: tuple = ()

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_common_name": [self.caller.encode()]} if self.caller else {}

    def peer(self) -> str:
        return f"relay:{self.caller}:0"

    def invocation_metadata(self) -> tuple:
        return ()

    def time_remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def set_trailing_metadata(self, metadata: tuple) -> None:
        self._trailing = tuple(metadata)

    def abort(self, code: grpc.StatusCode, details: str) -> Any:
        refusal = next((v for k, v in self._trailing if k == self.refusal_key), b"")
        raise _Aborted(code, details, refusal)


class _PeerTunnel:
    """One connection to the relay: its outgoing frames and the calls it carries. Calls served for it send their
    replies into it only; once it is closed (broken, replaced or stopped) they are dropped, not sent into the
    next tunnel, whose call ids mean other calls."""

    def __init__(self) -> None:
        self.outbox: queue.Queue = queue.Queue(WINDOW)
        self.calls: dict[int, _Incoming] = {}  # the tunnel thread's own
        self.closed = threading.Event()

    def send(self, frame: pb.RelayFrame) -> None:
        while not self.closed.is_set():
            try:
                self.outbox.put(frame, timeout=0.5)  # (bounded: a slow relay holds the repliers back)
                return
            except queue.Full:
                continue

    def close(self) -> None:
        self.closed.set()
        try:
            self.outbox.put_nowait(_END)
        except queue.Full:
            pass


@dataclass
class _Incoming:
    method: Method
    caller: str
    messages: queue.Queue = field(default_factory=lambda: queue.Queue(WINDOW))


class RelayClient:
    """The relayed peer's side: keeps a tunnel to the relay open and serves the calls that come down it.

    ``open_stream(frames)`` opens ``PeerService.Relay`` with the frames to send and returns the frames
    received; ``servicer`` is the object a PeerServer would serve (its methods take a request or an
    iterator of them and a context), ``parser(cls)`` what parses its requests (a malformed one is
    refused by the servicer, as on a direct call). Calls run concurrently on a pool of their own.
    """

    CALL_TIMEOUT_S = 600.0

    def __init__(self, open_stream: Callable[[Iterator[pb.RelayFrame]], Iterator[pb.RelayFrame]], servicer: object,
                 parser: Callable[[type], Callable[[bytes], Any]], run_id: str, me: str, refusal_key: str,
                 workers: int = 32) -> None:
        self.open_stream, self.servicer, self.parser, self.run_id, self.me = open_stream, servicer, parser, run_id, me
        self.refusal_key, self.stopping = refusal_key, threading.Event()
        self.connected = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="relayed")
        self._thread = threading.Thread(target=self._run, name="relay-tunnel", daemon=True)
        self._lock = threading.Lock()  # guards _tunnel (replaced by the tunnel thread on every reconnect)
        self._tunnel = _PeerTunnel()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        with self._lock:
            tunnel = self._tunnel
        tunnel.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        wait = RECONNECT_S[0]
        while not self.stopping.is_set():
            tunnel = _PeerTunnel()
            with self._lock:
                self._tunnel = tunnel
            try:
                for frame in self.open_stream(self._frames(tunnel.outbox)):
                    if frame.call == 0:  # the relay took the tunnel
                        self.connected.set()
                        wait = RECONNECT_S[0]
                        log.info("the relay tunnel is open")
                        continue
                    self._on_frame(frame, tunnel)
            except grpc.RpcError as err:
                log.warning("the relay tunnel broke (%s: %s); reopening in %.1f s", err.code(), err.details(), wait)  # type: ignore[attr-defined]
            self.connected.clear()
            tunnel.close()  # its calls' late replies are dropped: they never reach the next tunnel
            for incoming in tunnel.calls.values():
                incoming.messages.put(_END)
            if self.stopping.wait(wait):
                return
            wait = min(RECONNECT_S[1], 2 * wait)

    def _frames(self, outbox: queue.Queue) -> Iterator[pb.RelayFrame]:
        yield pb.RelayFrame(call=0, header=pb.Header(run_id=self.run_id, sender=self.me))
        while not self.stopping.is_set():
            try:
                frame = outbox.get(timeout=0.5)
            except queue.Empty:
                continue
            if frame is _END:
                return
            yield frame

    def _on_frame(self, frame: pb.RelayFrame, tunnel: _PeerTunnel) -> None:
        calls = tunnel.calls
        incoming = calls.get(frame.call)
        if incoming is None:
            method = METHODS.get(frame.method)
            if method is None:
                tunnel.send(pb.RelayFrame(call=frame.call, end=True, status=grpc.StatusCode.UNIMPLEMENTED.value[0],
                                         details=f"unknown method {frame.method[:64]!r}"))
                return
            incoming = calls[frame.call] = _Incoming(method, frame.caller)
            self._pool.submit(self._serve, tunnel, frame.call, incoming)
        if frame.message:
            incoming.messages.put(frame.message)
        if frame.end:
            incoming.messages.put(_END)
            calls.pop(frame.call, None)

    def _requests(self, incoming: _Incoming) -> Iterator[Any]:
        parse = self.parser(incoming.method.request)
        while True:
            message = incoming.messages.get()
            if message is _END:
                return
            yield parse(message)

    def _serve(self, tunnel: _PeerTunnel, call_id: int, incoming: _Incoming) -> None:
        method = incoming.method
        context = RelayedContext(incoming.caller, time.monotonic() + self.CALL_TIMEOUT_S, self.refusal_key)
        handler = getattr(self.servicer, method.name)
        requests = self._requests(incoming)
        try:
            if method.client_streaming:
                replies: Iterable[Any] = [handler(requests, context)]
            else:
                request = next(requests, None)
                if request is None:
                    raise _Aborted(grpc.StatusCode.INVALID_ARGUMENT, "a relayed call without its request", b"")
                replies = handler(request, context)
                replies = replies if method.server_streaming else [replies]
            for reply in replies:
                tunnel.send(pb.RelayFrame(call=call_id, message=reply.SerializeToString()))
            tunnel.send(pb.RelayFrame(call=call_id, end=True))
        except _Aborted as err:
            tunnel.send(pb.RelayFrame(call=call_id, end=True, status=err.code.value[0], details=err.details,
                                     refusal=err.refusal))
        except Exception as err:  # one call's failure must not end the tunnel
            log.exception("relayed %s failed", method.name)
            tunnel.send(pb.RelayFrame(call=call_id, end=True, status=grpc.StatusCode.INTERNAL.value[0],
                                     details=f"{method.name} failed: {err}"))
