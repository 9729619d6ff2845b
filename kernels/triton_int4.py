"""Triton kernels for the outer all-reduce's int4 codec: two codes a byte, one absmax scale per block.

The spec is the torch reference in :mod:`potluck.compression.int4` (``Int4BlockCodec``); every kernel
here returns the same bits, packed codes *and* scales, on every input the reference encodes. They keep
:mod:`potluck.kernels.triton_int8`'s rules, with 7 for 127:

* ``scale = absmax / 7`` and ``y = x / scale`` are IEEE divisions (``tl.div_rn``);
* rounding is half to even (:func:`~potluck.kernels.triton_int8.round_half_even`), then a clamp to ``[-7, 7]``;
* a block holding a NaN or an Inf gets an infinite scale, which the caller refuses;
* kernels must be launched with ``enable_fp_fusion=False``.

A program owns one block (``block_size`` is even) and walks it a pair of elements at a time: element
``2i`` of the vector is the low nibble of byte ``i`` and ``2i + 1`` its high nibble, each stored as
``code + 7``; the high nibble after the last element of an odd-length vector is 0. So a block's bytes are
its own and no two programs write one byte.

The owner's reduction (:func:`mean_requantize`) decodes N packed contributions, sums them in float32 in
the order given, divides by N and re-quantizes, as the int8 one does.

Import this module only where ``triton`` imports (:mod:`potluck.kernels.device` checks).
"""

# ruff: noqa: N803 (Triton spells compile-time constants in capitals)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from potluck.kernels.triton_int8 import absmax_bad, round_half_even

MAX_PAIRS = 2048  # pairs of a block held at once; larger blocks are walked in tiles


@triton.jit
def _pair_mask(n, start, j, half):
    """Masks of the two elements of pair ``j`` of the block starting at ``start`` (the first also the byte's)."""
    e0 = start + 2 * j
    inside = j < half
    return e0, inside & (e0 < n), inside & (e0 + 1 < n)


@triton.jit
def _nibble(x, scale):
    """``code + 7`` of ``x`` as int32 (0..14)."""
    safe = tl.where(scale > 0, scale, 1.0)
    q = round_half_even(tl.div_rn(x, safe))
    q = tl.minimum(tl.maximum(q, -7.0), 7.0)
    return (q + 7.0).to(tl.int32)


@triton.jit
def _store_pairs(x0, x1, m0, m1, scale, out_ptr, byte):
    lo = _nibble(x0, scale)
    hi = tl.where(m1, _nibble(x1, scale), 0)
    tl.store(out_ptr + byte, (lo | (hi << 4)).to(tl.uint8), mask=m0)


@triton.jit
def _absmax_pair(x0, x1, m0, m1):
    a0, k0 = absmax_bad(tl.where(m0, x0, 0.0))
    a1, k1 = absmax_bad(tl.where(m1, x1, 0.0))
    return tl.maximum(a0, a1), k0 + k1


@triton.jit
def _quantize_kernel(x_ptr, stride, n, half, out_ptr, scales_ptr, PAIRS: tl.constexpr, ONE_TILE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, PAIRS)
    start = b * 2 * half
    if ONE_TILE:
        e0, m0, m1 = _pair_mask(n, start, offs, half)
        x0 = tl.load(x_ptr + e0 * stride, mask=m0, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + (e0 + 1) * stride, mask=m1, other=0.0).to(tl.float32)
        amax, bad = _absmax_pair(x0, x1, m0, m1)
        scale = tl.where(bad > 0, float("inf"), tl.div_rn(amax, 7.0))
        _store_pairs(x0, x1, m0, m1, scale, out_ptr, b * half + offs)
    else:
        amax = tl.zeros((), tl.float32)
        bad = tl.zeros((), tl.int32)
        for t in range(0, half, PAIRS):
            e0, m0, m1 = _pair_mask(n, start, t + offs, half)
            x0 = tl.load(x_ptr + e0 * stride, mask=m0, other=0.0).to(tl.float32)
            x1 = tl.load(x_ptr + (e0 + 1) * stride, mask=m1, other=0.0).to(tl.float32)
            a, k = _absmax_pair(x0, x1, m0, m1)
            amax = tl.maximum(amax, a)
            bad += k
        scale = tl.where(bad > 0, float("inf"), tl.div_rn(amax, 7.0))
        for t in range(0, half, PAIRS):
            e0, m0, m1 = _pair_mask(n, start, t + offs, half)
            x0 = tl.load(x_ptr + e0 * stride, mask=m0, other=0.0).to(tl.float32)
            x1 = tl.load(x_ptr + (e0 + 1) * stride, mask=m1, other=0.0).to(tl.float32)
            _store_pairs(x0, x1, m0, m1, scale, out_ptr, b * half + t + offs)
    tl.store(scales_ptr + b, scale)


@triton.jit
def _dequantize_kernel(packed_ptr, scales_ptr, out_ptr, n, nbytes, bs, PAIRS: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * PAIRS + tl.arange(0, PAIRS)
    m0 = i < nbytes
    e0 = 2 * i
    m1 = m0 & (e0 + 1 < n)
    byte = tl.load(packed_ptr + i, mask=m0, other=0).to(tl.int32)
    s = tl.load(scales_ptr + e0 // bs, mask=m0, other=0.0)  # (a pair never straddles two blocks: bs is even)
    tl.store(out_ptr + e0, ((byte & 15) - 7).to(tl.float32) * s, mask=m0)
    tl.store(out_ptr + e0 + 1, ((byte >> 4) - 7).to(tl.float32) * s, mask=m1)


@triton.jit
def _mean_pairs(packed_ptr, scales_ptr, factors_ptr, k, kf, nbytes, nb, b, byte, m0,
                HAS_FACTORS: tl.constexpr, DIVIDE: tl.constexpr):
    """Both elements of pairs ``byte`` of block ``b`` of the mean: ``acc = 0; acc += code_i * scale_i (* f_i)``,
    then ``/ k``."""
    acc0 = tl.zeros(byte.shape, tl.float32)
    acc1 = tl.zeros(byte.shape, tl.float32)
    pp, sp, fp = packed_ptr, scales_ptr + b, factors_ptr
    for _ in range(k):  # pointers step a row at a time: no i * nbytes product to overflow
        v = tl.load(pp + byte, mask=m0, other=0).to(tl.int32)
        s = tl.load(sp)
        x0 = ((v & 15) - 7).to(tl.float32) * s
        x1 = ((v >> 4) - 7).to(tl.float32) * s
        if HAS_FACTORS:
            f = tl.load(fp)
            x0 = x0 * f
            x1 = x1 * f
        acc0 += x0
        acc1 += x1
        pp += nbytes
        sp += nb
        fp += 1
    if DIVIDE:
        acc0 = tl.div_rn(acc0, kf)
        acc1 = tl.div_rn(acc1, kf)
    return acc0, acc1


@triton.jit
def _mean_kernel(packed_ptr, scales_ptr, factors_ptr, k, kf, n, nbytes, nb, half, out_ptr, out_scales_ptr,
                 HAS_FACTORS: tl.constexpr, DIVIDE: tl.constexpr, PAIRS: tl.constexpr, ONE_TILE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, PAIRS)
    start = b * 2 * half
    if ONE_TILE:  # the whole block in registers: each contribution is read once
        _, m0, m1 = _pair_mask(n, start, offs, half)
        byte = b * half + offs
        a0, a1 = _mean_pairs(packed_ptr, scales_ptr, factors_ptr, k, kf, nbytes, nb, b, byte, m0, HAS_FACTORS, DIVIDE)
        amax, bad = _absmax_pair(a0, a1, m0, m1)
        scale = tl.where(bad > 0, float("inf"), tl.div_rn(amax, 7.0))
        _store_pairs(a0, a1, m0, m1, scale, out_ptr, byte)
    else:  # a block larger than a tile: the mean is computed twice rather than stored
        amax = tl.zeros((), tl.float32)
        bad = tl.zeros((), tl.int32)
        for t in range(0, half, PAIRS):
            _, m0, m1 = _pair_mask(n, start, t + offs, half)
            byte = b * half + t + offs
            a0, a1 = _mean_pairs(packed_ptr, scales_ptr, factors_ptr, k, kf, nbytes, nb, b, byte, m0,
                                 HAS_FACTORS, DIVIDE)
            a, c = _absmax_pair(a0, a1, m0, m1)
            amax = tl.maximum(amax, a)
            bad += c
        scale = tl.where(bad > 0, float("inf"), tl.div_rn(amax, 7.0))
        for t in range(0, half, PAIRS):
            _, m0, m1 = _pair_mask(n, start, t + offs, half)
            byte = b * half + t + offs
            a0, a1 = _mean_pairs(packed_ptr, scales_ptr, factors_ptr, k, kf, nbytes, nb, b, byte, m0,
                                 HAS_FACTORS, DIVIDE)
            _store_pairs(a0, a1, m0, m1, scale, out_ptr, byte)
    tl.store(out_scales_ptr + b, scale)


def _tile(block_size: int) -> tuple[int, bool]:
    half = block_size // 2
    pairs = min(triton.next_power_of_2(half), MAX_PAIRS)
    return pairs, half <= pairs


def _check_block(block_size: int) -> None:
    if block_size < 2 or block_size % 2:
        raise ValueError(f"int4 blocks hold an even number of elements, got {block_size}")


def quantize_blocks(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes (uint8, ``ceil(n / 2)`` bytes) and scales (float32, one per block) of a flat float vector.

    ``x`` may be strided and float16/bfloat16/float32; it is read in place. A non-finite block gets
    scale ``inf``: the caller must check the scales before use.
    """
    if x.dim() != 1:
        raise ValueError(f"quantize_blocks takes a flat vector, got shape {tuple(x.shape)}")
    _check_block(block_size)
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        x = x.float()
    n = x.numel()
    nblocks = -(-n // block_size)
    packed = torch.empty((n + 1) // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(nblocks, dtype=torch.float32, device=x.device)
    if n:
        pairs, one = _tile(block_size)
        _quantize_kernel[(nblocks,)](x, x.stride(0), n, block_size // 2, packed, scales, PAIRS=pairs, ONE_TILE=one,
                                     enable_fp_fusion=False)
    return packed, scales


def dequantize_blocks(packed: torch.Tensor, scales: torch.Tensor, block_size: int, numel: int) -> torch.Tensor:
    """``code * scale`` of each of ``numel`` elements, float32: the bits of ``Int4BlockCodec.decode``."""
    _check_block(block_size)
    nbytes = (numel + 1) // 2
    if packed.numel() != nbytes:
        raise ValueError(f"{numel} codes of 4 bits take {nbytes} bytes, got {packed.numel()}")
    if scales.numel() != -(-numel // block_size):
        raise ValueError(f"{numel} codes in blocks of {block_size} need {-(-numel // block_size)} scales, "
                         f"got {scales.numel()}")
    packed, scales = packed.contiguous(), scales.float().contiguous()
    out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    if numel:
        pairs = 1024
        _dequantize_kernel[(triton.cdiv(nbytes, pairs),)](packed, scales, out, numel, nbytes, block_size,
                                                          PAIRS=pairs, enable_fp_fusion=False)
    return out


def mean_requantize(
    packed: torch.Tensor, scales: torch.Tensor, block_size: int, numel: int, factors: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The owner's reduction, fused: decode ``k`` packed int4 contributions, average them, re-quantize.

    ``packed`` is ``[k, ceil(numel / 2)]`` uint8 and ``scales`` ``[k, nblocks]`` float32, rows in summation
    order; ``factors`` (``[k]`` float32, optional) multiplies each decoded contribution. Element by element
    this is, in float32, ``acc = 0; for i: acc += code_i * scale_i [* f_i]; acc /= k`` (no division when
    ``k == 0``), then :func:`quantize_blocks` of ``acc``. Returns ``(packed, scales)`` of the mean.
    """
    _check_block(block_size)
    nbytes = (numel + 1) // 2
    if packed.dim() != 2 or scales.dim() != 2 or scales.shape[0] != packed.shape[0] or packed.shape[1] != nbytes:
        raise ValueError(f"packed {tuple(packed.shape)} and scales {tuple(scales.shape)} do not hold {numel} codes")
    k = packed.shape[0]
    nblocks = -(-numel // block_size)
    if scales.shape[1] != nblocks:
        raise ValueError(f"{numel} codes in blocks of {block_size} need {nblocks} scales, got {scales.shape[1]}")
    if factors is not None and factors.shape != (k,):
        raise ValueError(f"{k} contributions need {k} factors, got shape {tuple(factors.shape)}")
    device = packed.device
    packed, scales = packed.contiguous(), scales.float().contiguous()
    fac = scales if factors is None else factors.to(device, torch.float32).contiguous()
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out_scales = torch.empty(nblocks, dtype=torch.float32, device=device)
    if numel:
        pairs, one = _tile(block_size)
        _mean_kernel[(nblocks,)](packed, scales, fac, k, float(max(k, 1)), numel, nbytes, nblocks, block_size // 2,
                                 out, out_scales, HAS_FACTORS=factors is not None, DIVIDE=k > 0, PAIRS=pairs,
                                 ONE_TILE=one, enable_fp_fusion=False)
    return out, out_scales
