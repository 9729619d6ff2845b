"""Codecs for the outer all-reduce: int8 with one absmax scale per block, and raw fp32 (int4, two codes a
byte, is :mod:`potluck.compression.int4`; :func:`make_codec` builds any of them by name).

The int8 codec cuts a flat float32 vector into blocks of ``block_size`` elements and stores each
as int8 codes plus one float32 scale (:mod:`potluck.kernels.quant`), so the error on any element is
at most ``max|block| / 254`` and the wire cost is ``1 + 4/block_size`` bytes per element (0.25x of
fp32 plus 0.05% at the default block of 2048). Values are never summed while quantized: an owner
decodes every contribution to float32, sums in float32, and quantizes the mean once
(:mod:`potluck.peer.reduce.allreduce`).

Decoding checks everything a receiver relies on: the codec, sizes of payload and scales, finite
non-negative scales and finite raw values, and that no decoded value exceeds ``MAX_ABS`` in
magnitude (a scale of 3e38 is finite, but 127 of it is not, nor is a sum of such values). A bad
message raises :class:`CodecError` and produces no tensor, so nothing downstream ever sees it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from potluck.kernels import device as kdevice

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
    bytes_per_element: float  # payload bytes per element (side data not counted; 0.5 for int4)
    bits: int  # bit width of the codes, 0 for unquantized codecs

    def encode(self, x: torch.Tensor) -> Encoded: ...

    def decode(self, enc: Encoded) -> torch.Tensor: ...

    def decode_into(self, enc: Encoded, out: torch.Tensor) -> None: ...


def flat_float(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 1:
        raise CodecError(f"codecs take flat vectors, got shape {tuple(x.shape)}")
    return x.detach().to("cpu", torch.float32).contiguous()


class RawCodec:
    """float32 as-is: the baseline the int8 codec is measured against."""

    name = "raw"
    align = 1
    bytes_per_element: float = 4
    bits = 0

    def encode(self, x: torch.Tensor) -> Encoded:
        x = flat_float(x)
        return Encoded(self.name, x.numel(), x.numpy().tobytes())

    def decode(self, enc: Encoded) -> torch.Tensor:
        out = torch.empty(enc.numel if enc.numel > 0 else 0, dtype=torch.float32)
        self.decode_into(enc, out)
        return out

    def decode_into(self, enc: Encoded, out: torch.Tensor) -> None:
        """Decode into ``out`` (a float32 CPU tensor of ``enc.numel`` elements); on error it is left as it was."""
        if enc.codec != self.name:
            raise CodecError(f"expected codec {self.name!r}, got {enc.codec!r}")
        if len(enc.payload) != 4 * enc.numel:
            raise CodecError(f"raw payload of {enc.numel} float32 needs {4 * enc.numel} bytes, got {len(enc.payload)}")
        values = np.frombuffer(enc.payload, dtype=np.float32)
        if not np.isfinite(values).all():
            raise CodecError("raw payload holds NaN or Inf")
        if values.size and float(np.abs(values).max()) > MAX_ABS:
            raise CodecError(f"raw payload holds values beyond +-{MAX_ABS:g}")
        decode_target(out, enc.numel).numpy()[:] = values


class Int8BlockCodec:
    """int8 codes with one float32 absmax scale per ``block_size`` elements."""

    name = "int8"
    bytes_per_element: float = 1
    bits = 8

    def __init__(self, block_size: int = 2048) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.align = block_size

    def _blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def encode(self, x: torch.Tensor) -> Encoded:
        """Codes and scales of a flat vector; a CUDA vector is quantized where it lies (Triton, same bits)."""
        on_device = kdevice.int8_quantize(x.detach(), self.block_size) if x.dim() == 1 else None
        if on_device is not None:
            copies = [kdevice.start_host_copy(t) for t in on_device]
            codes, scales = (c.wait() for c in copies)
        else:
            codes, scales = self._quantize(flat_float(x))
        if not bool(torch.isfinite(scales).all()):  # a NaN or Inf anywhere makes its block's absmax one
            raise CodecError("refusing to encode NaN or Inf")
        return Encoded(self.name, codes.numel(), codes.numpy().tobytes(), scales.numpy().tobytes(), bits=8)

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference (and CPU path) of :meth:`encode`: codes and scales of a flat float32 CPU vector."""
        return quantize_vector(x, self.block_size, 127)

    def decode(self, enc: Encoded, device: torch.device | str | None = None) -> torch.Tensor:
        """The float32 vector ``enc`` holds, on CPU or on ``device`` (a CUDA device decodes there, same bits)."""
        if device is not None and torch.device(device).type != "cpu":
            codes, scales = self._checked(enc)
            codes_t = torch.from_numpy(codes.copy()).to(device)
            out = kdevice.int8_dequantize(codes_t, torch.from_numpy(scales.copy()).to(device), self.block_size)
            return out if out is not None else self.decode(enc).to(device)
        out = torch.empty(max(enc.numel, 0), dtype=torch.float32)
        self.decode_into(enc, out)
        return out

    def decode_into(self, enc: Encoded, out: torch.Tensor) -> None:
        """Decode into ``out`` (a float32 CPU tensor of ``enc.numel`` elements), reading the codes where
        they lie in the message: no copy of them, no float32 temporary. On error ``out`` is untouched."""
        codes, scales = self._checked(enc)
        n, bs = enc.numel, self.block_size
        target = decode_target(out, n)
        full = n - n % bs
        with warnings.catch_warnings():  # read-only views of the message: nothing here writes to them
            warnings.simplefilter("ignore", UserWarning)
            codes_t, scales_t = torch.from_numpy(codes), torch.from_numpy(scales)
        # int8 -> float32 is exact and each element is one float32 multiply: the bits of dequantize_rows
        target.copy_(codes_t)
        target[:full].view(-1, bs).mul_(scales_t[: full // bs, None])
        if full < n:
            target[full:].mul_(scales_t[-1])

    def _checked(self, enc: Encoded) -> tuple[np.ndarray, np.ndarray]:
        """The codes and scales of ``enc`` as read-only views of the message, once every check passed."""
        if enc.codec != self.name:
            raise CodecError(f"expected codec {self.name!r}, got {enc.codec!r}")
        n, bs = enc.numel, self.block_size
        nblocks = self._blocks(n)
        if len(enc.payload) != n:
            raise CodecError(f"int8 payload of {n} elements needs {n} bytes, got {len(enc.payload)}")
        if len(enc.scales) != 4 * nblocks:
            raise CodecError(
                f"int8 payload of {n} elements in blocks of {bs} needs {nblocks} scales "
                f"({4 * nblocks} bytes), got {len(enc.scales)} bytes"
            )
        scales = np.frombuffer(enc.scales, dtype=np.float32)
        if not np.isfinite(scales).all() or bool((scales < 0).any()):
            raise CodecError("int8 scales must be finite and non-negative")
        if scales.size and float(scales.max()) * 127 > MAX_ABS:
            raise CodecError(f"int8 scales decode to values beyond +-{MAX_ABS:g}")
        codes = np.frombuffer(enc.payload, dtype=np.int8)
        if codes.size and int(codes.min()) == -128:
            raise CodecError("int8 code -128 is outside the symmetric range [-127, 127]")
        return codes, scales


def quantize_vector(x: torch.Tensor, block_size: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes in ``[-qmax, qmax]`` and one float32 scale per ``block_size`` elements of a flat float32
    CPU vector: the torch reference of the int8 (``qmax`` 127) and int4 (``qmax`` 7) codecs' encoding."""
    n, bs = x.numel(), block_size
    full = n - n % bs
    codes = torch.empty(n, dtype=torch.int8)
    scales = torch.empty(-(-n // bs), dtype=torch.float32)
    if full:  # whole blocks in place, no padded copy of the vector
        quantize_blocks(x[:full].view(-1, bs), codes[:full].view(-1, bs), scales[: full // bs], qmax)
    if full < n:  # the last, partial block, padded with zeros (which change neither its scale nor its codes)
        tail = torch.zeros(1, bs)
        tail[0, : n - full] = x[full:]
        tail_codes = torch.empty(1, bs, dtype=torch.int8)
        quantize_blocks(tail, tail_codes, scales[-1:], qmax)
        codes[full:] = tail_codes[0, : n - full]
    return codes, scales


def quantize_blocks(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, qmax: int = 127) -> None:
    """:func:`~potluck.kernels.quant.quantize_rows` at 8 bits (``qmax`` 127; 7 for 4 bits), written into
    ``codes`` and ``scales``.

    The same operations (absmax / qmax, divide, round half to even, clamp), in fewer passes over
    memory: the absmax from the rows' max and min (no ``|x|`` temporary), one division into a
    scratch row block, and the rounding, clamping and int8 conversion in place.
    """
    torch.maximum(x.amax(dim=1), x.amin(dim=1).neg_(), out=scales)  # (torch.aminmax is 20x slower here)
    scales.div_(qmax).abs_()  # abs: a block of negative zeros gets the scale +0.0, not -0.0, like max |x|
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
    y = torch.div(x, safe)  # an all-zero block (scale 0) divides by 1 and stays zero
    codes.copy_(y.round_().clamp_(-qmax, qmax))


def decode_target(out: torch.Tensor, numel: int) -> torch.Tensor:
    """``out``, checked to be what a codec's ``decode_into`` writes: flat, contiguous float32 on the CPU, ``numel`` long."""
    if out.dtype != torch.float32 or out.device.type != "cpu" or out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"decode_into needs a contiguous flat float32 CPU tensor, got {out.dtype} {tuple(out.shape)}")
    if out.numel() != numel:
        raise CodecError(f"{numel} decoded elements do not fit an output of {out.numel()}")
    return out


CODECS = ("int8", "int4", "raw")


def make_codec(name: str, block_size: int | None = None) -> Codec:
    """The codec ``sync.codec`` names, with ``block_size`` elements per scale (int8 and int4; by default each
    codec's own: 2048 for int8, 128 for int4)."""
    if name == "int8":
        return Int8BlockCodec(2048 if block_size is None else block_size)
    if name == "int4":
        # (imported here: int4 builds on this module's helpers)
        from potluck.compression.int4 import DEFAULT_BLOCK, Int4BlockCodec

        return Int4BlockCodec(DEFAULT_BLOCK if block_size is None else block_size)
    if name == "raw":
        return RawCodec()
    raise CodecError(f"unknown codec {name!r} (known: {', '.join(CODECS)})")
