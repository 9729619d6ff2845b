"""Triton kernels for the pipeline codec: per-channel quantization, bit packing and AC-SGD's update.

The spec is :func:`potluck.kernels.quant.quantize_channels`, :func:`~potluck.kernels.quant.
dequantize_channels` and :func:`~potluck.kernels.quant.pack_bits`; :func:`quantize_pack` returns
their bits. With a buffer ``m`` it is AC-SGD's sender step in two passes over memory::

    delta = a - m;  q, s = Q(delta);  payload = pack(q);  m_new = m + q * s

so the sender's new buffer is exactly what the receiver computes from the packet (both add the
same float32 ``q * s`` to the same ``m``), and ``delta`` never exists in memory.

Pass 1 reduces each channel (column) to ``absmax`` and a NaN/Inf count and turns it into the scale
``absmax / qmax`` (IEEE division; ``inf`` for a channel holding a non-finite value, which the caller
refuses). A column is long (every row of the micro-batch) and there are few of them, so the
reduction runs on a 2-D grid: each program reduces a band of rows of a block of columns to partial
maxima, and a second, small kernel folds the bands (a maximum, so the order does not matter) and
divides. Pass 2 walks 2-D tiles of rows x columns (when a row holds a whole number of packing words,
as every real width does; else the flat row-major codes), rounds (half to even, or ``floor(y + u)``
for stochastic rounding), writes the packed bytes (a byte of 2- or 4-bit codes, 3 bytes of 3-bit
codes) and the reconstruction.

An earlier pass 1 gave each block of 256 columns one program that walked all the rows: 4 programs
for a 1024-wide activation, on a GPU of 132 multiprocessors (2 % of copy bandwidth on an H200).

Stochastic rounding takes its uniform noise ``u`` either as a tensor (drawn by the caller with the
codec's own generator, so the result is the reference's bit for bit) or as a seed for Triton's
Philox generator (fast, unbiased, but other numbers than torch's). Launch with
``enable_fp_fusion=False`` (see :mod:`potluck.kernels.triton_int8`).
"""

# ruff: noqa: N803, N806 (Triton spells compile-time constants in capitals)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from potluck.kernels.quant import packed_nbytes, qmax_for
from potluck.kernels.triton_int8 import round_half_even

NOISE_NONE, NOISE_TENSOR, NOISE_SEED = 0, 1, 2
TARGET_PROGRAMS = 1024  # programs of the column reduction: a few per multiprocessor of a large GPU


@triton.jit
def _band_kernel(x_ptr, sxr, sxc, m_ptr, smr, smc, rows, cols, band_rows, amax_ptr, bad_ptr,
                 HAS_M: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Partial ``max |x - m|`` and NaN/Inf counts of rows ``[band * band_rows, ...)`` of a block of columns."""
    c = tl.program_id(0).to(tl.int64) * BC + tl.arange(0, BC)
    band = tl.program_id(1).to(tl.int64)
    cmask = c < cols
    amax = tl.zeros((BC,), tl.float32)
    bad = tl.zeros((BC,), tl.int32)
    start = band * band_rows
    for r0 in range(0, band_rows, BR):
        r = start + r0 + tl.arange(0, BR).to(tl.int64)
        mask = (r[:, None] < rows) & (r0 + tl.arange(0, BR)[:, None] < band_rows) & cmask[None, :]
        v = tl.load(x_ptr + r[:, None] * sxr + c[None, :] * sxc, mask=mask, other=0.0).to(tl.float32)
        if HAS_M:
            v = v - tl.load(m_ptr + r[:, None] * smr + c[None, :] * smc, mask=mask, other=0.0).to(tl.float32)
        av = tl.abs(v)
        bad += tl.sum(((v != v) | (av == float("inf"))).to(tl.int32), axis=0)
        amax = tl.maximum(amax, tl.max(av, axis=0))
    tl.store(amax_ptr + band * cols + c, amax, mask=cmask)
    tl.store(bad_ptr + band * cols + c, bad, mask=cmask)


@triton.jit
def _fold_kernel(amax_ptr, bad_ptr, bands, cols, scales_ptr, QMAX: tl.constexpr, BC: tl.constexpr):
    """The bands' partials folded per column (maxima and sums: any order gives the same), then the scale."""
    c = tl.program_id(0).to(tl.int64) * BC + tl.arange(0, BC)
    cmask = c < cols
    amax = tl.zeros((BC,), tl.float32)
    bad = tl.zeros((BC,), tl.int32)
    for b in range(0, bands):
        amax = tl.maximum(amax, tl.load(amax_ptr + b * cols + c, mask=cmask, other=0.0))
        bad += tl.load(bad_ptr + b * cols + c, mask=cmask, other=0)
    scale = tl.where(bad > 0, float("inf"), tl.div_rn(amax, QMAX * 1.0))
    tl.store(scales_ptr + c, scale, mask=cmask)


@triton.jit
def _quantize_tile(v, s, noise_ptr, seed, i, mask, QMAX: tl.constexpr, NOISE: tl.constexpr):
    """Codes (as float32) of values ``v`` with scales ``s``; ``i`` their flat row-major indices (the noise's)."""
    y = tl.div_rn(v, tl.where(s > 0, s, 1.0))
    if NOISE == 1:
        q = tl.floor(y + tl.load(noise_ptr + i, mask=mask, other=0.0))
    elif NOISE == 2:
        q = tl.floor(y + tl.rand(seed, i))
    else:
        q = round_half_even(y)
    q = tl.minimum(tl.maximum(q, -QMAX * 1.0), QMAX * 1.0)
    return tl.where(s == 0, 0.0, q)


@triton.jit
def _codes(x_ptr, xo, m_ptr, mo, s, noise_ptr, seed, i, mask, out_ptr, QMAX: tl.constexpr, HAS_M: tl.constexpr,
           NOISE: tl.constexpr, WANT_OUT: tl.constexpr):
    """The int32 codes of ``x - m`` at offsets ``xo`` / ``mo`` (any shape) with scales ``s``; writes the
    reconstruction (``m + q * s``, or ``q * s``) at flat indices ``i`` when asked."""
    v = tl.load(x_ptr + xo, mask=mask, other=0.0).to(tl.float32)
    if HAS_M:
        m = tl.load(m_ptr + mo, mask=mask, other=0.0).to(tl.float32)
        v = v - m
    q = _quantize_tile(v, s, noise_ptr, seed, i, mask, QMAX, NOISE)
    if WANT_OUT:
        d = q * s
        if HAS_M:
            d = m + d
        tl.store(out_ptr + i, d, mask=mask)
    return q.to(tl.int32)


@triton.jit
def _tile_kernel(x_ptr, sxr, sxc, m_ptr, smr, smc, scales_ptr, noise_ptr, seed, rows, cols, packed_ptr, out_ptr,
                 BITS: tl.constexpr, QMAX: tl.constexpr, HAS_M: tl.constexpr, NOISE: tl.constexpr,
                 WANT_OUT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Pass 2 on a tile of ``BR`` rows x ``BC`` columns, for ``cols`` a whole number of packing words: each row's
    codes start on a word, so a tile packs along its columns, with no division per element."""
    r = tl.program_id(1).to(tl.int64) * BR + tl.arange(0, BR).to(tl.int64)
    c = tl.program_id(0).to(tl.int64) * BC + tl.arange(0, BC).to(tl.int64)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    s = tl.load(scales_ptr + c, mask=c < cols, other=0.0)[None, :]
    i = r[:, None] * cols + c[None, :]
    qi = _codes(x_ptr, r[:, None] * sxr + c[None, :] * sxc, m_ptr, r[:, None] * smr + c[None, :] * smc, s, noise_ptr,
                seed, i, mask, out_ptr, QMAX, HAS_M, NOISE, WANT_OUT)
    if BITS == 8:
        tl.store(packed_ptr + i, (qi & 0xFF).to(tl.uint8), mask=mask)
    else:
        G: tl.constexpr = 8 if BITS == 3 else 8 // BITS  # codes per word: a byte, or 3 bytes for 3 bits
        u = tl.where(mask, qi + QMAX, 0)
        shift = (tl.arange(0, BC) % G) * BITS
        words = tl.sum(tl.reshape(u << shift[None, :], (BR, BC // G, G)), axis=2)  # disjoint bit fields: sum == or
        wc = tl.program_id(0).to(tl.int64) * (BC // G) + tl.arange(0, BC // G).to(tl.int64)
        w = r[:, None] * (cols // G) + wc[None, :]
        wmask = (r[:, None] < rows) & (wc[None, :] < cols // G)
        if BITS == 3:
            for k in tl.static_range(3):
                tl.store(packed_ptr + 3 * w + k, ((words >> (8 * k)) & 0xFF).to(tl.uint8), mask=wmask)
        else:
            tl.store(packed_ptr + w, words.to(tl.uint8), mask=wmask)


@triton.jit
def _pack_kernel(x_ptr, sxr, sxc, m_ptr, smr, smc, scales_ptr, noise_ptr, seed, cols, numel, nbytes,
                 packed_ptr, out_ptr, BITS: tl.constexpr, QMAX: tl.constexpr, HAS_M: tl.constexpr,
                 NOISE: tl.constexpr, WANT_OUT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < numel
    r = i // cols
    c = i - r * cols
    s = tl.load(scales_ptr + c, mask=mask, other=0.0)
    qi = _codes(x_ptr, r * sxr + c * sxc, m_ptr, r * smr + c * smc, s, noise_ptr, seed, i, mask, out_ptr, QMAX, HAS_M,
                NOISE, WANT_OUT)
    if BITS == 8:
        tl.store(packed_ptr + i, (qi & 0xFF).to(tl.uint8), mask=mask)
    else:
        G: tl.constexpr = 8 if BITS == 3 else 8 // BITS  # codes per word: a byte, or 3 bytes for 3 bits
        u = tl.where(mask, qi + QMAX, 0)  # past the end: zero bits, as pack_bits pads
        shift = (tl.arange(0, BLOCK) % G) * BITS
        words = tl.sum(tl.reshape(u << shift, (BLOCK // G, G)), axis=1)  # disjoint bit fields: sum == or
        w = tl.program_id(0).to(tl.int64) * (BLOCK // G) + tl.arange(0, BLOCK // G)
        if BITS == 3:
            for k in tl.static_range(3):
                b = 3 * w + k
                tl.store(packed_ptr + b, ((words >> (8 * k)) & 0xFF).to(tl.uint8), mask=b < nbytes)
        else:
            tl.store(packed_ptr + w, words.to(tl.uint8), mask=w < nbytes)


def channel_scales(x: torch.Tensor, bits: int, m: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``max |x - m| / qmax`` per column of a 2-D tensor (``inf`` where a column is not finite)."""
    qmax = qmax_for(bits)
    rows, cols = x.shape
    scales = torch.empty(cols, dtype=torch.float32, device=x.device)
    if rows == 0 or cols == 0:
        return scales.zero_()
    mm = x if m is None else m
    bc = min(128, triton.next_power_of_2(max(cols, 1)))
    br = max(1, min(triton.next_power_of_2(rows), 4096 // bc))
    col_blocks = triton.cdiv(cols, bc)
    # enough bands of rows that the grid fills the device (a few programs per multiprocessor), each band a
    # whole number of BR-row tiles
    bands = max(1, min(triton.cdiv(rows, br), TARGET_PROGRAMS // col_blocks))
    band_rows = triton.cdiv(triton.cdiv(rows, bands), br) * br
    bands = triton.cdiv(rows, band_rows)
    amax = torch.empty((bands, cols), dtype=torch.float32, device=x.device)
    bad = torch.empty((bands, cols), dtype=torch.int32, device=x.device)
    _band_kernel[(col_blocks, bands)](x, x.stride(0), x.stride(1), mm, mm.stride(0), mm.stride(1), rows, cols,
                                      band_rows, amax, bad, HAS_M=m is not None, BR=br, BC=bc, enable_fp_fusion=False)
    _fold_kernel[(triton.cdiv(cols, 1024),)](amax, bad, bands, cols, scales, QMAX=qmax, BC=1024, enable_fp_fusion=False)
    return scales


def quantize_pack(
    x: torch.Tensor,
    bits: int,
    *,
    m: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    seed: int | None = None,
    want_out: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize ``x - m`` (``x`` without ``m``) per column and pack the codes.

    ``x`` and ``m`` are 2-D ``[rows, channels]``, any strides, float32/16 or bfloat16. ``scales``
    (float32 per channel) are computed when not given. ``noise`` (uniform ``[0, 1)``, ``x``'s shape)
    or ``seed`` selects stochastic rounding. Returns ``(packed, scales, out)``: the uint8 stream of
    :func:`~potluck.kernels.quant.pack_bits`, the float32 scales, and (if ``want_out``) the float32
    reconstruction ``q * s``, or the updated buffer ``m + q * s`` when ``m`` is given.
    """
    if x.dim() != 2 or (m is not None and m.shape != x.shape):
        raise ValueError(f"quantize_pack takes 2-D tensors of one shape, got {tuple(x.shape)}"
                         + ("" if m is None else f" and {tuple(m.shape)}"))
    qmax = qmax_for(bits)
    rows, cols = x.shape
    numel = rows * cols
    if scales is None:
        scales = channel_scales(x, bits, m)
    scales = scales.to(x.device, torch.float32).contiguous()
    if scales.shape != (cols,):
        raise ValueError(f"{cols} channels need {cols} scales, got shape {tuple(scales.shape)}")
    nbytes = packed_nbytes(numel, bits)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    out = torch.empty((rows, cols), dtype=torch.float32, device=x.device) if want_out else None
    if numel == 0:
        return packed, scales, out
    mode = NOISE_NONE
    if noise is not None:
        mode = NOISE_TENSOR
        noise = noise.to(x.device, torch.float32).contiguous()
        if noise.shape != x.shape:
            raise ValueError(f"noise of shape {tuple(noise.shape)} for codes of shape {tuple(x.shape)}")
    elif seed is not None:
        mode = NOISE_SEED
    mm = x if m is None else m
    group = 8 if bits == 3 else 8 // bits
    if cols % group == 0 and cols >= group:  # every row starts on a packing word: 2-D tiles
        bc = max(group, min(128 if bits == 3 else 256, triton.next_power_of_2(cols)))  # a power of 2: whole words
        br = max(1, 4096 // bc)
        _tile_kernel[(triton.cdiv(cols, bc), triton.cdiv(rows, br))](
            x, x.stride(0), x.stride(1), mm, mm.stride(0), mm.stride(1), scales,
            noise if noise is not None else scales, 0 if seed is None else seed & 0x7FFFFFFF, rows, cols,
            packed, out if out is not None else scales,
            BITS=bits, QMAX=qmax, HAS_M=m is not None, NOISE=mode, WANT_OUT=want_out, BR=br, BC=bc,
            enable_fp_fusion=False,
        )
        return packed, scales, out
    block = 2048
    _pack_kernel[(triton.cdiv(numel, block),)](
        x, x.stride(0), x.stride(1), mm, mm.stride(0), mm.stride(1), scales,
        noise if noise is not None else scales, 0 if seed is None else seed & 0x7FFFFFFF, cols, numel, nbytes,
        packed, out if out is not None else scales,
        BITS=bits, QMAX=qmax, HAS_M=m is not None, NOISE=mode, WANT_OUT=want_out, BLOCK=block,
        enable_fp_fusion=False,
    )
    return packed, scales, out
