"""The codec Q for tensors crossing a pipeline boundary: activations forward, gradients backward.

A :class:`Packet` is one tensor as it travels: ``mode``, ``bits``, ``shape``, ``dtype``, ``scales``
and ``payload``. Modes:

* ``"quant"``: ``bits`` in {2, 3, 4, 8}, uniform symmetric codes with one absmax scale per channel
  (the last dimension), computed over the whole micro-batch tensor; codes are bit-packed
  (:mod:`potluck.kernels.quant`) and scales are float32. ``"quant_fp16_scales"`` is the same with
  float16 scales (rounded *up*, so no value falls outside the code range).
* ``"fp16"`` and ``"fp32"``: no compression, the values as float16 / float32 (``bits`` is 0).

For a tensor of shape ``[..., C]`` with ``N`` elements a quantized packet costs
``ceil(N * bits / 8)`` payload bytes plus ``4 * C`` (or ``2 * C``) scale bytes. The error on each
element is at most half its channel's scale (deterministic rounding, round half to even), and
stochastic rounding (``floor(x / s + u)``, ``u ~ U[0, 1)`` drawn from a generator the caller seeds)
is unbiased.

Decoding is one multiply per element in float32, so two processes that decode the same packet get
bit-identical tensors; :meth:`ActCodec.encode_with_reconstruction` hands the sender exactly what the
receiver will decode, which is what lets AC-SGD keep identical buffers on both sides
(:mod:`potluck.compression.acsgd`). Everything a receiver relies on is checked before any tensor is
produced, and a bad packet raises :class:`CodecError` with the reason. Encoding refuses NaN and Inf.

:meth:`Packet.to_dict` / :meth:`Packet.from_dict` map a packet to plain bytes, ints, strings and
lists (the protobuf message has the same six fields); unknown keys are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from potluck.compression.int8 import MAX_ABS, CodecError
from potluck.kernels import device as kdevice
from potluck.kernels.quant import (
    SUPPORTED_BITS,
    dequantize_channels,
    pack_bits,
    packed_nbytes,
    qmax_for,
    quantize_channels,
    unpack_bits,
)

__all__ = ["MODES", "ActCodec", "CodecError", "Packet", "decode", "encode", "wire_sizes"]

Mode = Literal["quant", "quant_fp16_scales", "fp16", "fp32"]
MODES: tuple[str, ...] = ("quant", "quant_fp16_scales", "fp16", "fp32")
QUANT_MODES = ("quant", "quant_fp16_scales")
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_RAW_NP = {"fp16": np.float16, "fp32": np.float32}


@dataclass(frozen=True)
class Packet:
    """One tensor on the wire. ``dtype`` is the tensor's own dtype, which :func:`decode` returns."""

    mode: str
    bits: int
    shape: tuple[int, ...]
    dtype: str
    scales: bytes = b""
    payload: bytes = b""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of payload and scales: what the tensor costs on the wire, headers aside."""
        return len(self.payload) + len(self.scales)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "bits": self.bits,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "scales": self.scales,
            "payload": self.payload,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Packet:
        """Parse a plain dict (or a protobuf-like mapping); only types are checked here, sizes in decode."""
        if not isinstance(d, Mapping):
            raise CodecError(f"a packet must be a mapping, got {type(d).__name__}")
        for key in ("mode", "shape", "dtype", "payload"):
            if key not in d:
                raise CodecError(f"packet lacks field {key!r}")
        mode, dtype, bits, shape = d["mode"], d["dtype"], d.get("bits", 0), d["shape"]
        if not isinstance(mode, str) or not isinstance(dtype, str):
            raise CodecError("packet fields 'mode' and 'dtype' must be strings")
        if not _is_int(bits):
            raise CodecError(f"packet field 'bits' must be an int, got {bits!r}")
        if isinstance(shape, str | bytes) or not all(_is_int(s) for s in shape):
            raise CodecError(f"packet field 'shape' must be a list of ints, got {shape!r}")
        return cls(mode, int(bits), tuple(int(s) for s in shape), dtype,
                   _as_bytes(d.get("scales", b""), "scales"), _as_bytes(d["payload"], "payload"))


def _is_int(v: object) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def _as_bytes(v: object, name: str) -> bytes:
    if isinstance(v, bytes | bytearray | memoryview):
        return bytes(v)
    raise CodecError(f"packet field {name!r} must be bytes, got {type(v).__name__}")


def _check_mode(mode: str, bits: int) -> None:
    if mode not in MODES:
        raise CodecError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    if mode in QUANT_MODES and bits not in SUPPORTED_BITS:
        raise CodecError(f"unsupported bit width {bits} for mode {mode!r}; use one of {SUPPORTED_BITS}")
    if mode not in QUANT_MODES and bits != 0:
        raise CodecError(f"mode {mode!r} carries no codes, so bits must be 0, got {bits}")


def _scale_nbytes(mode: str) -> int:
    return 2 if mode == "quant_fp16_scales" else 4


def wire_sizes(mode: str, bits: int, shape: tuple[int, ...]) -> tuple[int, int]:
    """``(scale bytes, payload bytes)`` of a packet of ``shape`` in ``mode`` at ``bits``: what a receiver expects
    before it reads a byte of the packet (CodecError for a mode or shape no packet can have)."""
    _check_mode(mode, bits)
    if len(shape) == 0 or any(s < 0 for s in shape):
        raise CodecError(f"shape must have at least one non-negative dimension, got {list(shape)}")
    n = math.prod(shape)
    if mode in QUANT_MODES:
        return shape[-1] * _scale_nbytes(mode), packed_nbytes(n, bits)
    return 0, n * (2 if mode == "fp16" else 4)


def validate(packet: Packet) -> None:
    """Raise :class:`CodecError` unless ``packet`` is self-consistent (sizes, names, finite scales)."""
    want_scales, want = wire_sizes(packet.mode, packet.bits, packet.shape)
    if packet.dtype not in DTYPES:
        raise CodecError(f"unsupported dtype {packet.dtype!r} (supported: {', '.join(DTYPES)})")
    if len(packet.payload) != want:
        what = f"at {packet.bits} bits" if packet.mode in QUANT_MODES else f"in {packet.mode}"
        raise CodecError(f"payload of shape {list(packet.shape)} {what} needs {want} bytes, got {len(packet.payload)}")
    if len(packet.scales) != want_scales:
        if not want_scales:
            raise CodecError(f"mode {packet.mode!r} carries no scales, got {len(packet.scales)} bytes")
        channels = packet.shape[-1]
        raise CodecError(
            f"{channels} channels need {channels} scales ({want_scales} bytes), got {len(packet.scales)} bytes"
        )


def encode(
    x: torch.Tensor,
    mode: str = "quant",
    bits: int = 4,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> Packet:
    """Encode ``x`` (float32, float16 or bfloat16, at least 1-D) as a :class:`Packet`."""
    return _encode(x, mode, bits, stochastic, generator, want_recon=False)[0]


def decode(packet: Packet) -> torch.Tensor:
    """The tensor a packet holds, on CPU, in the packet's ``dtype``; a bad packet raises CodecError."""
    validate(packet)
    return _decode_valid(packet).to(DTYPES[packet.dtype])


def _encode(
    x: torch.Tensor, mode: str, bits: int, stochastic: bool, generator: torch.Generator | None, want_recon: bool = True
) -> tuple[Packet, torch.Tensor | None]:
    """The packet and (if ``want_recon``) what decoding it gives, as float32 on CPU."""
    _check_mode(mode, bits)
    if x.dtype not in _DTYPE_NAMES:
        raise CodecError(f"unsupported dtype {x.dtype} (supported: {', '.join(DTYPES)})")
    if x.dim() == 0:
        raise CodecError("cannot encode a 0-d tensor; give it at least one dimension")
    x = x.detach()
    if not bool(torch.isfinite(x).all()):
        raise CodecError("refusing to encode NaN or Inf")
    shape, dtype = tuple(x.shape), _DTYPE_NAMES[x.dtype]
    if mode in _RAW_NP:
        values = x.to("cpu", torch.float16 if mode == "fp16" else torch.float32).contiguous()
        if not bool(torch.isfinite(values).all()):
            raise CodecError("values exceed the float16 range; use mode 'fp32'")
        return Packet(mode, 0, shape, dtype, b"", values.numpy().tobytes()), values.float() if want_recon else None
    x2d = x.reshape(_rows(shape), shape[-1]).float()
    scales = None
    if mode == "quant_fp16_scales":
        scales = _fp16_scales_up(x2d, bits)
    on_device = _quantize_on_device(x2d, bits, scales, stochastic, generator, want_recon)
    if on_device is not None:
        packed, scales, recon = on_device
    else:
        codes, scales = quantize_channels(x2d, bits, scales=scales, stochastic=stochastic, generator=generator)
        scales = scales.cpu()
        recon = dequantize_channels(codes.cpu(), scales) if want_recon else None
        packed = pack_bits(codes, bits).cpu()
    return _packet(mode, bits, shape, dtype, scales, packed), None if recon is None else recon.view(shape)


def _packet(mode: str, bits: int, shape: tuple[int, ...], dtype: str, scales: torch.Tensor,
            packed: torch.Tensor) -> Packet:
    wire_scales = scales.numpy().astype(np.float16 if mode == "quant_fp16_scales" else np.float32)
    return Packet(mode, bits, shape, dtype, wire_scales.tobytes(), packed.numpy().tobytes())


def _quantize_on_device(
    x2d: torch.Tensor, bits: int, scales: torch.Tensor | None, stochastic: bool, generator: torch.Generator | None,
    want_out: bool, m: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The Triton kernel's packed codes, float32 scales and reconstruction (``m`` + it, given ``m``), all on
    the host; ``None`` where the torch reference must run. Stochastic noise comes from ``generator`` as the
    reference draws it (one ``torch.rand`` of the codes' shape), so the bits and the generator's state match."""
    if not kdevice.uses_triton(x2d, "channels"):
        return None
    noise, state = None, None
    if stochastic:
        state = generator.get_state() if generator is not None else None
        noise = torch.rand(x2d.shape, generator=generator,
                           device=generator.device if generator is not None else x2d.device)
    out = kdevice.channels_quantize_pack(x2d, bits, m=m, scales=scales, noise=noise, want_out=want_out)
    if out is None:
        if state is not None and generator is not None:
            generator.set_state(state)  # the torch path draws the same numbers again
        return None
    copies = [kdevice.start_host_copy(t) for t in out if t is not None]
    host = [c.wait() for c in copies]
    return host[0], host[1], host[2] if want_out else None


def _rows(shape: tuple[int, ...]) -> int:
    """Rows of the ``[rows, channels]`` view (explicit, since ``-1`` is ambiguous with 0 channels)."""
    return math.prod(shape[:-1])


def _fp16_scales_up(x2d: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-channel scales rounded up to float16, so ``|x| / s <= qmax`` still holds."""
    if x2d.shape[0] == 0:
        return torch.zeros(x2d.shape[1])
    exact = (x2d.abs().amax(dim=0).cpu() / qmax_for(bits)).numpy()  # divided on CPU: CUDA would multiply by 1/qmax
    half = exact.astype(np.float16)
    low = half.astype(np.float32) < exact
    half[low] = np.nextafter(half[low], np.float16(np.inf))
    if not np.isfinite(half).all():
        raise CodecError("a channel's scale exceeds the float16 range; use mode 'quant'")
    return torch.from_numpy(half.astype(np.float32)).to(x2d.device)


def _decode_valid(packet: Packet) -> torch.Tensor:
    """Decode a packet that passed :func:`validate` to float32 (raw fp16 is widened exactly); this is the one
    dequantization path."""
    shape = packet.shape
    if packet.mode in _RAW_NP:
        arr = np.frombuffer(packet.payload, dtype=_RAW_NP[packet.mode])
        out = torch.from_numpy(arr.astype(np.float32)).view(shape)
        if out.numel():  # min and max carry NaN and Inf: checked without a temporary of the tensor's size
            lo, hi = torch.aminmax(out)
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise CodecError(f"{packet.mode} payload holds NaN or Inf")
            if max(-float(lo), float(hi)) > MAX_ABS:
                raise CodecError(f"{packet.mode} payload holds values beyond +-{MAX_ABS:g}")
        return out
    return _dequantize_rows(packet, _scales(packet), 0, _rows(shape)).view(shape)


def _scales(packet: Packet) -> torch.Tensor:
    """A quantized packet's scales as float32, checked: finite, non-negative, decoding within bounds."""
    scale_np = np.float16 if packet.mode == "quant_fp16_scales" else np.float32
    scales = torch.from_numpy(np.frombuffer(packet.scales, dtype=scale_np).astype(np.float32))
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise CodecError("scales must be finite and non-negative")
    if scales.numel() and float(scales.max()) * qmax_for(packet.bits) > MAX_ABS:
        raise CodecError(f"scales decode to values beyond +-{MAX_ABS:g}")
    return scales


def _dequantize_rows(packet: Packet, scales: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a valid quantized packet, decoded to float32 ``[stop - start, channels]``."""
    channels, bits = packet.shape[-1], packet.bits
    lo, hi = start * channels, stop * channels
    if (lo * bits) % 8:
        raise ValueError(f"rows from {start} do not start on a whole byte of {bits}-bit codes")
    data = np.frombuffer(packet.payload, dtype=np.uint8)[lo * bits // 8 : packed_nbytes(hi, bits)]
    packed = torch.from_numpy(data if data.flags.writeable else data.copy())
    try:
        codes = unpack_bits(packed, bits, hi - lo)
    except ValueError as e:
        raise CodecError(str(e)) from e
    if bits == 8 and codes.numel() and int(codes.min()) == -128:
        raise CodecError("8-bit code -128 is outside the symmetric range [-127, 127]")
    return dequantize_channels(codes.view(stop - start, channels), scales)


# rows decoded at a time by ActCodec.add_decoded: a multiple of 8 (whole bytes of 3-bit codes); at d_model 2048,
# 2 MiB of float32 a block
_ADD_ROWS = 256


class ActCodec:
    """One configured codec: a mode, a bit width, a rounding rule and (for stochastic) a generator.

    ``decode`` accepts only packets of this codec's mode and bit width, so a peer configured for
    4-bit activations rejects an 8-bit packet instead of silently mixing widths.
    """

    def __init__(
        self,
        mode: str = "quant",
        bits: int = 4,
        *,
        rounding: Literal["deterministic", "stochastic"] = "deterministic",
        generator: torch.Generator | None = None,
    ) -> None:
        bits = bits if mode in QUANT_MODES else 0
        try:
            _check_mode(mode, bits)
        except CodecError as e:
            raise ValueError(str(e)) from e
        if rounding not in ("deterministic", "stochastic"):
            raise ValueError(f"rounding must be 'deterministic' or 'stochastic', got {rounding!r}")
        self.mode, self.bits, self.rounding, self.generator = mode, bits, rounding, generator

    def encode(self, x: torch.Tensor) -> Packet:
        return _encode(x, self.mode, self.bits, self.rounding == "stochastic", self.generator, want_recon=False)[0]

    def encode_with_reconstruction(self, x: torch.Tensor) -> tuple[Packet, torch.Tensor]:
        """The packet and, as float32 on CPU, exactly what :meth:`decode` will return for it."""
        packet, recon = _encode(x, self.mode, self.bits, self.rounding == "stochastic", self.generator)
        assert recon is not None
        return packet, recon

    def encode_delta(self, a: torch.Tensor, m: torch.Tensor) -> tuple[Packet, torch.Tensor]:
        """AC-SGD's sender step: the packet of ``a - m`` and ``m + decode(packet)`` (float32, on CPU).

        ``m`` is a float32 CPU buffer of ``a``'s shape. On a CUDA ``a`` (mode ``quant``) one fused Triton
        kernel computes the difference, codes and new buffer without materialising ``a - m``; the bits
        are those of the torch path, ``encode_with_reconstruction(a - m)`` then ``m + recon``.
        """
        if self.mode == "quant" and a.dim() >= 1 and a.shape == m.shape and kdevice.uses_triton(a, "channels"):
            shape = tuple(a.shape)
            rows = _rows(shape)
            fused = _quantize_on_device(a.detach().reshape(rows, shape[-1]), self.bits, None,
                                        self.rounding == "stochastic", self.generator, True,
                                        m=m.to(a.device).reshape(rows, shape[-1]))
            if fused is not None:
                packed, scales, new_m = fused
                if not bool(torch.isfinite(scales).all()):  # a channel of a - m held a NaN or Inf
                    raise CodecError("refusing to encode NaN or Inf")
                assert new_m is not None
                return _packet(self.mode, self.bits, shape, _DTYPE_NAMES[torch.float32], scales, packed), new_m.view(shape)
        packet, recon = self.encode_with_reconstruction(a - m.to(a.device))
        return packet, m + recon

    def decode(self, packet: Packet) -> torch.Tensor:
        self.check(packet)
        return _decode_valid(packet).to(DTYPES[packet.dtype])

    def decode_float(self, packet: Packet) -> torch.Tensor:
        """Like :meth:`decode` but always float32 (bit-identical to ``encode_with_reconstruction``)."""
        self.check(packet)
        return _decode_valid(packet)

    def add_decoded(self, packet: Packet, out: torch.Tensor) -> torch.Tensor:
        """``out += decode_float(packet)`` in place, a block of rows at a time: the same floats (each element is
        one multiply, then one add), without a float32 copy of the whole packet. ``out`` is float32 of the
        packet's shape; returns it. A bad packet raises CodecError, found before ``out`` is touched where the
        header, scales or 8-bit codes are wrong, else as the block holding a bad code is decoded: hand it a tensor
        you can throw away (AC-SGD's receiver adds to a copy of its buffer entries, stored only on success)."""
        self.check(packet)
        if tuple(out.shape) != packet.shape or out.dtype != torch.float32:
            raise CodecError(f"cannot add a packet of shape {list(packet.shape)} to {out.dtype} {list(out.shape)}")
        if packet.mode not in QUANT_MODES:
            out += _decode_valid(packet)
            return out
        scales = _scales(packet)
        rows, flat = _rows(packet.shape), out.view(-1, packet.shape[-1])
        if packet.bits == 8 and packet.numel and int(np.frombuffer(packet.payload, np.int8).min()) == -128:
            raise CodecError("8-bit code -128 is outside the symmetric range [-127, 127]")
        for start in range(0, rows, _ADD_ROWS):
            stop = min(rows, start + _ADD_ROWS)
            flat[start:stop] += _dequantize_rows(packet, scales, start, stop)
        return out

    def check(self, packet: Packet) -> None:
        """Raise :class:`CodecError` unless ``packet`` is valid and of this codec's mode and width."""
        validate(packet)
        if packet.mode != self.mode or packet.bits != self.bits:
            raise CodecError(
                f"expected mode {self.mode!r} at {self.bits} bits, got mode {packet.mode!r} at {packet.bits} bits"
            )
