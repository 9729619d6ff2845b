"""A pipeline message on the wire: a head, then its body in pieces of bounded size.

A micro-batch of a real model is tens of MB (a 1B model's is 4 x 2048 x 2048 values); no gRPC
message may be that large, and none needs to be. :class:`Outbound` is an encoded message as its
sender holds it: the :class:`~potluck.protos.potluck_pb2.PipeMessage` with its bulk fields left
empty (the *head*: run, sender, step, kind, sample ids, versions, packet shapes and modes) and those
fields' bytes beside it, in the order of :data:`BODY`. :meth:`Outbound.chunks` yields the head,
then the body in pieces of at most :data:`~potluck.protos.wire.limits.PIPE_CHUNK_BYTES`; gRPC's flow control paces the
generator, so a slow receiver holds the sender to the pieces in flight, never a second copy.

:func:`receive` is the other side. It reads the head and hands it, with the sizes it declares, to
the caller's check (sender, round, shapes, and sizes against what those shapes need) *before* it
reads a byte of the body, so a message it would refuse costs nothing and no declared size can make
it allocate more than the run's own shapes. The body lands in one buffer allocated once; the
packets it returns are views into that buffer (no second copy), and nothing is decoded until the
whole body has arrived: AC-SGD's buffers move once per whole message or not at all.

The head is the one part whose size grows with the run (its sample ids and versions): its bound,
:func:`potluck.protos.wire.limits.pipe_head_bound`, is checked against the transport's cap when the run is checked
(:mod:`potluck.protos.config.runcheck`), not at step 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from potluck.compression.actcodec import Packet
from potluck.protos import potluck_pb2 as pb
from potluck.protos.wire.limits import PIPE_CHUNK_BYTES
from potluck.protos.wire.refusals import Rejected

BODY = ("labels", "first.scales", "first.payload", "delta.scales", "delta.payload")


@dataclass
class Outbound:
    """An encoded pipeline message: the head and the bytes of its bulk fields, in :data:`BODY` order."""

    head: pb.PipeMessage
    body: tuple[bytes, ...]  # one per field of BODY

    @property
    def nbytes(self) -> int:
        return self.head.ByteSize() + sum(len(b) for b in self.body)

    def chunks(self, chunk_bytes: int = PIPE_CHUNK_BYTES) -> Iterator[pb.PipeChunk]:
        """The head, then the body in pieces of at most ``chunk_bytes``; a fresh generator per call (a retry)."""
        yield pb.PipeChunk(head=self.head, body_bytes=[len(b) for b in self.body])
        for part in self.body:
            view = memoryview(part)
            for k in range(0, len(view), chunk_bytes):
                yield pb.PipeChunk(data=bytes(view[k : k + chunk_bytes]))


def outbound(msg: pb.PipeMessage) -> Outbound:
    """Split a whole message into head and body (the bulk fields move out of ``msg``, which becomes the head)."""
    body = (msg.labels, msg.first.scales, msg.first.payload, msg.delta.scales, msg.delta.payload)
    msg.labels = b""
    for name in ("first", "delta"):
        if msg.HasField(name):  # (touching an unset one would set it)
            part = getattr(msg, name)
            part.scales, part.payload = b"", b""
    return Outbound(msg, body)


@dataclass
class Inbound:
    """A received message: its head, and views of its body (valid as long as this object is)."""

    head: pb.PipeMessage
    labels: memoryview
    first: Packet | None
    delta: Packet | None
    nbytes: int


def receive(chunks: Iterator[pb.PipeChunk], check: Callable[[pb.PipeMessage, list[int]], None]) -> Inbound:
    """Assemble one message from its pieces. ``check(head, body_bytes)`` raises :class:`Rejected` to refuse it
    before its body is read; a stream that breaks off, or carries more or fewer bytes than its head declared,
    is refused (BAD_MESSAGE) and changes nothing."""
    first = next(chunks, None)
    if first is None or not first.HasField("head"):
        raise Rejected(pb.BAD_MESSAGE, "a pipeline message must begin with its head")
    head, sizes = first.head, list(first.body_bytes)
    sender = head.header.sender[:64]
    if len(sizes) != len(BODY) or any(n < 0 for n in sizes):
        raise Rejected(pb.BAD_MESSAGE, f"a pipeline head must declare {len(BODY)} non-negative body sizes "
                       f"({', '.join(BODY)}), got {sizes[:8]}", sender)
    if head.labels or any(p.scales or p.payload for p in (head.first, head.delta)):
        raise Rejected(pb.BAD_MESSAGE, "a pipeline head carries its bulk fields in the body, not in itself", sender)
    check(head, sizes)  # sender, round and shapes: refused here, nothing is allocated
    total = sum(sizes)
    buf = bytearray(total)
    filled = 0
    for chunk in chunks:
        if chunk.HasField("head") or chunk.body_bytes:
            raise Rejected(pb.BAD_MESSAGE, "a second head in one pipeline message", sender)
        n = len(chunk.data)
        if filled + n > total:
            raise Rejected(pb.BAD_MESSAGE, f"pipeline body longer than the {total} bytes its head declared", sender)
        buf[filled : filled + n] = chunk.data
        filled += n
    if filled != total:
        raise Rejected(pb.BAD_MESSAGE, f"pipeline message ended after {filled} of its {total} bytes", sender)
    view, parts, at = memoryview(buf), [], 0
    for n in sizes:
        parts.append(view[at : at + n])
        at += n
    labels, first_scales, first_payload, delta_scales, delta_payload = parts
    return Inbound(head, labels, _packet(head, "first", first_scales, first_payload),
                   _packet(head, "delta", delta_scales, delta_payload), head.ByteSize() + total)


def _packet(head: pb.PipeMessage, name: str, scales: memoryview, payload: memoryview) -> Packet | None:
    if not head.HasField(name):  # type: ignore[arg-type]
        if len(scales) or len(payload):
            raise Rejected(pb.BAD_MESSAGE, f"body bytes for a {name} packet the head does not have",
                           head.header.sender[:64])
        return None
    p: pb.ActPacket = getattr(head, name)
    return Packet(p.mode, p.bits, tuple(p.shape), p.dtype, scales, payload)  # type: ignore[arg-type]
