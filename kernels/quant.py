"""Uniform symmetric quantization and bit packing, in plain torch.

These are the exact reference kernels every codec in :mod:`potluck.compression` is built on; they
run on any device torch supports (a fused Triton version must match them bit for bit).

Quantization is *midtread* and symmetric: a row ``x`` with ``absmax = max|x|`` gets the scale
``s = absmax / qmax`` with ``qmax = 2**(bits-1) - 1`` and codes ``q = round(x / s)`` in
``[-qmax, qmax]``; ``dequantize`` returns ``q * s``. So ``|x - q*s| <= s/2`` for deterministic
(round-half-to-even) rounding, zero stays exactly zero, and with stochastic rounding
``E[q*s] = x``. A row of zeros gets scale 0 and decodes to zeros.

Dequantization is one multiply per element, so any two processes that decode the same codes and
scales get bit-identical floats: this is what lets every member of an all-reduce end with the same
parameters.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (2, 3, 4, 8)


def qmax_for(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits}; use one of {SUPPORTED_BITS}")
    return (1 << (bits - 1)) - 1


def quantize_rows(
    x: torch.Tensor, bits: int, *, stochastic: bool = False, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of a 2-D float tensor with its own absmax scale.

    Returns ``(codes, scales)``: int8 codes of ``x``'s shape and one float32 scale per row.
    """
    return _quantize(x, bits, 1, None, stochastic, generator, "quantize_rows")


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: ``codes * scale`` per row, in float32."""
    return _dequantize(codes, scales, 1)


def quantize_channels(
    x: torch.Tensor,
    bits: int,
    *,
    scales: torch.Tensor | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D float tensor ``[rows, channels]`` with one absmax scale per channel (column).

    Activations have a few channels far larger than the rest, so a per-channel scale keeps the small
    channels from being rounded to zero. ``scales`` may be given (e.g. already rounded to the float16
    the wire carries); codes are then clamped to ``[-qmax, qmax]`` and a zero scale gives zero codes.
    Returns ``(codes, scales)``: int8 codes of ``x``'s shape and one float32 scale per channel.
    """
    return _quantize(x, bits, 0, scales, stochastic, generator, "quantize_channels")


def dequantize_channels(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_channels`: ``codes * scale`` per column, in float32."""
    return _dequantize(codes, scales, 0)


def _quantize(
    x: torch.Tensor, bits: int, dim: int, scales: torch.Tensor | None, stochastic: bool,
    generator: torch.Generator | None, name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One absmax scale per slice along ``dim`` (1: per row, 0: per column)."""
    if x.dim() != 2:
        raise ValueError(f"{name} expects a 2-D tensor, got shape {tuple(x.shape)}")
    qmax = qmax_for(bits)
    x = x.float()
    n = x.shape[1 - dim]
    if scales is None:
        scales = x.abs().amax(dim=dim) / qmax if x.shape[dim] else x.new_zeros(n)
    scales = scales.float()
    if scales.shape != (n,):
        raise ValueError(f"{n} {'channels' if dim == 0 else 'rows'} need {n} scales, got shape {tuple(scales.shape)}")
    zero = (scales == 0).unsqueeze(dim)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(dim)
    y = x / safe
    if stochastic:
        noise = torch.rand(y.shape, generator=generator, device=y.device, dtype=y.dtype)
        y = torch.floor(y + noise)
    else:
        y = torch.round(y)
    codes = y.clamp_(-qmax, qmax).masked_fill_(zero, 0).to(torch.int8)
    return codes, scales


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, dim: int) -> torch.Tensor:
    if codes.dim() != 2 or scales.dim() != 1 or scales.shape[0] != codes.shape[1 - dim]:
        raise ValueError(f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not match")
    return codes.float() * scales.float().unsqueeze(dim)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed codes in ``[-qmax, qmax]`` into a uint8 stream, ``bits`` bits per code.

    Codes are offset to unsigned ``code + qmax`` and written least significant bit first; the last
    byte is zero-padded. 8-bit codes are stored as-is (one byte each). The stream is the same as
    ``numpy.packbits(bit_planes, bitorder="little")``; it is built a whole byte (2 and 4 bits) or a
    whole 3-byte word (3 bits: 8 codes) at a time.
    """
    qmax = qmax_for(bits)
    flat = codes.reshape(-1)
    if bits == 8:
        return flat.view(torch.uint8).clone() if flat.dtype == torch.int8 else flat.to(torch.int8).view(torch.uint8)
    group = 4 if bits == 2 else 2 if bits == 4 else 8  # codes per word of 1 byte (2, 4 bits) or 3 bytes
    unsigned = (flat.to(torch.int32) + qmax)
    pad = (-unsigned.numel()) % group
    if pad:
        unsigned = torch.cat([unsigned, unsigned.new_zeros(pad)])  # zero bits, not code 0
    shifts = torch.arange(group, device=flat.device, dtype=torch.int32) * bits
    words = (unsigned.view(-1, group) << shifts).sum(dim=1, dtype=torch.int32)
    if bits == 3:
        words = (words[:, None] >> torch.tensor([0, 8, 16], device=flat.device, dtype=torch.int32)) & 0xFF
    return words.to(torch.uint8).reshape(-1)[: packed_nbytes(flat.numel(), bits)]


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``numel`` int8 codes."""
    qmax = qmax_for(bits)
    expected = packed_nbytes(numel, bits)
    if packed.numel() != expected:
        raise ValueError(f"{numel} codes of {bits} bits take {expected} bytes, got {packed.numel()}")
    if bits == 8:
        return packed.reshape(-1).view(torch.int8).clone()
    if bits in (2, 4):  # whole codes per byte: byte arithmetic, no int32 intermediates (4x to 16x the codes' size)
        flat = packed.reshape(-1)
        mask = (1 << bits) - 1
        unsigned = torch.stack([(flat >> shift) & mask for shift in range(0, 8, bits)], dim=1).reshape(-1)[:numel]
        if unsigned.numel() and int(unsigned.max()) > 2 * qmax:
            raise ValueError(f"packed stream holds codes outside [-{qmax}, {qmax}]")
        return unsigned.view(torch.int8).sub_(qmax)
    group = 8
    data = packed.reshape(-1).to(torch.int32)
    if bits == 3:
        pad = (-data.numel()) % 3
        if pad:
            data = torch.cat([data, data.new_zeros(pad)])
        data = (data.view(-1, 3) << torch.tensor([0, 8, 16], device=packed.device, dtype=torch.int32)).sum(
            dim=1, dtype=torch.int32
        )
    shifts = torch.arange(group, device=packed.device, dtype=torch.int32) * bits
    unsigned = ((data[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:numel]
    codes = unsigned - qmax
    if bool((codes > qmax).any()):
        raise ValueError(f"packed stream holds codes outside [-{qmax}, {qmax}]")
    return codes.to(torch.int8)


def packed_nbytes(numel: int, bits: int) -> int:
    return (numel * bits + 7) // 8
