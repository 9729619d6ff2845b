"""CPU codec throughput: the int8 (or int4) all-reduce codec as the peer runs it, against the plain torch reference.

The reference is what the issue measured (``kernels/quant.py`` on the whole vector, one thread): the
vector as ``[blocks, 2048]`` rows through :func:`~potluck.kernels.quant.quantize_rows` (absmax,
divide, round, clamp, int8, one full-size temporary per operation) and its bytes taken for the wire;
decoding is :func:`~potluck.kernels.quant.dequantize_rows` into a fresh vector. Ours is the path an
all-reduce member runs: :class:`~potluck.compression.stream.EncodedStream` cutting the vector into
1 MiB chunks (which stay in cache between passes) encoded on ``--threads`` codec workers, decoded
straight into a reused output with ``decode_into``, chunks on the workers (as a member decodes the
streams of several senders at once); and the owner's reduction, three members' contributions summed
in float32 and re-quantized a chunk at a time, against sum + encode of whole vectors.

With ``--codec int4`` (blocks of ``--block``, 128 for int4 by default) the codec is the 4-bit one and the
reference adds :func:`~potluck.kernels.quant.pack_bits` / :func:`~potluck.kernels.quant.unpack_bits` at 4 bits.
Both sides produce the same bytes (checked). Figures are GB/s of float32 input; the reference runs
with one torch thread, ours with one torch thread per worker. Prints one JSON line; the target
(issue 17) is ours >= 3x the reference with threads.

    python benchmarks/codec_throughput.py [--numel 16000000] [--threads 2] [--reps 5] [--codec int8|int4] [--block 2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from potluck.compression.aggregate import Reduction
from potluck.compression.int8 import Encoded, make_codec
from potluck.compression.stream import EncodedStream
from potluck.kernels.quant import dequantize_rows, pack_bits, quantize_rows, unpack_bits

CHUNK_BYTES = 1 << 20


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``reps`` calls, after one warm-up call."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=16_001_024)  # 7813 blocks of 2048
    ap.add_argument("--threads", type=int, default=2, help="codec workers (ours)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--members", type=int, default=3, help="contributions the owner reduces")
    ap.add_argument("--codec", choices=["int8", "int4"], default="int8")
    ap.add_argument("--block", type=int, default=0, help="elements per scale (0: 2048 for int8, 128 for int4)")
    args = ap.parse_args()
    block = args.block or (2048 if args.codec == "int8" else 128)
    bits = 8 if args.codec == "int8" else 4
    if args.numel % block:
        raise SystemExit(f"--numel must be a multiple of {block} (the reference has no partial block)")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(args.numel, generator=gen).mul_(0.01) for _ in range(args.members)]
    x = xs[0]
    codec = make_codec(args.codec, block)
    pool = ThreadPoolExecutor(args.threads, thread_name_prefix="codec")
    gb = args.numel * 4 / 1e9

    # -- encode
    def ref_encode(v: torch.Tensor = x) -> tuple[bytes, bytes]:
        codes, scales = quantize_rows(v.view(-1, block), bits)
        return pack_bits(codes, bits).numpy().tobytes(), scales.numpy().tobytes()

    def our_encode(v: torch.Tensor = x) -> list:
        return list(EncodedStream.of("x", v, codec, CHUNK_BYTES, pool))

    ref_codes, ref_scales = ref_encode()
    chunks = our_encode()
    if b"".join(c.payload for c in chunks) != ref_codes or b"".join(c.scales for c in chunks) != ref_scales:
        raise SystemExit("our encoding differs from the reference's")
    enc_ref, enc_ours = timed(ref_encode, args.reps), timed(our_encode, args.reps)

    # -- decode
    codes_t, scales_t = quantize_rows(x.view(-1, block), bits)
    packed_t = pack_bits(codes_t, bits)
    out = torch.empty(args.numel)

    def ref_decode() -> torch.Tensor:
        return dequantize_rows(unpack_bits(packed_t, bits, args.numel).view(-1, block), scales_t).reshape(-1)

    def decode_chunk(c) -> None:  # type: ignore[no-untyped-def]
        codec.decode_into(Encoded(c.codec, c.numel, c.payload, c.scales, c.bits), out[c.offset : c.offset + c.numel])

    def our_decode() -> None:
        list(pool.map(decode_chunk, chunks))

    our_decode()
    if not torch.equal(out, ref_decode()):
        raise SystemExit("our decoding differs from the reference's")
    dec_ref, dec_ours = timed(ref_decode, args.reps), timed(our_decode, args.reps)

    # -- the owner's reduction: decode every member's contribution, average in float32, re-encode
    # (both from decoded contributions: decoding them is the decode figure above)
    decoded = {f"m{k}": dequantize_rows(*quantize_rows(v.view(-1, block), bits)).reshape(-1) for k, v in enumerate(xs)}

    def ref_reduce() -> tuple[bytes, bytes]:
        total = torch.zeros(args.numel)
        for k in sorted(decoded):
            total += decoded[k]
        return ref_encode(total / len(decoded))

    reduction = Reduction(decoded, sorted(decoded), [], [], {})

    def our_reduce() -> list:
        return list(EncodedStream("x", args.numel, reduction.mean, codec, CHUNK_BYTES, pool))

    red_ours_out = our_reduce()
    red_ref_codes, _ = ref_reduce()
    same_reduce = b"".join(c.payload for c in red_ours_out) == red_ref_codes
    red_ref, red_ours = timed(ref_reduce, max(1, args.reps // 2)), timed(our_reduce, max(1, args.reps // 2))
    pool.shutdown()

    def rates(ref_s: float, ours_s: float, scale: float = 1.0) -> dict:
        return {"reference_gb_s": round(scale * gb / ref_s, 3), "ours_gb_s": round(scale * gb / ours_s, 3),
                "reference_s": round(ref_s, 4), "ours_s": round(ours_s, 4), "speedup": round(ref_s / ours_s, 2)}

    print(json.dumps({
        "benchmark": "codec_throughput", "codec": args.codec, "block": block, "numel": args.numel,
        "threads": args.threads,
        "encode": rates(enc_ref, enc_ours), "decode": rates(dec_ref, dec_ours),
        # GB/s of the members' float32 input: members x numel x 4 bytes
        "owner_reduce": {**rates(red_ref, red_ours, len(xs)), "same_codes_as_reference": same_reduce},
        "target": "ours >= 3x the reference (encode and decode)",
        "met": enc_ref / enc_ours >= 3 and dec_ref / dec_ours >= 3,
    }))


if __name__ == "__main__":
    main()
