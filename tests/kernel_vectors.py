"""Vectors the Triton kernels are checked on, and how their bits are compared: shared by the interpreter's tests
(``tests/test_triton_kernels.py``, ``tests/test_triton_int4.py``) and the int4 kernels' GPU check, which runs
compiled in a process of its own (``python tests/kernel_vectors.py``: one JSON line)."""

from __future__ import annotations

import numpy as np
import torch

from potluck.compression.int8 import Encoded


def bits_of(t: torch.Tensor) -> bytes:
    """Exact bytes of a tensor (so -0.0 != 0.0 and NaN payloads count)."""
    return t.detach().contiguous().cpu().numpy().tobytes()


def rand(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.logspace(-3, 2, n) if n else torch.zeros(0)


def int4_special_vectors() -> list[torch.Tensor]:
    x = rand(257, 1)
    big = x.clone()
    big[:5] = torch.tensor([3e38, -3.4e38, 1e-40, -1e-45, 2.5])  # near the float32 limits, subnormals
    ties = torch.arange(-14, 14, dtype=torch.float32) / 2  # exact halves: round half to even
    ties[0] = -14.0  # absmax 14, so the scale is 2 and y = x / 2 exactly
    return [torch.zeros(300), torch.full((129,), -0.0), big, ties, torch.full((128,), 7.0)]


def decodable(enc: Encoded) -> bool:
    """Within the codec's ``MAX_ABS`` (the vector near float32's limit encodes, but no receiver takes it)."""
    return float(np.frombuffer(enc.scales, np.float32).max(initial=0)) * 7 <= 1e6


def check_cuda() -> int:
    """On a GPU, the kernels as compiled (run without ``TRITON_INTERPRET``): a CUDA vector encodes to the CPU codec's
    bytes and decodes to its values. Returns the vectors checked; raises AssertionError on a difference."""
    import os

    from potluck.compression.int4 import Int4BlockCodec
    from potluck.kernels import device

    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "this check is of the compiled kernels"
    codec, checked = Int4BlockCodec(128), 0
    for x in [rand(n, n) for n in (1, 129, 1 << 20)] + int4_special_vectors():
        os.environ[device.ENV] = "off"
        ref = codec.encode(x)
        os.environ[device.ENV] = "auto"
        assert codec.encode(x.cuda()) == ref, f"a vector of {x.numel()} values encodes differently on the GPU"
        if decodable(ref):
            assert bits_of(codec.decode(ref, device="cuda")) == bits_of(codec.decode(ref)), \
                f"a vector of {x.numel()} values decodes differently on the GPU"
        checked += 1
    return checked


if __name__ == "__main__":  # (benchmarks/gpu_suite.sh runs this too: one JSON line, as its benchmarks print)
    import json
    import sys

    line: dict = {"benchmark": "int4_kernels_cuda", "measured": torch.cuda.is_available()}
    if not line["measured"]:
        line["reason"] = "no CUDA device on this machine"
    else:
        line["device"] = torch.cuda.get_device_name()
        try:
            line.update(vectors=check_cuda(), bit_exact=True)
        except AssertionError as err:
            line.update(bit_exact=False, error=str(err))
    print(json.dumps(line))
    sys.exit(0 if line.get("bit_exact", True) else 1)
