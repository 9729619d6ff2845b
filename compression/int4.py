"""The 4-bit codec of the outer all-reduce: two codes a byte, one float32 absmax scale per block.

A flat float32 vector is cut into blocks of ``block_size`` elements (an even number). Each block gets
the scale ``s = max|block| / 7`` (a float32 division) and the codes ``q = round(x / s)`` (float32
division, round half to even, clamped to ``[-7, 7]``): the same symmetric, midtread quantization as
the int8 codec (:func:`~potluck.compression.int8.quantize_vector`, with ``qmax`` 7 instead of 127),
so the error on an element is at most ``s / 2`` and a block of zeros gets scale 0 and decodes to zeros.

Packing: code ``q`` travels as the unsigned nibble ``q + 7`` (0..14; 15 is never sent); element
``2i`` is the low nibble of byte ``i`` and element ``2i + 1`` its high nibble. A vector of odd length
ends with a byte whose high nibble is 0 (padding, not a code). This is the stream
:func:`~potluck.kernels.quant.pack_bits` writes at 4 bits. The wire cost is ``0.5 + 4 / block_size``
bytes per element: 0.531 at the default block of 128, 0.53x of int8's ``1 + 4/2048``.

Blocks are smaller than int8's because 15 levels leave little room for an outlier: a block's one large
value sets the step for all the others, so the error of the rest grows with the block (measured in
``benchmarks/outer_codec_quality.py``; ``docs/benchmarks.md`` has the figures).

``align`` is the block size: a stream's chunks and an all-reduce's shards start on whole blocks, hence
on whole bytes, and each chunk is encoded on its own, as int8's are. Encoding is a deterministic
function of the float32 values (the owner's re-quantized mean included), so any two machines make the
same bytes from the same mean, which verified reduction's recomputation relies on; a CUDA vector is
quantized where it lies by :mod:`potluck.kernels.triton_int4`, bit for bit the same.

Decoding checks what int8's does (codec, payload and scale sizes, finite non-negative scales, no
decoded value beyond ``MAX_ABS``) and that every nibble is a code (not 15) and the padding nibble of an
odd-length vector is 0. A bad message raises :class:`CodecError` and leaves the output untouched.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from potluck.compression.int8 import MAX_ABS, CodecError, Encoded, decode_target, flat_float, quantize_vector
from potluck.kernels import device as kdevice

QMAX = 7
DEFAULT_BLOCK = 128


def packed_len(numel: int) -> int:
    """Bytes of ``numel`` packed 4-bit codes."""
    return (numel + 1) // 2


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in ``[-7, 7]`` -> uint8 bytes, ``code + 7`` in the low nibble for even positions, the
    high nibble for odd ones (a last lone code leaves its high nibble 0)."""
    n = codes.numel()
    unsigned = codes.add(QMAX).view(torch.uint8)
    packed = unsigned[0::2].clone()
    packed[: n // 2].bitwise_or_(unsigned[1::2].bitwise_left_shift(4))
    return packed


class Int4BlockCodec:
    """4-bit codes, two a byte, with one float32 absmax scale per ``block_size`` elements."""

    name = "int4"
    bytes_per_element: float = 0.5
    bits = 4

    def __init__(self, block_size: int = DEFAULT_BLOCK) -> None:
        if block_size < 2 or block_size % 2:
            raise ValueError(f"int4 block_size must be even and at least 2 (two codes a byte), got {block_size}")
        self.block_size = block_size
        self.align = block_size

    def _blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def encode(self, x: torch.Tensor) -> Encoded:
        """Packed codes and scales of a flat vector; a CUDA vector is quantized where it lies (Triton, same bits)."""
        on_device = kdevice.int4_quantize(x.detach(), self.block_size) if x.dim() == 1 else None
        if on_device is not None:
            copies = [kdevice.start_host_copy(t) for t in on_device]
            packed, scales = (c.wait() for c in copies)
            numel = x.numel()
        else:
            flat = flat_float(x)
            codes, scales = quantize_vector(flat, self.block_size, QMAX)
            packed, numel = pack_nibbles(codes), flat.numel()
        if not bool(torch.isfinite(scales).all()):  # a NaN or Inf anywhere makes its block's absmax one
            raise CodecError("refusing to encode NaN or Inf")
        return Encoded(self.name, numel, packed.numpy().tobytes(), scales.numpy().tobytes(), bits=4)

    def decode(self, enc: Encoded, device: torch.device | str | None = None) -> torch.Tensor:
        """The float32 vector ``enc`` holds, on CPU or on ``device`` (a CUDA device decodes there, same bits)."""
        if device is not None and torch.device(device).type != "cpu":
            packed, scales = self._checked(enc)
            out = kdevice.int4_dequantize(torch.from_numpy(packed.copy()).to(device),
                                          torch.from_numpy(scales.copy()).to(device), self.block_size, enc.numel)
            return out if out is not None else self.decode(enc).to(device)
        out = torch.empty(max(enc.numel, 0), dtype=torch.float32)
        self.decode_into(enc, out)
        return out

    def decode_into(self, enc: Encoded, out: torch.Tensor) -> None:
        """Decode into ``out`` (a float32 CPU tensor of ``enc.numel`` elements); on error it is left as it was.

        Each element is ``float(code) * scale``, one float32 multiply: the bits the Triton kernel gives."""
        packed, scales = self._checked(enc)
        n, bs = enc.numel, self.block_size
        target = decode_target(out, n)
        full = n - n % bs
        with warnings.catch_warnings():  # read-only views of the message: nothing here writes to them
            warnings.simplefilter("ignore", UserWarning)
            packed_t, scales_t = torch.from_numpy(packed), torch.from_numpy(scales)
        target[0::2].copy_(packed_t.bitwise_and(0x0F))
        target[1::2].copy_(packed_t[: n // 2].bitwise_right_shift(4))
        target.sub_(QMAX)  # small integers: exact
        target[:full].view(-1, bs).mul_(scales_t[: full // bs, None])
        if full < n:
            target[full:].mul_(scales_t[-1])

    def _checked(self, enc: Encoded) -> tuple[np.ndarray, np.ndarray]:
        """The packed codes and scales of ``enc`` as read-only views of the message, once every check passed."""
        if enc.codec != self.name:
            raise CodecError(f"expected codec {self.name!r}, got {enc.codec!r}")
        if enc.bits not in (0, 4):
            raise CodecError(f"int4 codes are 4 bits, the message says {enc.bits}")
        n, bs = enc.numel, self.block_size
        if n < 0:
            raise CodecError(f"an element count cannot be negative, got {n}")
        nblocks = self._blocks(n)
        if len(enc.payload) != packed_len(n):
            raise CodecError(f"int4 payload of {n} elements needs {packed_len(n)} bytes, got {len(enc.payload)}")
        if len(enc.scales) != 4 * nblocks:
            raise CodecError(
                f"int4 payload of {n} elements in blocks of {bs} needs {nblocks} scales "
                f"({4 * nblocks} bytes), got {len(enc.scales)} bytes"
            )
        scales = np.frombuffer(enc.scales, dtype=np.float32)
        if not np.isfinite(scales).all() or bool((scales < 0).any()):
            raise CodecError("int4 scales must be finite and non-negative")
        if scales.size and float(scales.max()) * QMAX > MAX_ABS:
            raise CodecError(f"int4 scales decode to values beyond +-{MAX_ABS:g}")
        packed = np.frombuffer(enc.payload, dtype=np.uint8)
        if packed.size:
            if int((packed & 0x0F).max()) > 2 * QMAX or int((packed >> 4).max()) > 2 * QMAX:
                raise CodecError("int4 nibble 15 is outside the symmetric range [-7, 7] (sent as 0..14)")
            if n % 2 and int(packed[-1]) >> 4:
                raise CodecError("the padding nibble after an odd number of int4 codes must be 0")
        return packed, scales
