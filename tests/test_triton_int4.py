"""The int4 Triton kernels return the torch codec's bits: in Triton's interpreter on CPU, and on a GPU when
there is one (skipped without: "no GPU").

As in ``tests/test_triton_kernels.py``, ``TRITON_INTERPRET=1`` is set before anything imports the kernels, and
``POTLUCK_TRITON`` picks the path: ``off`` for the torch reference, ``force`` for the kernels. Sizes are
small: the interpreter runs each program instance in numpy.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton; Linux x86_64 only)")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRITON_INTERPRET is set to something other than 1", allow_module_level=True)

from kernel_vectors import bits_of, decodable, int4_special_vectors, rand

from potluck.compression.aggregate import Reduction, reduce_mean
from potluck.compression.int4 import Int4BlockCodec
from potluck.compression.int8 import CodecError, Encoded
from potluck.kernels import device
from potluck.kernels.triton_int4 import dequantize_blocks, mean_requantize, quantize_blocks

# the interpreter computes in numpy, which warns where a refused NaN/Inf block is divided, multiplied or cast
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


@pytest.mark.parametrize("block", [16, 128, 4098])  # 4098: 2049 pairs, a block walked in two tiles
def test_int4_quantize_is_the_codec_bit_for_bit(block: int) -> None:
    codec = Int4BlockCodec(block)
    sizes = (0, 1, 7, 129, 1001) + ((8199,) if block > 4096 else ())
    for x in [rand(n, n) for n in sizes] + int4_special_vectors():
        with policy("off"):
            ref = codec.encode(x)
        packed, scales = quantize_blocks(x, block)
        assert bits_of(packed) == ref.payload, (x.numel(), block)
        assert bits_of(scales) == ref.scales, (x.numel(), block)
        if decodable(ref):
            with policy("off"):
                want = codec.decode(ref)
            assert bits_of(dequantize_blocks(packed, scales, block, x.numel())) == bits_of(want)
        with policy("force"):
            assert codec.encode(x) == ref  # the codec's own dispatch takes the kernel


def test_int4_strided_and_half_inputs() -> None:
    codec = Int4BlockCodec(64)
    m = rand(3 * 301, 3).view(301, 3)
    for x in (m.t()[1], rand(901, 4)[::3], rand(301, 5).half(), rand(300, 6).bfloat16()):
        with policy("off"):
            ref = codec.encode(x)
        packed, scales = quantize_blocks(x, 64)
        assert (bits_of(packed), bits_of(scales)) == (ref.payload, ref.scales)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_int4_refuses_non_finite(bad: float) -> None:
    codec = Int4BlockCodec(100)
    for where in (0, 250):  # a whole block, and the last partial one
        x = rand(251, 7)
        x[where] = bad
        _, scales = quantize_blocks(x, 100)
        assert not bool(torch.isfinite(scales[where // 100])), "a non-finite block must get a non-finite scale"
        for p in ("force", "off"):
            with policy(p), pytest.raises(CodecError, match="NaN or Inf"):
                codec.encode(x)


def stacked(encs: list[Encoded], n: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    nbytes, nblocks = (n + 1) // 2, -(-n // block)
    packed = np.stack([np.frombuffer(e.payload, np.uint8) for e in encs]) if encs else np.zeros((0, nbytes), np.uint8)
    scales = np.stack([np.frombuffer(e.scales, np.float32) for e in encs]) if encs \
        else np.zeros((0, nblocks), np.float32)
    return torch.from_numpy(packed.copy()), torch.from_numpy(scales.copy())


@pytest.mark.parametrize("n,k", [(1001, 3), (129, 1), (127, 4), (1, 2), (0, 3), (129, 0)])
def test_owner_mean_is_decode_sum_encode(n: int, k: int) -> None:
    codec = Int4BlockCodec(128)
    senders = [f"peer{i}" for i in (3, 1, 4, 0)[:k]]
    with policy("off"):
        encs = {s: codec.encode(rand(n, i) * (i + 1)) for i, s in enumerate(senders)}
        ref = codec.encode(reduce_mean({s: codec.decode(e) for s, e in encs.items()}, n))
    packed, scales = stacked([encs[s] for s in sorted(senders)], n, 128)  # aggregate's summation order
    out, out_scales = mean_requantize(packed, scales, 128, n)
    assert (bits_of(out), bits_of(out_scales)) == (ref.payload, ref.scales)


@pytest.mark.parametrize("block", [64, 4098])
def test_owner_mean_with_clipping_factors_is_the_robust_mean(block: int) -> None:
    codec = Int4BlockCodec(block)
    n = 4101
    with policy("off"):
        encs = {s: codec.encode(rand(n, i) * 10 ** i) for i, s in enumerate("abc")}
        decoded = {s: codec.decode(e) for s, e in encs.items()}
    factors = {"b": torch.tensor(0.37, dtype=torch.float32), "c": torch.tensor(0.0123, dtype=torch.float32)}
    red = Reduction(decoded, ["a", "b", "c"], ["b", "c"], [], factors)
    with policy("off"):
        ref = codec.encode(red.mean(0, n))
    packed, scales = stacked([encs[s] for s in "abc"], n, block)
    f = torch.stack([torch.tensor(1.0), factors["b"], factors["c"]])
    out, out_scales = mean_requantize(packed, scales, block, n, f)
    assert (bits_of(out), bits_of(out_scales)) == (ref.payload, ref.scales)
    with policy("force"):
        fused = device.int4_mean_requantize(packed, scales, block, n, f)
    assert fused is not None and bits_of(fused[0]) == ref.payload


def test_kernels_refuse_odd_blocks_and_wrong_sizes() -> None:
    with pytest.raises(ValueError, match="even"):
        quantize_blocks(torch.ones(10), 7)
    with pytest.raises(ValueError, match="bytes"):
        dequantize_blocks(torch.zeros(4, dtype=torch.uint8), torch.zeros(1), 16, 9)
    with pytest.raises(ValueError, match="scales"):
        dequantize_blocks(torch.zeros(5, dtype=torch.uint8), torch.zeros(2), 16, 9)


def test_dispatch_policy() -> None:
    x = torch.ones(10)
    with policy("auto"):
        assert device.int4_quantize(x, 4) is None  # CPU tensors keep the torch path
    with policy("off"):
        assert device.int4_quantize(x, 4) is None
    with policy("force"):
        got = device.int4_quantize(x, 4)
        assert got is not None and bits_of(got[0]) == bytes([0xEE] * 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_cuda_encode_and_decode_are_the_cpu_codec() -> None:
    """On a GPU, compiled: this module's kernels run in the interpreter (``TRITON_INTERPRET`` is set before they are
    decorated), so the check runs in a process of its own without it (:func:`kernel_vectors.check_cuda`)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("kernel_vectors.py"))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
