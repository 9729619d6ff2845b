"""Flat float32 vectors <-> streams of ``potluck.v1.Tensor`` chunks, checked on the way in.

A sender cuts a vector into chunks of at most ``chunk_bytes`` of payload, aligned to the codec's
block, and encodes each independently. A receiver feeds chunks to an :class:`Assembler`, which
checks each one against what it expects (name, dtype, shape, codec, bit width, position) and
decodes it into a private buffer; the vector is handed over only when every element arrived exactly
once. Any mismatch raises :class:`WireError` and the partial buffer is dropped with it, so a bad
stream never changes the receiver's state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future

import torch
from blake3 import blake3

from potluck.compression.int8 import Codec, CodecError, Encoded
from potluck.protos import potluck_pb2 as pb


class WireError(ValueError):
    """A tensor stream that does not match what the receiver expects."""


def chunk_elements(codec: Codec, chunk_bytes: int) -> int:
    """Elements of a chunk: as many whole ``align``-blocks as ``chunk_bytes`` of payload hold (at least one).
    A codec's ``bytes_per_element`` may be a fraction (int4: 0.5), the count is a whole number of blocks."""
    fit = int(chunk_bytes // codec.bytes_per_element)
    return max(codec.align, fit // codec.align * codec.align)


def tensor_digest(t: pb.Tensor, held: Encoded | None = None) -> bytes:
    """One chunk of a result, every field, lengths first (no serialized copy of the payload just to hash
    it). Chunks are hashed where they are made, on the codec workers, or as they arrive, while the next
    one is on the wire: a signed result is one short hash over these, not one long pass at the end. BLAKE3 in its
    key-derivation mode (its context string separates these digests from any other): 5.7 GB/s a thread on this
    project's machines against BLAKE2b's 0.9 GB/s, and every byte of the all-reduce is hashed where it is made and
    where it arrives. ``held``: ``t``'s codes and scales as bytes already in hand (the codec's output it was made
    from, or what :meth:`Assembler.add` decoded): each read of a bytes field copies it out of the message, a
    megabyte a chunk."""
    h = blake3(derive_key_context="potluck 2026-12-02 all-reduce chunk")
    scales, payload = (held.scales, held.payload) if held is not None else (t.scales, t.payload)
    h.update(f"|{t.name}|{t.dtype}|{list(t.shape)}|{t.codec}|{t.offset}|{t.numel}|{t.bits}|{len(scales)}|"
             f"{len(payload)}|".encode())
    h.update(scales)
    h.update(payload)
    return h.digest()


def encode_chunks(name: str, x: torch.Tensor, codec: Codec, chunk_bytes: int) -> Iterator[pb.Tensor]:
    """Encode a flat vector as a sequence of chunks (at least one, even for an empty vector)."""
    return iter(EncodedStream.of(name, x, codec, chunk_bytes))


class EncodedStream:
    """A flat vector's chunks, each encoded ``ahead`` chunks before it is taken (PRIME's double buffer).

    With a ``pool``, chunk ``i + 1`` is quantized on a worker while chunk ``i`` is on the wire, and
    several chunks are encoded at once on a machine with cores to spare. The vector may be given as
    ``piece(lo, hi)``, called once per chunk on the worker, so a value computed a chunk at a time (an
    owner's average) is summed and re-quantized chunk by chunk, never held whole in float32 twice.
    Encoded chunks are kept: iterating again (a re-send, a backup) encodes nothing again. The chunks
    are those of :func:`encode_chunks` for the same values, bit for bit.
    """

    def __init__(self, name: str, numel: int, piece: Callable[[int, int], torch.Tensor], codec: Codec, chunk_bytes: int,
                 pool: Executor | None = None, ahead: int = 2) -> None:
        self.name, self.numel, self.piece, self.codec, self.pool, self.ahead = name, numel, piece, codec, pool, ahead
        step = chunk_elements(codec, chunk_bytes)
        self.bounds = [(lo, min(numel, lo + step)) for lo in range(0, numel, step)] or [(0, 0)]
        self._chunks: list[Future[pb.Tensor] | None] = [None] * len(self.bounds)
        self._digests: list[bytes | None] = [None] * len(self.bounds)
        self._lock = threading.Lock()

    @classmethod
    def of(cls, name: str, x: torch.Tensor, codec: Codec, chunk_bytes: int, pool: Executor | None = None) -> EncodedStream:
        flat = x.detach().reshape(-1).to("cpu", torch.float32)
        return cls(name, flat.numel(), lambda lo, hi: flat[lo:hi], codec, chunk_bytes, pool)

    def _encode(self, k: int) -> pb.Tensor:
        lo, hi = self.bounds[k]
        enc = self.codec.encode(self.piece(lo, hi))
        t = pb.Tensor(name=self.name, dtype="float32", shape=[self.numel], codec=enc.codec, scales=enc.scales,
                      payload=enc.payload, offset=lo, numel=hi - lo, bits=enc.bits)
        self._digests[k] = tensor_digest(t, enc)  # (on the worker, from the codec's bytes: no copy out of t)
        return t

    def digest(self, k: int) -> bytes:
        """Chunk ``k``'s :func:`tensor_digest` (encoding it if it is not yet)."""
        self._future(k).result()
        digest = self._digests[k]
        assert digest is not None
        return digest

    def digests(self) -> list[bytes]:
        return [self.digest(k) for k in range(len(self.bounds))]

    def _future(self, k: int) -> Future[pb.Tensor]:
        with self._lock:
            fut = self._chunks[k]
            if fut is None:
                if self.pool is not None:
                    fut = self.pool.submit(self._encode, k)
                else:
                    fut = Future()
                    fut.set_result(self._encode(k))
                self._chunks[k] = fut
            return fut

    def __iter__(self) -> Iterator[pb.Tensor]:
        for k in range(len(self.bounds)):
            if self.pool is not None:
                for j in range(k + 1, min(len(self.bounds), k + 1 + self.ahead)):
                    self._future(j)
            yield self._future(k).result()

    def __len__(self) -> int:
        return len(self.bounds)


class Assembler:
    """Rebuilds elements ``[start, stop)`` of a flat float32 vector of a known name, size and codec.

    Chunks carry offsets into the whole vector and must arrive in order; by default the assembler
    expects the whole vector.
    """

    def __init__(self, name: str, numel: int, codec: Codec, start: int = 0, stop: int | None = None,
                 out: torch.Tensor | None = None) -> None:
        self.name, self.numel, self.codec = name, numel, codec
        self.start = start
        self.stop = numel if stop is None else stop
        if not 0 <= self.start <= self.stop <= numel:
            raise ValueError(f"range [{start}, {stop}) is outside [0, {numel})")
        if out is not None and (out.dtype != torch.float32 or out.shape != (self.stop - self.start,)):
            raise ValueError(f"an output of {self.stop - self.start} float32 is needed, got {out.dtype} {tuple(out.shape)}")
        self.buffer = out if out is not None else torch.empty(self.stop - self.start, dtype=torch.float32)
        self.filled = self.start

    def add(self, t: pb.Tensor) -> Encoded:
        """Check and decode chunk ``t``; returns its codes and scales as read out of it (for :func:`tensor_digest`)."""
        if t.name != self.name:
            raise WireError(f"expected tensor {self.name!r}, got {t.name!r}")
        if t.dtype != "float32":
            raise WireError(f"{self.name}: expected dtype float32, got {t.dtype!r}")
        if list(t.shape) != [self.numel]:
            raise WireError(f"{self.name}: expected shape [{self.numel}], got {list(t.shape)}")
        if t.codec != self.codec.name:
            raise WireError(f"{self.name}: expected codec {self.codec.name!r}, got {t.codec!r}")
        if t.bits != self.codec.bits:
            raise WireError(f"{self.name}: codec {t.codec} takes {self.codec.bits}-bit codes, got bits={t.bits}")
        if t.offset != self.filled:
            raise WireError(f"{self.name}: chunk at offset {t.offset}, expected {self.filled} (chunks must arrive in order)")
        if (t.numel <= 0 and self.stop > self.start) or t.numel < 0 or t.offset + t.numel > self.stop:
            raise WireError(f"{self.name}: chunk [{t.offset}, {t.offset + t.numel}) is outside [{self.start}, {self.stop})")
        if t.offset % self.codec.align:
            raise WireError(f"{self.name}: chunk offset {t.offset} is not a multiple of {self.codec.align}")
        lo = t.offset - self.start
        enc = Encoded(t.codec, t.numel, t.payload, t.scales, t.bits)
        try:  # straight into the buffer: a chunk that fails its checks leaves it as it was
            self.codec.decode_into(enc, self.buffer[lo : lo + t.numel])
        except CodecError as err:
            raise WireError(f"{self.name}: {err}") from None
        self.filled += t.numel
        return enc

    @property
    def complete(self) -> bool:
        return self.filled == self.stop

    def result(self) -> torch.Tensor:
        if not self.complete:
            raise WireError(f"{self.name}: stream ended at element {self.filled} of [{self.start}, {self.stop})")
        return self.buffer
