"""An emulated wide-area network inside the gRPC transport, for tests, demos and benchmarks.

The kernel has no ``netem`` here, so the transport emulates one. A topology file names regions and
gives every region pair a one-way delay and a bandwidth (a region to itself included); each process
is started in one region. A client tags every call with its region and a node id (gRPC metadata
``x-potluck-region``, ``x-potluck-node``); the server's interceptor then plays the network for that
call: a message of ``n`` bytes from region ``a`` to region ``b`` is delivered
``delay(a, b) + n / bandwidth(a, b)`` after it was sent, and the reply travels back the same way on
the ``b -> a`` link. So a Ping's round trip is about ``delay(a, b) + delay(b, a)`` and a transfer
of ``B`` bytes takes about ``B / bandwidth`` plus one delay.

Each directed link between two *nodes* (not regions) is a FIFO pipe: messages occupy it one
after another, in slices of about 5 ms of transmission, so concurrent calls between the same two
nodes interleave and share the bandwidth instead of each getting all of it. Transmission is
scheduled on a virtual timeline and only *slept* through, so a late wake-up of a thread does not
lower the emulated bandwidth. Streams are pipelined: the propagation delay is paid once per
message in flight, not once per message in sequence, and each message's transmission is booked the
moment it is ready, so a stream's next message never loses its place on the link to another call's
message that was ready after it. Each server models the links of the calls it
serves, so links are pairwise (a peer pushing to ten peers at once gets the full rate to each; no
shared uplink), and calls that two peers make to each other use separate pipes.

NetemTopology file (JSON); ``delay_ms`` and ``bandwidth_mbps`` are either square matrices in the order
of ``regions`` or nested dicts ``{from: {to: value}}`` where a missing ``(a, b)`` falls back to
``(b, a)``; ``peers`` optionally maps peer names or start indices to regions::

    {"regions": ["eu", "us"],
     "delay_ms": [[1, 40], [40, 1]],
     "bandwidth_mbps": {"eu": {"eu": 1000, "us": 50}, "us": {"us": 1000}},
     "peers": {"peer-0": "eu", "1": "us"}}

Without a :class:`NetEm` nothing of this is installed: the transport has no interceptor at all.
"""

from __future__ import annotations

import json
import math
import queue
import secrets
import threading
import time
from collections import namedtuple
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from potluck.protos.runtime.log import get_logger

log = get_logger(__name__)

REGION_KEY = "x-potluck-region"
NODE_KEY = "x-potluck-node"
_QUANTUM_S = 0.005  # transmission time of one slice: the granularity at which concurrent calls interleave
_MIN_SLICE = 4096
# a stream's bytes in flight (booked on the link, not yet taken by the reader): a window, as TCP's and HTTP/2's are
# (theirs grow to the link's bandwidth x delay; 16 MiB is 1.3 s of delay at 100 Mbps). A full window holds the sender
# back; a message bigger than the window goes alone. Bytes, not messages: many small ones cost no more than one big one
_WINDOW_BYTES = 16 << 20


class NetemTopologyError(ValueError):
    """A topology file that cannot describe a network; the message says where and why."""


class LinkSpec(NamedTuple):
    delay_s: float
    bytes_per_s: float


class NetemTopology:
    """Regions and the directed links between them; validated on construction."""

    def __init__(self, regions: list[str], delay_ms: list[list[float]], bandwidth_mbps: list[list[float]],
                 peers: Mapping[str, str] | None = None, source: str = "topology") -> None:
        self.regions, self.source = list(regions), source
        self._index = {r: i for i, r in enumerate(self.regions)}
        self.delay_ms, self.bandwidth_mbps = delay_ms, bandwidth_mbps
        self.peers = dict(peers or {})
        for name, region in self.peers.items():
            if region not in self._index:
                raise NetemTopologyError(f"{source}: peer {name!r} is placed in unknown region {region!r} "
                                    f"(regions: {', '.join(self.regions)})")

    @classmethod
    def from_dict(cls, data: Any, source: str = "topology") -> NetemTopology:
        if not isinstance(data, dict):
            raise NetemTopologyError(f"{source}: expected a JSON object, got {type(data).__name__}")
        for field in ("delay_ms", "bandwidth_mbps"):
            if field not in data:
                raise NetemTopologyError(f"{source}: missing {field!r}")
        regions = data.get("regions")
        if regions is None and isinstance(data["delay_ms"], dict):
            regions = list(data["delay_ms"])
        if not isinstance(regions, list) or not regions or not all(isinstance(r, str) and r for r in regions):
            raise NetemTopologyError(f"{source}: 'regions' must be a non-empty list of region names")
        if len(set(regions)) != len(regions):
            raise NetemTopologyError(f"{source}: duplicate region names in {regions}")
        delay = _square(data["delay_ms"], regions, "delay_ms", source)
        bandwidth = _square(data["bandwidth_mbps"], regions, "bandwidth_mbps", source)
        for i, a in enumerate(regions):
            for j, b in enumerate(regions):
                if delay[i][j] < 0:
                    raise NetemTopologyError(f"{source}: delay_ms[{a}][{b}] = {delay[i][j]:g}; delays must be >= 0")
                if bandwidth[i][j] <= 0:
                    raise NetemTopologyError(f"{source}: bandwidth_mbps[{a}][{b}] = {bandwidth[i][j]:g}; "
                                        "bandwidth must be > 0")
        peers = data.get("peers", {})
        if not isinstance(peers, dict):
            raise NetemTopologyError(f"{source}: 'peers' must map peer names or indices to regions")
        return cls(regions, delay, bandwidth, {str(k): v for k, v in peers.items()}, source)

    @classmethod
    def from_file(cls, path: str | Path) -> NetemTopology:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as err:
            raise NetemTopologyError(f"cannot read topology file {path}: {err.strerror or err}") from None
        except json.JSONDecodeError as err:
            raise NetemTopologyError(f"topology file {path} is not valid JSON: {err}") from None
        return cls.from_dict(data, source=str(path))

    def check_region(self, region: str) -> str:
        if region not in self._index:
            raise NetemTopologyError(f"{self.source}: unknown region {region!r} (regions: {', '.join(self.regions)})")
        return region

    def region_of(self, peer: str | int) -> str | None:
        """The region the ``peers`` map gives a peer name or start index, if any."""
        return self.peers.get(str(peer))

    def link(self, src: str, dst: str) -> LinkSpec:
        i, j = self._index[self.check_region(src)], self._index[self.check_region(dst)]
        return LinkSpec(self.delay_ms[i][j] / 1e3, self.bandwidth_mbps[i][j] * 1e6 / 8)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise NetemTopologyError(f"{where} = {value!r} is not a finite number")
    return float(value)


def _square(value: Any, regions: list[str], field: str, source: str) -> list[list[float]]:
    """A ``len(regions)``-square matrix from either accepted form."""
    n = len(regions)
    if isinstance(value, list):
        if len(value) != n or not all(isinstance(row, list) and len(row) == n for row in value):
            shape = [len(row) if isinstance(row, list) else "?" for row in value]
            raise NetemTopologyError(f"{source}: {field} must be a {n}x{n} matrix (one row and column per region "
                                f"{regions}), got rows of lengths {shape}")
        return [[_number(v, f"{source}: {field}[{regions[i]}][{regions[j]}]") for j, v in enumerate(row)]
                for i, row in enumerate(value)]
    if not isinstance(value, dict):
        raise NetemTopologyError(f"{source}: {field} must be a matrix or a dict {{from: {{to: value}}}}")
    for a, row in value.items():
        if a not in regions:
            raise NetemTopologyError(f"{source}: {field} names unknown region {a!r} (regions: {', '.join(regions)})")
        if not isinstance(row, dict):
            raise NetemTopologyError(f"{source}: {field}[{a}] must be a dict {{to: value}}")
        for b in row:
            if b not in regions:
                raise NetemTopologyError(f"{source}: {field}[{a}] names unknown region {b!r} "
                                    f"(regions: {', '.join(regions)})")
    out = []
    for a in regions:
        row = []
        for b in regions:
            v = value.get(a, {}).get(b, value.get(b, {}).get(a))
            if v is None:
                raise NetemTopologyError(f"{source}: {field} has no value for {a} -> {b} (nor {b} -> {a})")
            row.append(_number(v, f"{source}: {field}[{a}][{b}]"))
        out.append(row)
    return out


def _sleep_until(t: float) -> None:
    left = t - time.monotonic()
    if left > 0:
        time.sleep(left)


class Link:
    """One directed node-to-node link: a FIFO pipe of ``bytes_per_s`` with ``delay_s`` propagation."""

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self._lock = threading.Lock()
        self._free_at = 0.0

    def send(self, nbytes: int, ready_at: float) -> float:
        """Transmit ``nbytes`` made ready at ``ready_at`` (monotonic); returns when they arrive.

        Blocks while the message is on the wire, slice by slice, so that other senders on the same
        link take their turns in between; does not wait for the propagation delay (the caller does).
        """
        bw = self.spec.bytes_per_s
        slice_bytes = max(_MIN_SLICE, int(bw * _QUANTUM_S))
        t, left = ready_at, nbytes
        while True:
            n = min(left, slice_bytes)
            with self._lock:
                t = self._free_at = max(t, self._free_at) + n / bw
            left -= n
            if left <= 0:
                return t + self.spec.delay_s
            _sleep_until(t)

    def deliver(self, nbytes: int, ready_at: float) -> float:
        """Like :meth:`send`, then wait until the message arrives; returns the arrival time."""
        arrival = self.send(nbytes, ready_at)
        _sleep_until(arrival)
        return arrival


def _size(message: Any) -> int:
    return int(message.ByteSize()) if hasattr(message, "ByteSize") else 0


class NetEm:
    """This process's place in an emulated network: its region, the topology and its links.

    Give the same object to the process's :class:`~potluck.protos.net.transport.PeerServer` and
    :class:`~potluck.protos.net.transport.PeerClient`. ``node`` identifies this process on the links
    its peers keep for it (a random id by default).
    """

    def __init__(self, topology: NetemTopology, region: str, node: str | None = None) -> None:
        self.topology = topology
        self.region = topology.check_region(region)
        self.node = node or secrets.token_hex(8)
        self._lock = threading.Lock()
        self._links: dict[tuple[str, str], tuple[Link, Link]] = {}
        self._unknown: set[str] = set()

    @classmethod
    def from_file(cls, path: str | Path, region: str = "", peer: str | int | None = None) -> NetEm:
        """Load a topology; the region is ``region`` if given, else the one the file gives ``peer``."""
        topology = NetemTopology.from_file(path)
        if not region and peer is not None:
            region = topology.region_of(peer) or ""
        if not region:
            who = f"peer {peer!r} is not in its 'peers' map" if peer is not None else "no region was given"
            raise NetemTopologyError(f"{path}: {who}; set the peer's region to one of {', '.join(topology.regions)}")
        return cls(topology, region)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((REGION_KEY, self.region), (NODE_KEY, self.node))

    def client_interceptor(self) -> grpc.UnaryUnaryClientInterceptor:
        return _TagCalls(self.metadata())

    def server_interceptor(self) -> grpc.ServerInterceptor:
        return _EmulateLinks(self)

    def links_from(self, region: str, node: str) -> tuple[Link, Link] | None:
        """(incoming, outgoing) links with a client node in ``region``; None for unknown regions."""
        key = (node, region)
        with self._lock:
            pair = self._links.get(key)
            if pair is None:
                if region not in self.topology.regions:
                    if region not in self._unknown:
                        self._unknown.add(region)
                        log.warning("calls from region %r are not emulated: %s does not know it",
                                    region, self.topology.source)
                    return None
                pair = self._links[key] = (Link(self.topology.link(region, self.region)),
                                           Link(self.topology.link(self.region, region)))
            return pair


class _CallDetails(namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                               "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class _TagCalls(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Client side: add this process's region and node to every call's metadata."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _tag(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, tuple(d.metadata or ()) + self._metadata, d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._tag(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._tag(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._tag(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._tag(client_call_details), request_iterator)


class _EmulateLinks(grpc.ServerInterceptor):
    """Server side: delay and pace each tagged call's messages over its client's links."""

    def __init__(self, netem: NetEm) -> None:
        self.netem = netem

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        meta = dict(handler_call_details.invocation_metadata or ())
        region, node = meta.get(REGION_KEY), meta.get(NODE_KEY, "")
        if handler is None or region is None:
            return handler
        links = self.netem.links_from(region, node)
        if links is None:
            return handler
        inbound, outbound = links
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary, inbound, outbound), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_unary(handler.unary_stream, inbound, outbound, True), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_streamed(handler.stream_unary, inbound, outbound), **kw)
        return grpc.stream_stream_rpc_method_handler(_streamed(handler.stream_stream, inbound, outbound, True), **kw)


def _unary(behavior: Callable, inbound: Link, outbound: Link, streaming_reply: bool = False) -> Callable:
    def run(request, context):  # type: ignore[no-untyped-def]
        inbound.deliver(_size(request), time.monotonic())
        return _reply(behavior, request, context, outbound, streaming_reply)
    return run


def _streamed(behavior: Callable, inbound: Link, outbound: Link, streaming_reply: bool = False) -> Callable:
    def run(request_iterator, context):  # type: ignore[no-untyped-def]
        return _reply(behavior, _arrivals(request_iterator, context, inbound), context, outbound, streaming_reply)
    return run


def _reply(behavior: Callable, request: Any, context: grpc.ServicerContext, outbound: Link, streaming: bool) -> Any:
    if streaming:
        return _paced(behavior(request, context), outbound, context)
    try:
        reply = behavior(request, context)
    except Exception:  # an error status crosses the network too
        _sleep_until(time.monotonic() + outbound.spec.delay_s)
        raise
    outbound.deliver(_size(reply), time.monotonic())
    return reply


def _paced(replies: Iterator, outbound: Link, context: grpc.ServicerContext) -> Iterator:
    """Yield a handler's replies as they arrive at the client, without holding the handler back.

    A generator handler only produces its next message when asked. A thread asks it as soon as the
    previous message has left the (emulated) wire, and puts each message on the link then, so its
    transmission is booked when it was ready; the stream gRPC reads sleeps only through each one's
    propagation. (Booking a message only after the previous one had *arrived* let another call on the
    same link take its place in the meantime: a stream's second message then waited up to a whole
    delay behind a message that was ready after it.)
    """
    return _in_flight(iter(replies), lambda m, ready: outbound.send(_size(m), ready),
                      outbound.spec.delay_s, context.is_active, "netem-replies")


def _in_flight(source: Iterator, book: Callable[[Any, float], float], delay_s: float, active: Callable[[], bool],
               name: str) -> Iterator:
    """``source``'s messages at their emulated arrival times.

    A thread takes each message from ``source`` when it is ready (the moment ``next`` returns) and books its
    transmission at once (``book(message, ready)`` blocks while it is on the wire and returns its arrival), so the
    link sees a stream's messages in the order and at the times they were ready; what it yields, it yields at
    arrival. At most ``_WINDOW_BYTES`` are in flight per stream (booked, not yet taken by the reader). An error
    from ``source`` reaches the caller one ``delay_s`` after it was raised, as an error status crosses the network.
    """
    box: queue.Queue = queue.Queue()  # (arrival, message or _END or an error, its bytes in the window)
    stop = threading.Event()
    window = threading.Condition()
    held = 0  # bytes in the window; guarded by ``window``

    def reserve(nbytes: int) -> bool:
        """Wait until ``nbytes`` more fit the window (or it is empty); False if the stream ended meanwhile."""
        nonlocal held
        with window:
            while held and held + nbytes > _WINDOW_BYTES:
                if stop.is_set() or not active():
                    return False
                window.wait(0.2)
            held += nbytes
            return True

    def run() -> None:
        try:
            while not stop.is_set():
                try:
                    m = next(source)
                except StopIteration:
                    box.put((0.0, _END, 0))
                    return
                n = _size(m)
                if not reserve(n):
                    return
                box.put((book(m, time.monotonic()), m, n))
        except Exception as err:  # the call was cancelled or broke, or the handler failed: the reader sees it
            box.put((time.monotonic() + delay_s, err, 0))
        finally:
            close = getattr(source, "close", None)
            if stop.is_set() and close is not None:
                close()  # (a reply generator the client stopped reading: its handler's finally blocks run)

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    try:
        while True:
            try:
                arrival, m, n = box.get(timeout=0.2)
            except queue.Empty:
                if worker.is_alive() or not box.empty():
                    continue
                raise RuntimeError("the stream ended without its end (call cancelled)") from None
            if m is _END:
                return
            _sleep_until(arrival)
            with window:
                held -= n
                window.notify_all()
            if isinstance(m, Exception):
                raise m
            yield m
    finally:
        stop.set()


_END = object()


def _arrivals(requests: Iterator, context: grpc.ServicerContext, inbound: Link) -> Iterator:
    """Hand a client stream's messages to the handler when they arrive over the emulated link.

    gRPC delivers them over loopback at once; a thread takes them as they come and books each one's
    transmission then, which is when the client sent it (see :func:`_in_flight`).
    """
    return _in_flight(iter(requests), lambda m, ready: inbound.send(_size(m), ready), 0.0, context.is_active,
                      "netem-reader")
