"""Triton kernels for the outer all-reduce's int8 codec: one absmax scale per block of elements.

The spec is the torch reference in :mod:`potluck.compression.int8` (``Int8BlockCodec``); every
kernel here returns the same bits, codes *and* scales, on every input the reference encodes:

* ``scale = absmax / 127`` and ``y = x / scale`` are IEEE divisions (``tl.div_rn``), not the
  reciprocal multiply that ``tensor / 127`` becomes on CUDA;
* rounding is half to even (:func:`round_half_even`), then a clamp to ``[-127, 127]``;
* a block holding a NaN or an Inf gets an infinite scale, which the caller refuses, as the
  reference refuses its non-finite scale; codes of such a block are garbage and never leave;
* kernels must be launched with ``enable_fp_fusion=False``: a fused multiply-add would round once
  where the reference rounds twice.

The owner's reduction (:func:`mean_requantize`) decodes N contributions block by block, sums
them in float32 in the order given (the sender-id order of :mod:`potluck.compression.aggregate`), divides
by N and re-quantizes, without writing the float32 mean anywhere.

Import this module only where ``triton`` imports (:mod:`potluck.kernels.device` checks).
"""

# ruff: noqa: N803 (Triton spells compile-time constants in capitals)
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TILE = 4096  # elements of a block held at once; larger blocks are walked in tiles


@triton.jit
def round_half_even(y):
    """``torch.round`` (half to even) for float32, exactly: ``y - floor(y)`` is exact for the
    values that matter, and a tie goes to the even neighbour."""
    f = tl.floor(y)
    d = y - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    return f + tl.where(d > 0.5, 1.0, tl.where(d == 0.5, odd, 0.0))


@triton.jit
def absmax_bad(x):
    """``(max |x|, count of NaN/Inf)`` of a tile (masked lanes hold 0)."""
    ax = tl.abs(x)
    bad = tl.sum(((x != x) | (ax == float("inf"))).to(tl.int32), axis=0)
    return tl.max(ax, axis=0), bad


@triton.jit
def _store_codes(x, scale, codes_ptr, idx, mask):
    safe = tl.where(scale > 0, scale, 1.0)
    q = round_half_even(tl.div_rn(x, safe))
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(codes_ptr + idx, q.to(tl.int8), mask=mask)


@triton.jit
def _quantize_kernel(x_ptr, stride, n, bs, codes_ptr, scales_ptr, TILE: tl.constexpr, ONE_TILE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, TILE)
    start = b * bs
    if ONE_TILE:
        idx = start + offs
        mask = (offs < bs) & (idx < n)
        x = tl.load(x_ptr + idx * stride, mask=mask, other=0.0).to(tl.float32)
        amax, bad = absmax_bad(x)
        scale = tl.where(bad > 0, float("inf"), tl.div_rn(amax, 127.0))
        _store_codes(x, scale, codes_ptr, idx, mask)
    else:
        amax = tl.zeros((), tl.float32)
        bad = tl.zeros((), tl.int32)
        for t in range(0, bs, TILE):
            idx = start + t + offs
            mask = (t + offs < bs) & (idx < n)
            x = tl.load(x_ptr + idx * stride, mask=mask, other=0.0).to(tl.float32)
            a, k = absmax_bad(x)
            amax = tl.maximum(amax, a)
            bad += k
        scale = tl.where(bad > 0, float("inf"), tl.div_rn(amax, 127.0))
        for t in range(0, bs, TILE):
            idx = start + t + offs
            mask = (t + offs < bs) & (idx < n)
            x = tl.load(x_ptr + idx * stride, mask=mask, other=0.0).to(tl.float32)
            _store_codes(x, scale, codes_ptr, idx, mask)
    tl.store(scales_ptr + b, scale)


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, out_ptr, n, bs, TILE: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = idx < n
    c = tl.load(codes_ptr + idx, mask=mask, other=0).to(tl.float32)
    s = tl.load(scales_ptr + idx // bs, mask=mask, other=0.0)
    tl.store(out_ptr + idx, c * s, mask=mask)


@triton.jit
def _mean_tile(codes_ptr, scales_ptr, factors_ptr, k, kf, n, nb, b, idx, mask,
               HAS_FACTORS: tl.constexpr, DIVIDE: tl.constexpr):
    """Elements ``idx`` of block ``b`` of the mean: ``acc = 0; acc += code_i * scale_i (* f_i)``, then ``/ k``."""
    acc = tl.zeros(idx.shape, tl.float32)
    cp, sp, fp = codes_ptr, scales_ptr + b, factors_ptr
    for _ in range(k):  # pointers step a row at a time: no i * n product to overflow
        x = tl.load(cp + idx, mask=mask, other=0).to(tl.float32) * tl.load(sp)
        if HAS_FACTORS:
            x = x * tl.load(fp)
        acc += x
        cp += n
        sp += nb
        fp += 1
    if DIVIDE:
        acc = tl.div_rn(acc, kf)
    return acc


@triton.jit
def _mean_kernel(codes_ptr, scales_ptr, factors_ptr, k, kf, n, nb, bs, out_codes_ptr, out_scales_ptr,
                 HAS_FACTORS: tl.constexpr, DIVIDE: tl.constexpr, TILE: tl.constexpr, ONE_TILE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, TILE)
    start = b * bs
    if ONE_TILE:  # the whole block in registers: each contribution is read once
        idx = start + offs
        mask = (offs < bs) & (idx < n)
        acc = _mean_tile(codes_ptr, scales_ptr, factors_ptr, k, kf, n, nb, b, idx, mask, HAS_FACTORS, DIVIDE)
        amax, bad = absmax_bad(tl.where(mask, acc, 0.0))
        scale = tl.where(bad > 0, float("inf"), tl.div_rn(amax, 127.0))
        _store_codes(acc, scale, out_codes_ptr, idx, mask)
    else:  # a block larger than a tile: the mean is computed twice rather than stored
        amax = tl.zeros((), tl.float32)
        bad = tl.zeros((), tl.int32)
        for t in range(0, bs, TILE):
            idx = start + t + offs
            mask = (t + offs < bs) & (idx < n)
            acc = _mean_tile(codes_ptr, scales_ptr, factors_ptr, k, kf, n, nb, b, idx, mask, HAS_FACTORS, DIVIDE)
            a, c = absmax_bad(tl.where(mask, acc, 0.0))
            amax = tl.maximum(amax, a)
            bad += c
        scale = tl.where(bad > 0, float("inf"), tl.div_rn(amax, 127.0))
        for t in range(0, bs, TILE):
            idx = start + t + offs
            mask = (t + offs < bs) & (idx < n)
            acc = _mean_tile(codes_ptr, scales_ptr, factors_ptr, k, kf, n, nb, b, idx, mask, HAS_FACTORS, DIVIDE)
            _store_codes(acc, scale, out_codes_ptr, idx, mask)
    tl.store(out_scales_ptr + b, scale)


def _tile(block_size: int) -> tuple[int, bool]:
    tile = min(triton.next_power_of_2(block_size), MAX_TILE)
    return tile, block_size <= tile


def quantize_blocks(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8, ``x``'s length) and scales (float32, one per block) of a flat float vector.

    ``x`` may be strided (e.g. a slice with a step) and float16/bfloat16/float32; it is read in
    place. A non-finite block gets scale ``inf``: the caller must check the scales before use.
    """
    if x.dim() != 1:
        raise ValueError(f"quantize_blocks takes a flat vector, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        x = x.float()
    n = x.numel()
    nblocks = -(-n // block_size)
    codes = torch.empty(n, dtype=torch.int8, device=x.device)
    scales = torch.empty(nblocks, dtype=torch.float32, device=x.device)
    if n:
        tile, one = _tile(block_size)
        _quantize_kernel[(nblocks,)](x, x.stride(0), n, block_size, codes, scales, TILE=tile, ONE_TILE=one,
                                     enable_fp_fusion=False)
    return codes, scales


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """``codes * scale`` of each block, float32: the bits of ``Int8BlockCodec.decode``."""
    n = codes.numel()
    if scales.numel() != -(-n // block_size):
        raise ValueError(f"{n} codes in blocks of {block_size} need {-(-n // block_size)} scales, got {scales.numel()}")
    codes, scales = codes.contiguous(), scales.float().contiguous()
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    if n:
        tile = 2048
        _dequantize_kernel[(triton.cdiv(n, tile),)](codes, scales, out, n, block_size, TILE=tile,
                                                    enable_fp_fusion=False)
    return out


def mean_requantize(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, factors: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The owner's reduction, fused: decode ``k`` int8 contributions, average them, re-quantize.

    ``codes`` is ``[k, n]`` int8 and ``scales`` ``[k, nblocks]`` float32, rows in summation order;
    ``factors`` (``[k]`` float32, optional) multiplies each decoded contribution (the robust mean's
    clipping; 1.0 leaves a value unchanged bit for bit). Element by element this is, in float32,
    ``acc = 0; for i: acc += code_i * scale_i [* f_i]; acc /= k`` (no division when ``k == 0``),
    then :func:`quantize_blocks` of ``acc``. Returns ``(codes, scales)`` of the mean.
    """
    if codes.dim() != 2 or scales.dim() != 2 or scales.shape[0] != codes.shape[0]:
        raise ValueError(f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not match")
    k, n = codes.shape
    nblocks = -(-n // block_size)
    if scales.shape[1] != nblocks:
        raise ValueError(f"{n} codes in blocks of {block_size} need {nblocks} scales, got {scales.shape[1]}")
    if factors is not None and factors.shape != (k,):
        raise ValueError(f"{k} contributions need {k} factors, got shape {tuple(factors.shape)}")
    device = codes.device
    codes, scales = codes.contiguous(), scales.float().contiguous()
    fac = scales if factors is None else factors.to(device, torch.float32).contiguous()
    out_codes = torch.empty(n, dtype=torch.int8, device=device)
    out_scales = torch.empty(nblocks, dtype=torch.float32, device=device)
    if n:
        tile, one = _tile(block_size)
        _mean_kernel[(nblocks,)](codes, scales, fac, k, float(max(k, 1)), n, nblocks, block_size, out_codes, out_scales,
                                 HAS_FACTORS=factors is not None, DIVIDE=k > 0, TILE=tile, ONE_TILE=one,
                                 enable_fp_fusion=False)
    return out_codes, out_scales
