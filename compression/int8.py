"""Codecs for the outer all-reduce: int8 with one absmax scale per block, and raw fp32.

The int8 codec cuts a flat float32 vector into blocks of ``block_size`` elements and stores each
as int8 codes plus one float32 scale (:mod:`potluck.kernels.quant`), so the error on any element is
at most ``max|block| / 254`` and the wire cost is ``1 + 4/block_size`` bytes per element (0.25x of
fp32 plus 0.05% at the default block of 2048). Values are never summed while quantized: an owner
decodes every contribution to float32, sums in float32, and quantizes the mean once
(:mod:`potluck.peer.allreduce`).

Decoding checks everything a receiver relies on: the codec, sizes of payload and scales, finite
non-negative scales and finite raw values, and that no decoded value exceeds ``MAX_ABS`` in
magnitude (a scale of 3e38 is finite, but 127 of it is not, nor is a sum of such values). A bad
message raises :class:`CodecError` and produces no tensor, so nothing downstream ever sees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from potluck.kernels.quant import dequantize_rows, quantize_rows

MAX_ABS = 1e6  # no decoded value may be larger: parameters, deltas and activations live far below


class CodecError(ValueError):
    """An encoded tensor that cannot be decoded as claimed."""


@dataclass(frozen=True)
class Encoded:
    """A flat float32 vector as it travels: codec name, element count, codes and side data."""

    codec: str
    numel: int
    payload: bytes
    scales: bytes = b""
    bits: int = 0

    @property
    def nbytes(self) -> int:
        return len(self.payload) + len(self.scales)


class Codec(Protocol):
    name: str
    align: int  # chunks of a stream must start at multiples of this many elements
    bytes_per_element: int  # payload bytes per element (side data not counted)
    bits: int  # bit width of the codes, 0 for unquantized codecs

    def encode(self, x: torch.Tensor) -> Encoded: ...

    def decode(self, enc: Encoded) -> torch.Tensor: ...


def _flat_float(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 1:
        raise CodecError(f"codecs take flat vectors, got shape {tuple(x.shape)}")
    return x.detach().to("cpu", torch.float32).contiguous()


class RawCodec:
    """float32 as-is: the baseline the int8 codec is measured against."""

    name = "raw"
    align = 1
    bytes_per_element = 4
    bits = 0

    def encode(self, x: torch.Tensor) -> Encoded:
        x = _flat_float(x)
        return Encoded(self.name, x.numel(), x.numpy().tobytes())

    def decode(self, enc: Encoded) -> torch.Tensor:
        if enc.codec != self.name:
            raise CodecError(f"expected codec {self.name!r}, got {enc.codec!r}")
        if len(enc.payload) != 4 * enc.numel:
            raise CodecError(f"raw payload of {enc.numel} float32 needs {4 * enc.numel} bytes, got {len(enc.payload)}")
        out = torch.from_numpy(np.frombuffer(enc.payload, dtype=np.float32).copy())
        if not bool(torch.isfinite(out).all()):
            raise CodecError("raw payload holds NaN or Inf")
        if out.numel() and float(out.abs().max()) > MAX_ABS:
            raise CodecError(f"raw payload holds values beyond +-{MAX_ABS:g}")
        return out


class Int8BlockCodec:
    """int8 codes with one float32 absmax scale per ``block_size`` elements."""

    name = "int8"
    bytes_per_element = 1
    bits = 8

    def __init__(self, block_size: int = 2048) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.align = block_size

    def _blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def encode(self, x: torch.Tensor) -> Encoded:
        x = _flat_float(x)
        if not bool(torch.isfinite(x).all()):
            raise CodecError("refusing to encode NaN or Inf")
        n = x.numel()
        pad = self._blocks(n) * self.block_size - n
        padded = torch.nn.functional.pad(x, (0, pad)) if pad else x
        codes, scales = quantize_rows(padded.view(-1, self.block_size), 8)
        return Encoded(
            self.name,
            n,
            codes.view(-1)[:n].numpy().tobytes(),
            scales.numpy().astype(np.float32).tobytes(),
            bits=8,
        )

    def decode(self, enc: Encoded) -> torch.Tensor:
        if enc.codec != self.name:
            raise CodecError(f"expected codec {self.name!r}, got {enc.codec!r}")
        n = enc.numel
        nblocks = self._blocks(n)
        if len(enc.payload) != n:
            raise CodecError(f"int8 payload of {n} elements needs {n} bytes, got {len(enc.payload)}")
        if len(enc.scales) != 4 * nblocks:
            raise CodecError(
                f"int8 payload of {n} elements in blocks of {self.block_size} needs {nblocks} scales "
                f"({4 * nblocks} bytes), got {len(enc.scales)} bytes"
            )
        scales = torch.from_numpy(np.frombuffer(enc.scales, dtype=np.float32).copy())
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise CodecError("int8 scales must be finite and non-negative")
        if scales.numel() and float(scales.max()) * 127 > MAX_ABS:
            raise CodecError(f"int8 scales decode to values beyond +-{MAX_ABS:g}")
        codes = torch.from_numpy(np.frombuffer(enc.payload, dtype=np.int8).copy())
        if bool((codes == -128).any()):
            raise CodecError("int8 code -128 is outside the symmetric range [-127, 127]")
        pad = nblocks * self.block_size - n
        if pad:
            codes = torch.nn.functional.pad(codes, (0, pad))
        return dequantize_rows(codes.view(nblocks, self.block_size), scales).view(-1)[:n].clone()


def make_codec(name: str, block_size: int = 2048) -> Codec:
    if name == "int8":
        return Int8BlockCodec(block_size)
    if name == "raw":
        return RawCodec()
    raise CodecError(f"unknown codec {name!r} (known: int8, raw)")
