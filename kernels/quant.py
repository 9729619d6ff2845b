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
    if x.dim() != 2:
        raise ValueError(f"quantize_rows expects a 2-D tensor, got shape {tuple(x.shape)}")
    qmax = qmax_for(bits)
    x = x.float()
    scales = x.abs().amax(dim=1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    y = x / safe[:, None]
    if stochastic:
        noise = torch.rand(y.shape, generator=generator, device=y.device, dtype=y.dtype)
        y = torch.floor(y + noise)
    else:
        y = torch.round(y)
    codes = y.clamp_(-qmax, qmax).to(torch.int8)
    return codes, scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: ``codes * scale`` per row, in float32."""
    if codes.dim() != 2 or scales.dim() != 1 or scales.shape[0] != codes.shape[0]:
        raise ValueError(f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not match")
    return codes.float() * scales.float()[:, None]


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed codes in ``[-qmax, qmax]`` into a uint8 stream, ``bits`` bits per code.

    Codes are offset to unsigned ``code + qmax`` and written least significant bit first; the last
    byte is zero-padded. 8-bit codes are stored as-is (one byte each).
    """
    qmax = qmax_for(bits)
    flat = codes.reshape(-1)
    if bits == 8:
        return flat.view(torch.uint8).clone() if flat.dtype == torch.int8 else flat.to(torch.int8).view(torch.uint8)
    unsigned = (flat.to(torch.int16) + qmax).to(torch.uint8)
    shifts = torch.arange(bits, device=flat.device, dtype=torch.uint8)
    planes = (unsigned[:, None] >> shifts) & 1  # [n, bits], LSB first
    stream = planes.reshape(-1)
    pad = (-stream.numel()) % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], device=flat.device, dtype=torch.uint8)
    return (stream.reshape(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``numel`` int8 codes."""
    qmax = qmax_for(bits)
    expected = packed_nbytes(numel, bits)
    if packed.numel() != expected:
        raise ValueError(f"{numel} codes of {bits} bits take {expected} bytes, got {packed.numel()}")
    if bits == 8:
        return packed.reshape(-1).view(torch.int8).clone()
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    stream = ((packed.reshape(-1)[:, None] >> shifts) & 1).reshape(-1)[: numel * bits]
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int16))
    unsigned = (stream.reshape(numel, bits).to(torch.int16) * weights).sum(dim=1)
    codes = unsigned - qmax
    if bool((codes > qmax).any()):
        raise ValueError(f"packed stream holds codes outside [-{qmax}, {qmax}]")
    return codes.to(torch.int8)


def packed_nbytes(numel: int, bits: int) -> int:
    return (numel * bits + 7) // 8
