"""The int4 codec against an independent numpy reference, its wire checks, and its place in streams and audits."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from potluck.compression.aggregate import recompute
from potluck.compression.int4 import Int4BlockCodec
from potluck.compression.int8 import MAX_ABS, CodecError, Encoded, Int8BlockCodec, make_codec
from potluck.compression.stream import Assembler, chunk_elements, encode_chunks
from potluck.kernels.quant import pack_bits, quantize_rows
from potluck.peer.reduce.allreduce import shard_bounds


def numpy_int4(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Independent reference: per-block absmax / 7, round half to even, clamp to [-7, 7], then nibbles
    ``code + 7``, element 2i low and 2i + 1 high, a zero high nibble after an odd last element.
    Returns (codes, packed bytes, scales, decoded)."""
    x = np.asarray(x, np.float32)
    n = len(x)
    xb = np.concatenate([x, np.zeros((-n) % block, np.float32)]).reshape(-1, block)
    scales = (np.abs(xb).max(axis=1) / np.float32(7)).astype(np.float32) if n else np.zeros(0, np.float32)
    safe = np.where(scales > 0, scales, np.float32(1)).astype(np.float32)
    codes = np.clip(np.round(xb / safe[:, None]), -7, 7).astype(np.int8).reshape(-1)[:n]
    nibbles = [int(c) + 7 for c in codes] + ([0] if n % 2 else [])
    packed = np.array([nibbles[i] | (nibbles[i + 1] << 4) for i in range(0, len(nibbles), 2)], np.uint8)
    decoded = (codes.astype(np.float32) * np.repeat(scales, block)[:n]).astype(np.float32)
    return codes, packed, scales, decoded


def rand(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.logspace(-3, 2, n)).astype(np.float32)  # wildly varying magnitudes
    if n:
        x[rng.integers(0, n)] = 0.0
    return x


@pytest.mark.parametrize("n,block", [(0, 16), (1, 16), (2, 2), (3, 16), (1000, 16), (4096, 2048), (5001, 128),
                                     (257, 256), (129, 128)])
def test_int4_equals_numpy_reference(n: int, block: int) -> None:
    x = rand(n, n + block)
    codec = Int4BlockCodec(block)
    enc = codec.encode(torch.from_numpy(x))
    codes, packed, scales, decoded = numpy_int4(x, block)
    assert (enc.codec, enc.numel, enc.bits) == ("int4", n, 4)
    assert np.frombuffer(enc.payload, np.uint8).tolist() == packed.tolist()
    assert np.frombuffer(enc.scales, np.float32).tobytes() == scales.tobytes()
    assert codec.decode(enc).numpy().tobytes() == decoded.tobytes()
    assert enc.nbytes == (n + 1) // 2 + 4 * -(-n // block)


def test_packing_order_by_hand() -> None:
    codec = Int4BlockCodec(4)
    enc = codec.encode(torch.tensor([7.0, -7.0, 0.0, 3.0]))  # scale 1: codes 7, -7, 0, 3 -> nibbles 14, 0, 7, 10
    assert enc.payload == bytes([0x0E, 0xA7]) and np.frombuffer(enc.scales, np.float32).tolist() == [1.0]
    odd = codec.encode(torch.tensor([7.0, 1.0, 2.0]))  # nibbles 14, 8, 9 and a zero pad nibble
    assert odd.payload == bytes([0x8E, 0x09])
    assert codec.decode(odd).tolist() == [7.0, 1.0, 2.0]


def test_packing_is_the_libraries_4_bit_stream() -> None:
    """The codes are those of ``quantize_rows`` at 4 bits, packed as ``pack_bits`` packs them."""
    x = torch.from_numpy(rand(4097, 3))
    enc = Int4BlockCodec(64).encode(x)
    rows = torch.nn.functional.pad(x, (0, (-4097) % 64)).view(-1, 64)
    codes, scales = quantize_rows(rows, 4)
    assert enc.payload == pack_bits(codes.reshape(-1)[:4097], 4).numpy().tobytes()
    assert enc.scales == scales.numpy().tobytes()


def test_round_half_to_even() -> None:
    codec = Int4BlockCodec(10)
    x = torch.tensor([7.0, 0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 5.5, 6.5])  # scale exactly 1
    assert codec.decode(codec.encode(x)).tolist() == [7.0, 0.0, 2.0, 2.0, 4.0, 0.0, -2.0, -2.0, 6.0, 6.0]
    assert numpy_int4(x.numpy(), 10)[0].tolist() == [7, 0, 2, 2, 4, 0, -2, -2, 6, 6]


def test_blocks_of_zeros() -> None:
    codec = Int4BlockCodec(16)
    x = torch.zeros(40)
    x[20] = 3.0  # a block of zeros, a block with one value, a partial block of zeros
    enc = codec.encode(x)
    s = np.float32(3) / np.float32(7)
    assert np.frombuffer(enc.scales, np.float32).tolist() == [0.0, s, 0.0]
    want = np.zeros(40, np.float32)
    want[20] = np.float32(7) * s  # (3.0000002: the step of 3/7 in float32, times 7)
    assert codec.decode(enc).numpy().tobytes() == want.tobytes()
    neg = codec.encode(torch.full((33,), -0.0))  # negative zeros get the scale +0.0 and the code 0
    assert np.frombuffer(neg.scales, np.float32).tobytes() == np.zeros(3, np.float32).tobytes()
    assert set(neg.payload[:-1]) == {0x77} and neg.payload[-1] == 0x07


def test_extreme_values() -> None:
    codec = Int4BlockCodec(8)
    x = np.array([1e6, -1e6, 1e-40, -1e-45, 3.0, 0.0, 1.0, 2.0,    # MAX_ABS itself, subnormals
                  1e-40, -1e-45, 1e-44, 0.0, 0.0, 0.0, 0.0, 0.0,   # a block of subnormals only
                  3e38, -3.4e38, 1.0], np.float32)                 # near float32's limit
    enc = codec.encode(torch.from_numpy(x))
    codes, packed, scales, decoded = numpy_int4(x, 8)
    assert enc.payload == packed.tobytes() and enc.scales == scales.tobytes()
    with pytest.raises(CodecError, match="beyond"):  # 3e38 encodes (finite), but no receiver takes it
        codec.decode(enc)
    first = Encoded("int4", 16, enc.payload[:8], enc.scales[:8], 4)
    assert codec.decode(first).numpy().tobytes() == decoded[:16].tobytes()


def test_error_on_each_element_is_at_most_half_a_step() -> None:
    x = torch.from_numpy(rand(100_003, 0))
    for block in (16, 128, 2048):
        codec = Int4BlockCodec(block)
        enc = codec.encode(x)
        y = codec.decode(enc)
        step = torch.from_numpy(np.frombuffer(enc.scales, np.float32).copy()).repeat_interleave(block)[: x.numel()]
        assert bool(((x - y).abs() <= step / 2 * (1 + 1e-6) + 1e-30).all()), block


def test_bytes_against_int8() -> None:
    """The target of the codec: at most 0.55x int8's bytes per element, at the default blocks of each."""
    n = 1 << 20
    x = torch.randn(n)
    int8 = Int8BlockCodec(2048).encode(x).nbytes
    int4 = Int4BlockCodec().encode(x).nbytes
    assert int8 == n + 4 * n // 2048 and int4 == n // 2 + 4 * n // 128
    assert int4 / int8 <= 0.55


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [0, 17, 40])  # a whole block, another whole block, the partial last block
def test_encode_refuses_nan_and_inf_anywhere(bad: float, where: int) -> None:
    x = torch.randn(41)
    x[where] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        Int4BlockCodec(16).encode(x)


def _scales(e: Encoded, value: float) -> bytes:
    return np.full(len(e.scales) // 4, value, np.float32).tobytes()


def _set_byte(payload: bytes, i: int, value: int) -> bytes:
    b = bytearray(payload)
    b[i] = value
    return bytes(b)


BAD: list[tuple[str, Callable[[Encoded], Encoded], str]] = [
    ("codec", lambda e: Encoded("int8", e.numel, e.payload, e.scales, 4), "expected codec"),
    ("bits", lambda e: Encoded("int4", e.numel, e.payload, e.scales, 8), "4 bits"),
    ("payload short", lambda e: Encoded("int4", e.numel, e.payload[:-1], e.scales, 4), "needs 51 bytes"),
    ("payload long", lambda e: Encoded("int4", e.numel, e.payload + b"\x77", e.scales, 4), "needs 51 bytes"),
    ("odd count, even bytes", lambda e: Encoded("int4", e.numel - 1, e.payload, e.scales, 4), "needs 50 bytes"),
    ("negative count", lambda e: Encoded("int4", -1, b"", b"", 4), "negative"),
    ("scales short", lambda e: Encoded("int4", e.numel, e.payload, e.scales[:-4], 4), "scales"),
    ("scales long", lambda e: Encoded("int4", e.numel, e.payload, e.scales + e.scales[:4], 4), "scales"),
    ("NaN scale", lambda e: Encoded("int4", e.numel, e.payload, _scales(e, np.nan), 4), "finite"),
    ("Inf scale", lambda e: Encoded("int4", e.numel, e.payload, _scales(e, np.inf), 4), "finite"),
    ("negative scale", lambda e: Encoded("int4", e.numel, e.payload, _scales(e, -1.0), 4), "non-negative"),
    ("huge scale", lambda e: Encoded("int4", e.numel, e.payload, _scales(e, 2e5), 4), "beyond"),
    ("low nibble 15", lambda e: Encoded("int4", e.numel, _set_byte(e.payload, 3, 0x7F), e.scales, 4), "nibble 15"),
    ("high nibble 15", lambda e: Encoded("int4", e.numel, _set_byte(e.payload, 0, 0xF7), e.scales, 4), "nibble 15"),
    ("padding nibble", lambda e: Encoded("int4", e.numel, _set_byte(e.payload, 50, 0x17), e.scales, 4), "padding"),
]


@pytest.mark.parametrize("mutate,match", [pytest.param(m, s, id=i) for i, m, s in BAD])
def test_decode_rejects_bad_input(mutate: Callable[[Encoded], Encoded], match: str) -> None:
    codec = Int4BlockCodec(16)
    x = torch.randn(101)
    x[100] = 0.0  # the last (padding) byte is then 0x07
    enc = codec.encode(x)
    assert enc.payload[50] == 0x07 and codec.decode(enc).numel() == 101
    bad = mutate(enc)
    with pytest.raises(CodecError, match=match):
        codec.decode(bad)
    out = torch.full((max(bad.numel, 0),), 7.0)  # decoding in place: a bad message leaves the buffer as it was
    with pytest.raises(CodecError, match=match):
        codec.decode_into(bad, out)
    assert bool((out == 7.0).all())


def test_decode_into_needs_a_buffer_of_the_right_size() -> None:
    codec = Int4BlockCodec(16)
    enc = codec.encode(torch.randn(41))
    with pytest.raises(CodecError, match="do not fit"):
        codec.decode_into(enc, torch.empty(40))
    with pytest.raises(ValueError, match="float32"):
        codec.decode_into(enc, torch.empty(41, dtype=torch.float64))


def test_block_must_be_even() -> None:
    for bad in (0, 1, 127):
        with pytest.raises(ValueError, match="even"):
            Int4BlockCodec(bad)
    with pytest.raises(ValueError, match="even"):
        make_codec("int4", 1001)
    codec = make_codec("int4", 256)
    assert isinstance(codec, Int4BlockCodec) and codec.block_size == codec.align == 256
    assert getattr(make_codec("int4"), "block_size", None) == 128 and getattr(make_codec("int8"), "block_size", None) == 2048
    with pytest.raises(CodecError, match="int4"):
        make_codec("int2")


def test_stream_chunks_fall_on_whole_blocks_and_bytes() -> None:
    codec = Int4BlockCodec(64)
    assert chunk_elements(codec, 4096) == 8192  # half a byte an element: twice int8's elements a chunk
    x = torch.from_numpy(rand(20_001, 5))
    chunks = list(encode_chunks("g", x, codec, chunk_bytes=4096))
    assert [c.numel for c in chunks] == [8192, 8192, 3617]
    assert all(c.offset % 64 == 0 and len(c.payload) <= 4096 for c in chunks)
    asm = Assembler("g", 20_001, codec)
    for c in chunks:
        asm.add(c)
    assert asm.result().numpy().tobytes() == numpy_int4(x.numpy(), 64)[3].tobytes()  # chunks are whole blocks
    for lo, hi in shard_bounds(20_001, 3, codec.align)[:-1]:
        assert lo % 64 == 0 and hi % 64 == 0  # every shard but the last holds whole blocks, so whole bytes


def test_recompute_is_deterministic_and_is_the_owners_encoding() -> None:
    """An auditor's recomputation of an owner's int4 result gives the same chunk digests, run after run, and
    they are those of encoding the robust mean chunk by chunk."""
    codec = Int4BlockCodec(128)
    contributions = {f"peer{i}": codec.decode(codec.encode(torch.from_numpy(rand(5000, i)))) for i in range(3)}
    a = recompute(contributions, 5000, codec, 4096, "shard0", 4.0, -0.1)
    b = recompute(dict(reversed(list(contributions.items()))), 5000, codec, 4096, "shard0", 4.0, -0.1)
    assert a == b and len(a.digests) == 1 + 5000 // 8192
    assert a.contributors == sorted(contributions)


def test_config_takes_int4_with_its_own_block_by_default() -> None:
    from potluck.compression.int4 import DEFAULT_BLOCK
    from potluck.protos.config.files import ConfigError, apply_overrides, parse_config
    from potluck.protos.config.runconfig import INT4_BLOCK_SIZE, RunConfig

    assert INT4_BLOCK_SIZE == DEFAULT_BLOCK
    cfg = apply_overrides(RunConfig(), {"sync.codec": "int4"})
    assert (cfg.sync.codec, cfg.sync.block_size) == ("int4", 128)
    assert cfg.model_dump(exclude_unset=True)["sync"]["block_size"] == 128  # set, so it travels as is
    assert parse_config({"sync": {"codec": "int4", "block_size": 2048}}, source="x").sync.block_size == 2048
    assert RunConfig().sync.block_size == 2048 and RunConfig().sync.codec == "int8"
    with pytest.raises(ConfigError, match="block_size must be even"):
        apply_overrides(RunConfig(), {"sync.codec": "int4", "sync.block_size": 1001})
    codec = make_codec(cfg.sync.codec, cfg.sync.block_size)
    assert isinstance(codec, Int4BlockCodec) and codec.block_size == 128


CODE_BYTE = st.builds(lambda lo, hi: lo | hi << 4, st.integers(0, 14), st.integers(0, 14))
ANY_SCALE = st.one_of(st.floats(0, 1e4, width=32), st.floats(width=32))


@settings(max_examples=300, deadline=None)
@given(numel=st.integers(-1, 70), data=st.data())
def test_any_message_decodes_to_bounded_finite_values_or_is_refused(numel: int, data: st.DataObject) -> None:
    """Messages of the right sizes (mostly), bytes mostly of codes, scales of any float32: refused (and nothing
    written), or decoded to finite values within MAX_ABS, each its nibble minus 7 times its block's scale."""
    nbytes, nblocks = (max(numel, 0) + 1) // 2, -(-max(numel, 0) // 16)
    payload = bytes(data.draw(st.lists(st.one_of(CODE_BYTE, st.integers(0, 255)), min_size=nbytes,
                                       max_size=nbytes + data.draw(st.sampled_from([0, 0, 0, 1])))))
    scales = np.array(data.draw(st.lists(ANY_SCALE, min_size=nblocks, max_size=nblocks)), np.float32).tobytes()
    codec = Int4BlockCodec(16)
    out = torch.full((max(numel, 0),), 7.0)
    try:
        codec.decode_into(Encoded("int4", numel, payload, scales, 4), out)
    except CodecError:
        event("refused")
        assert bool((out == 7.0).all())  # refused: nothing written
        return
    event("decoded")
    assert bool(torch.isfinite(out).all()) and (not out.numel() or float(out.abs().max()) <= MAX_ABS)
    nibbles = [b >> shift & 15 for b in payload for shift in (0, 4)][:numel]
    per_element = np.repeat(np.frombuffer(scales, np.float32), 16)[:numel]
    want = (np.array(nibbles, np.float32) - np.float32(7)) * per_element
    assert out.numpy().tobytes() == want.astype(np.float32).tobytes()
