"""The Triton codec kernels return the torch reference's bits: run in Triton's interpreter on CPU.

``TRITON_INTERPRET=1`` must be set before the kernels are decorated, so it is set here, before
anything imports them; ``POTLUCK_TRITON=force`` then sends CPU tensors through the kernels (and
raises instead of falling back). The reference runs with ``POTLUCK_TRITON=off``. Sizes are small:
the interpreter runs each program instance in numpy.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib
import logging
from collections.abc import Iterator

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton; Linux x86_64 only)")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRITON_INTERPRET is set to something other than 1", allow_module_level=True)

from kernel_vectors import bits_of, rand

from potluck.compression.acsgd import AcsgdConfig, AcsgdSender
from potluck.compression.actcodec import ActCodec
from potluck.compression.aggregate import Reduction, reduce_mean
from potluck.compression.int8 import CodecError, Encoded, Int8BlockCodec
from potluck.kernels import device
from potluck.kernels.quant import dequantize_channels, pack_bits, quantize_channels
from potluck.kernels.triton_channels import quantize_pack
from potluck.kernels.triton_int8 import dequantize_blocks, mean_requantize, quantize_blocks

SIZES = (0, 1, 7, 2047, 2049, 10007)
# the interpreter computes in numpy, which warns where a refused NaN/Inf block is divided or multiplied
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


@contextlib.contextmanager
def policy(value: str) -> Iterator[None]:
    old = os.environ.get(device.ENV)
    os.environ[device.ENV] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[device.ENV]
        else:
            os.environ[device.ENV] = old


# -- int8 blocks ------------------------------------------------------------------------------------


def special_vectors() -> list[torch.Tensor]:
    x = rand(2049, 1)
    big = x.clone()
    big[:5] = torch.tensor([3e38, -3.4e38, 1e-40, -1e-45, 2.5])  # near the float32 limits, subnormals
    ties = torch.arange(-300, 300, dtype=torch.float32) / 2  # exact halves: round half to even
    ties[0] = -127 * 2  # absmax 254 so y = x / 2 exactly
    return [torch.zeros(3000), torch.full((2050,), -0.0), big, ties, torch.full((2048,), 7.0)]


@pytest.mark.parametrize("block", [2048, 1000, 5000])
def test_int8_quantize_is_the_codec_bit_for_bit(block: int) -> None:
    codec = Int8BlockCodec(block)
    cases = [rand(n, n) for n in SIZES] + special_vectors()
    for x in cases:
        with policy("off"):
            ref = codec.encode(x)
        codes, scales = quantize_blocks(x, block)
        assert bits_of(codes) == ref.payload, (x.numel(), block)
        assert bits_of(scales) == ref.scales, (x.numel(), block)
        per_element = np.repeat(np.frombuffer(ref.scales, np.float32), block)[: x.numel()]
        want = np.frombuffer(ref.payload, np.int8).astype(np.float32) * per_element  # decode, minus its limits
        assert bits_of(dequantize_blocks(codes, scales, block)) == want.tobytes()
        with policy("force"):
            assert codec.encode(x) == ref  # the codec's own dispatch takes the kernel


def test_int8_strided_and_half_inputs() -> None:
    codec = Int8BlockCodec(256)
    m = rand(3 * 1001, 3).view(1001, 3)
    for x in (m.t()[1], rand(9001, 4)[::3], rand(700, 5).half(), rand(700, 6).bfloat16()):
        assert not x.is_contiguous() or x.dtype != torch.float32
        with policy("off"):
            ref = codec.encode(x)
        codes, scales = quantize_blocks(x, 256)
        assert (bits_of(codes), bits_of(scales)) == (ref.payload, ref.scales)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_int8_refuses_non_finite(bad: float) -> None:
    codec = Int8BlockCodec(1000)
    for where in (0, 2500):  # a whole block, and the last partial one
        x = rand(2501, 7)
        x[where] = bad
        codes, scales = quantize_blocks(x, 1000)
        assert not bool(torch.isfinite(scales[where // 1000])), "a non-finite block must get a non-finite scale"
        with policy("force"), pytest.raises(CodecError, match="NaN or Inf"):
            codec.encode(x)
        with policy("off"), pytest.raises(CodecError, match="NaN or Inf"):
            codec.encode(x)


def stacked(encs: list[Encoded], n: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[k, n]`` codes and ``[k, blocks]`` scales of k messages, as an owner would upload them."""
    codes = np.stack([np.frombuffer(e.payload, np.int8) for e in encs]) if encs else np.zeros((0, n), np.int8)
    scales = np.stack([np.frombuffer(e.scales, np.float32) for e in encs]) if encs \
        else np.zeros((0, -(-n // block)), np.float32)
    return torch.from_numpy(codes.copy()), torch.from_numpy(scales.copy())


@pytest.mark.parametrize("n,k", [(10007, 3), (2049, 1), (2047, 4), (1, 2), (0, 3), (2049, 0)])
def test_owner_mean_is_decode_sum_encode(n: int, k: int) -> None:
    codec = Int8BlockCodec(2048)
    senders = [f"peer{i}" for i in (3, 1, 4, 0)[:k]]
    with policy("off"):
        encs = {s: codec.encode(rand(n, i) * (i + 1)) for i, s in enumerate(senders)}
        ref = codec.encode(reduce_mean({s: codec.decode(e) for s, e in encs.items()}, n))
    order = sorted(senders)  # aggregate's summation order
    codes, scales = stacked([encs[s] for s in order], n, 2048)
    out_codes, out_scales = mean_requantize(codes, scales, 2048)
    assert (bits_of(out_codes), bits_of(out_scales)) == (ref.payload, ref.scales)


@pytest.mark.parametrize("block", [1024, 5000])  # 5000: a block walked in two tiles
def test_owner_mean_with_clipping_factors_is_the_robust_mean(block: int) -> None:
    codec = Int8BlockCodec(block)
    n = 6001
    with policy("off"):
        encs = {s: codec.encode(rand(n, i) * 10 ** i) for i, s in enumerate("abc")}
        decoded = {s: codec.decode(e) for s, e in encs.items()}
    factors = {"b": torch.tensor(0.37, dtype=torch.float32), "c": torch.tensor(0.0123, dtype=torch.float32)}
    red = Reduction(decoded, ["a", "b", "c"], ["b", "c"], [], factors)
    with policy("off"):
        ref = codec.encode(red.mean(0, n))
    codes, scales = stacked([encs[s] for s in "abc"], n, block)
    f = torch.stack([torch.tensor(1.0), factors["b"], factors["c"]])
    out_codes, out_scales = mean_requantize(codes, scales, block, f)
    assert (bits_of(out_codes), bits_of(out_scales)) == (ref.payload, ref.scales)
    with policy("force"):
        fused = device.int8_mean_requantize(codes, scales, block, f)
    assert fused is not None and bits_of(fused[0]) == ref.payload


# -- per-channel codes, packing and AC-SGD -------------------------------------------------------------

# odd widths take the flat kernel; widths of whole packing words the 2-D tiles, some with several bands of rows
# in the column reduction (300 x 64: 5 bands) and a partial last tile (136 columns in tiles of 128)
SHAPES = [(1, 1), (7, 3), (5, 401), (0, 4), (3, 0), (2, 2049), (300, 64), (37, 24), (129, 136), (2, 1032)]


def reference(x: torch.Tensor, bits: int, m: torch.Tensor | None = None,
              scales: torch.Tensor | None = None) -> tuple[bytes, bytes, bytes]:
    d = x.float() if m is None else x.float() - m.float()
    codes, s = quantize_channels(d, bits, scales=scales)
    recon = dequantize_channels(codes, s)
    if m is not None:
        recon = m.float() + recon
    return bits_of(pack_bits(codes, bits)), bits_of(s), bits_of(recon)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_channel_codes_and_acsgd_update_bit_exact(bits: int) -> None:
    for k, shape in enumerate(SHAPES):
        n = shape[0] * shape[1]
        x = rand(n, k).view(shape) * 3
        m = rand(n, k + 100).view(shape)
        for mm in (None, m):
            packed, scales, out = quantize_pack(x, bits, m=mm)
            assert out is not None
            assert (bits_of(packed), bits_of(scales), bits_of(out)) == reference(x, bits, mm), (bits, shape)


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_channel_special_inputs(bits: int) -> None:
    base = rand(37 * 12, 9).view(37, 12)
    base[:, 3] = 0.0  # an all-zero channel: scale 0, codes 0
    base[:, 4] = -0.0
    base[0, 5], base[1, 5], base[2, 6] = 3e38, -3.3e38, 1e-40
    strided = rand(12 * 37, 10).view(12, 37).t()  # a transposed view: strides (1, 37)
    m = rand(37 * 12, 11).view(37, 12)
    half = rand(37 * 12, 12).view(37, 12).half()
    for x, mm in ((base, None), (strided, None), (strided, m.t().contiguous().t()), (half, None), (half, m)):
        packed, scales, out = quantize_pack(x, bits, m=mm)
        assert (bits_of(packed), bits_of(scales), bits_of(out)) == reference(x, bits, mm), bits
    given = torch.tensor([0.5, 0.0, 2.0, 1e-3] * 3)  # scales given (fp16-scales mode): clamp and zero scales
    packed, scales, out = quantize_pack(base, bits, scales=given)
    assert (bits_of(packed), bits_of(scales), bits_of(out)) == reference(base, bits, None, given)


def test_channel_non_finite_gets_infinite_scale() -> None:
    x = rand(40, 12).view(8, 5)
    x[3, 2] = float("nan")
    x[5, 4] = float("inf")
    scales = quantize_pack(x, 4)[1]
    assert [bool(torch.isfinite(s)) for s in scales] == [True, True, False, True, False]
    a = torch.full((2, 3), 3e38)
    m = torch.full((2, 3), -3e38)  # each finite, their difference is not
    assert not bool(torch.isfinite(quantize_pack(a, 4, m=m)[1]).any())


@pytest.mark.parametrize("mode", ["quant", "quant_fp16_scales"])
@pytest.mark.parametrize("rounding", ["deterministic", "stochastic"])
def test_act_codec_dispatch_matches_torch(mode: str, rounding: str) -> None:
    x = rand(6 * 5 * 33, 12).view(6, 5, 33)
    results = []
    for p in ("off", "force"):
        gen = torch.Generator().manual_seed(7)
        codec = ActCodec(mode, 3, rounding=rounding, generator=gen)  # type: ignore[arg-type]
        with policy(p):
            packet, recon = codec.encode_with_reconstruction(x)
            again = codec.encode(x)  # a second draw: the generator advanced the same way
        results.append((packet, bits_of(recon), again))
    assert results[0] == results[1]


def test_act_codec_refuses_non_finite_on_the_kernel_path() -> None:
    codec = ActCodec("quant", 4)
    x = rand(20, 13).view(4, 5)
    x[1, 1] = float("nan")
    with policy("force"), pytest.raises(CodecError, match="NaN or Inf"):
        codec.encode(x)
    with policy("force"), pytest.raises(CodecError, match="NaN or Inf"):
        codec.encode_delta(torch.full((2, 3), 3e38), torch.full((2, 3), -3e38))


@pytest.mark.parametrize("bits", [2, 4])
def test_acsgd_sender_on_the_kernel_path_sends_the_same_bytes(bits: int) -> None:
    acts = [rand(3 * 4 * 16, 20 + t).view(3, 4, 16) for t in range(3)]
    runs = []
    for p in ("off", "force"):
        sender = AcsgdSender(AcsgdConfig(bits=bits, first_visit="quant"))  # type: ignore[arg-type]
        with policy(p):
            msgs = [sender.encode([5, 9, 2], a).to_dict() for a in acts]  # a first visit, then two deltas
        runs.append((msgs, sender.buffer.digest()))
    assert runs[0] == runs[1]


def test_seeded_stochastic_rounding_is_unbiased_and_bounded() -> None:
    """Philox noise is not torch's, so this path is checked by its statistics, not bit for bit."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(64, 256, generator=g) * 4 - 2
    scales = torch.full((256,), 0.5)
    _, _, out = quantize_pack(x, 4, scales=scales, seed=1234)
    assert out is not None
    err = out - x
    assert bool((err.abs() < 0.5).all())  # floor(y + u) is one of the two neighbours
    assert abs(float(err.mean())) < 0.01  # unbiased: 16384 errors of sd ~0.14 average to ~0.001
    _, _, again = quantize_pack(x, 4, scales=scales, seed=1234)
    assert torch.equal(out, again)  # the seed makes it reproducible
    _, _, other = quantize_pack(x, 4, scales=scales, seed=99)
    assert not torch.equal(out, other)


# -- dispatch -------------------------------------------------------------------------------------------


def test_dispatch_policy_and_fallback(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    x = torch.ones(10)
    with policy("auto"):
        assert not device.uses_triton(x)  # CPU tensors keep the torch path
        assert device.int8_quantize(x, 4) is None
    with policy("off"):
        assert device.int8_quantize(x, 4) is None
    with policy("force"):
        assert device.uses_triton(x)
        assert device.int8_quantize(x, 4) is not None

    def broken(*_: object) -> None:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(device, "uses_triton", lambda t, name="": name not in device._disabled)
    monkeypatch.setattr(device, "_disabled", set())
    caplog.set_level(logging.WARNING, logger="potluck")
    with policy("auto"):
        assert device._call("probe", x, broken) is None
        assert device._call("probe", x, broken) is None  # disabled now: not tried, not logged again
    assert sum("probe" in r.getMessage() for r in caplog.records) == 1
    with policy("force"), pytest.raises(RuntimeError):
        device._call("probe2", x, broken)


def test_host_copy_is_a_plain_copy_on_cpu() -> None:
    x = torch.arange(10, dtype=torch.int8)[::2]
    host = device.to_host(x)
    assert host.device.type == "cpu" and host.is_contiguous() and torch.equal(host, x)
    assert np.array_equal(device.start_host_copy(x).wait().numpy(), x.numpy())
