"""The int8 outer-gradient codec and chunked streams: error bounds, golden numbers, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from potluck.compression.aggregate import reduce_mean
from potluck.compression.int8 import CodecError, Encoded, Int8BlockCodec, RawCodec, make_codec
from potluck.compression.stream import Assembler, EncodedStream, WireError, encode_chunks, tensor_digest
from potluck.peer.reduce.allreduce import shard_bounds
from potluck.protos import potluck_pb2 as pb


def numpy_int8(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Independent reference: per-block absmax / 127, round half to even, clamp."""
    n = len(x)
    pad = (-n) % block
    xb = np.concatenate([x, np.zeros(pad, np.float32)]).reshape(-1, block).astype(np.float32)
    scales = (np.abs(xb).max(axis=1) / np.float32(127)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))
    codes = np.clip(np.round(xb / safe[:, None]), -127, 127).astype(np.int8)
    decoded = (codes.astype(np.float32) * scales[:, None]).reshape(-1)[:n]
    return codes.reshape(-1)[:n], scales, decoded


@pytest.mark.parametrize("n,block", [(1, 16), (1000, 16), (4096, 2048), (5000, 2048), (3, 256)])
def test_int8_equals_numpy_reference(n: int, block: int) -> None:
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * rng.uniform(0.01, 10)).astype(np.float32)
    x[rng.integers(0, n)] = 0.0
    codec = Int8BlockCodec(block)
    enc = codec.encode(torch.from_numpy(x))
    codes, scales, decoded = numpy_int8(x, block)
    assert np.frombuffer(enc.payload, np.int8).tolist() == codes.tolist()
    assert np.frombuffer(enc.scales, np.float32).tolist() == scales.tolist()
    assert codec.decode(enc).numpy().tolist() == decoded.tolist()


def test_int8_round_trip_error_bound() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(100_003, generator=gen) * torch.logspace(-3, 2, 100_003)  # wildly varying magnitudes
    codec = Int8BlockCodec(1024)
    y = codec.decode(codec.encode(x))
    pad = (-x.numel()) % 1024
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, 1024)
    bound = (blocks.abs().amax(dim=1) / 254).repeat_interleave(1024)[: x.numel()]
    assert bool(((x - y).abs() <= bound * (1 + 1e-6) + 1e-30).all())
    assert codec.encode(x).nbytes / (4 * x.numel()) < 0.26


def test_zero_block_and_empty_vector() -> None:
    codec = Int8BlockCodec(16)
    z = torch.zeros(40)
    assert torch.equal(codec.decode(codec.encode(z)), z)
    e = torch.zeros(0)
    assert codec.decode(codec.encode(e)).numel() == 0


def test_raw_codec_round_trip_is_exact() -> None:
    x = torch.randn(1000)
    assert torch.equal(RawCodec().decode(RawCodec().encode(x)), x)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda e: Encoded("int8", e.numel, e.payload[:-1], e.scales, 8), "needs"),
        (lambda e: Encoded("int8", e.numel, e.payload, e.scales[:-4], 8), "scales"),
        (lambda e: Encoded("int8", e.numel, e.payload, np.full(len(e.scales) // 4, np.nan, np.float32).tobytes(), 8), "finite"),
        (lambda e: Encoded("int8", e.numel, e.payload, np.full(len(e.scales) // 4, -1, np.float32).tobytes(), 8), "non-negative"),
        (lambda e: Encoded("int8", e.numel, bytes([0x80]) + e.payload[1:], e.scales, 8), "-128"),
        (lambda e: Encoded("raw", e.numel, e.payload, e.scales, 8), "expected codec"),
    ],
)
def test_int8_decode_rejects_bad_input(mutate, match) -> None:  # type: ignore[no-untyped-def]
    codec = Int8BlockCodec(16)
    enc = codec.encode(torch.randn(100))
    with pytest.raises(CodecError, match=match):
        codec.decode(mutate(enc))
    out = torch.full((100,), 7.0)  # decoding in place: a bad message leaves the buffer as it was
    with pytest.raises(CodecError, match=match):
        codec.decode_into(mutate(enc), out)
    assert bool((out == 7.0).all())


def test_raw_decode_rejects_nan_and_size() -> None:
    raw = RawCodec()
    with pytest.raises(CodecError, match="NaN"):
        raw.decode(Encoded("raw", 2, np.array([1.0, np.nan], np.float32).tobytes()))
    with pytest.raises(CodecError, match="needs 8 bytes"):
        raw.decode(Encoded("raw", 2, b"\0" * 7))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [0, 17, 40])  # a whole block, another whole block, the partial last block
def test_encode_refuses_nan_and_inf_anywhere(bad: float, where: int) -> None:
    x = torch.randn(41)
    x[where] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        Int8BlockCodec(16).encode(x)


def test_decode_into_needs_a_buffer_of_the_right_size() -> None:
    codec = Int8BlockCodec(16)
    enc = codec.encode(torch.randn(40))
    with pytest.raises(CodecError, match="do not fit"):
        codec.decode_into(enc, torch.empty(39))
    with pytest.raises(ValueError, match="float32"):
        codec.decode_into(enc, torch.empty(40, dtype=torch.float64))


def test_encode_refuses_nan() -> None:
    with pytest.raises(CodecError):
        Int8BlockCodec(16).encode(torch.tensor([1.0, float("inf")]))
    with pytest.raises(CodecError):
        make_codec("zstd")


def test_stream_round_trip_and_chunking() -> None:
    codec = Int8BlockCodec(64)
    x = torch.randn(10_000)
    chunks = list(encode_chunks("g", x, codec, chunk_bytes=4096))
    assert len(chunks) == 3 and all(c.numel % 64 == 0 for c in chunks[:-1])
    asm = Assembler("g", 10_000, codec)
    for c in chunks:
        asm.add(c)
    assert torch.equal(asm.result(), codec.decode(codec.encode(x)))


@pytest.mark.parametrize("codec", [Int8BlockCodec(64), make_codec("int4", 64), RawCodec()], ids=["int8", "int4", "raw"])
def test_a_chunk_hashed_from_bytes_in_hand_is_hashed_as_from_its_message(codec) -> None:  # type: ignore[no-untyped-def]
    """The digests a sender signs (made from the codec's output, on its worker) and a receiver checks (from what
    it decoded) are those of the messages themselves, as an auditor recomputes them; a changed byte changes them."""
    x = torch.randn(10_000)
    stream = EncodedStream.of("g", x, codec, 2048)
    chunks = list(stream)
    assert len(chunks) >= 3 and stream.digests() == [tensor_digest(c) for c in chunks]
    wire = [pb.Tensor.FromString(c.SerializeToString()) for c in chunks]  # (as a receiver parses them)
    asm = Assembler("g", 10_000, codec)
    assert [tensor_digest(t, asm.add(t)) for t in wire] == stream.digests()
    changed = pb.Tensor()
    changed.CopyFrom(wire[1])
    changed.payload = bytes([changed.payload[0] ^ 1]) + changed.payload[1:]
    assert tensor_digest(changed) != stream.digest(1)
    assert tensor_digest(wire[1], Encoded(changed.codec, changed.numel, changed.payload, changed.scales, changed.bits)) != \
        stream.digest(1)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("name", "other", "expected tensor"),
        ("dtype", "float16", "dtype"),
        ("codec", "raw", "codec"),
        ("bits", 4, "bits"),
        ("offset", 64, "offset"),
        ("numel", 20_000, "outside"),
    ],
)
def test_stream_rejects_mismatched_chunks(field: str, value: object, match: str) -> None:
    codec = Int8BlockCodec(64)
    chunk = next(encode_chunks("g", torch.randn(1000), codec, chunk_bytes=1 << 20))
    setattr(chunk, field, value)
    asm = Assembler("g", 1000, codec)
    with pytest.raises(WireError, match=match):
        asm.add(chunk)
    assert asm.filled == 0  # nothing was taken from the bad chunk


def test_stream_rejects_wrong_shape_and_incomplete() -> None:
    codec = RawCodec()
    chunk = next(encode_chunks("g", torch.randn(10), codec, 1 << 20))
    chunk.shape[:] = [11]
    with pytest.raises(WireError, match="shape"):
        Assembler("g", 10, codec).add(chunk)
    asm = Assembler("g", 20, codec)
    asm.add(pb.Tensor(name="g", dtype="float32", shape=[20], codec="raw", payload=bytes(40), offset=0, numel=10))
    with pytest.raises(WireError, match="ended"):
        asm.result()


def test_reduce_sums_decoded_values_in_fp32() -> None:
    """Two members at +127 codes: a sum of int8 codes would wrap; ours is the float32 mean."""
    codec = Int8BlockCodec(4)
    a = codec.decode(codec.encode(torch.tensor([1.0, 1.0, 1.0, 1.0])))
    b = codec.decode(codec.encode(torch.tensor([3.0, 3.0, 3.0, 3.0])))
    mean = reduce_mean({"b": b, "a": a}, 4)
    assert mean.dtype == torch.float32
    assert mean.tolist() == [2.0, 2.0, 2.0, 2.0]
    ref = (np.float32(a.numpy()) + np.float32(b.numpy())) / np.float32(2)
    assert mean.numpy().tolist() == ref.tolist()


def test_shard_bounds_cover_and_align() -> None:
    for numel, parts, align in [(10_000, 3, 64), (5, 4, 2), (0, 2, 8), (4096, 1, 2048)]:
        b = shard_bounds(numel, parts, align)
        assert b[0][0] == 0 and b[-1][1] == numel and len(b) == parts
        assert all(lo <= hi for lo, hi in b) and all(b[i][1] == b[i + 1][0] for i in range(parts - 1))
        assert all(lo % align == 0 or lo == numel for lo, _ in b)
