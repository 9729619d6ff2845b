"""Triton codec throughput on a GPU against the device's own copy bandwidth (and the torch reference).

On a CUDA device: a float32 vector of ``--numel`` values goes through each codec kernel of
:mod:`potluck.kernels.device` (int8 and int4 block quantize and dequantize, the owner's fused 3-member mean
and re-quantization at each, AC-SGD's fused 4-bit delta with per-channel scales), timed with CUDA events
(median of ``--reps`` after warm-up), next to a device-to-device copy of the same float32 vector
and the same codec in plain torch on the same device. Figures are GB/s of float32 input; the
target (issue 17) is each kernel >= 50 % of the copy's. The kernels' codes are checked equal to the
torch reference's before anything is timed.

Without a CUDA device it prints one line saying so ("measured": false): the CPU figures are
``codec_throughput.py``'s, and the kernels' bits are checked in Triton's interpreter by
``tests/test_triton_kernels.py``.

    python benchmarks/gpu_codec.py [--numel 67108864] [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable

import torch


def cuda_time(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``fn`` on the current stream, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 26)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--block", type=int, default=2048)
    ap.add_argument("--int4-block", type=int, default=128)
    ap.add_argument("--channels", type=int, default=1024, help="AC-SGD: activation width (rows = numel / channels)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"benchmark": "gpu_codec", "measured": False, "reason": "no CUDA device on this machine"}))
        return
    os.environ.setdefault("POTLUCK_TRITON", "force")  # errors surface instead of a silent torch fallback
    from potluck.compression.int8 import quantize_blocks
    from potluck.kernels import device as kd
    from potluck.kernels.quant import quantize_channels
    from potluck.kernels.triton_channels import channel_scales

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(args.numel, device=dev, generator=gen)
    gb = args.numel * 4 / 1e9
    copy_dst = torch.empty_like(x)
    copy_s = cuda_time(lambda: copy_dst.copy_(x), args.reps)
    n_full = args.numel - args.numel % args.block

    def torch_quantize() -> tuple[torch.Tensor, torch.Tensor]:  # the CPU path's operations, on this device
        codes = torch.empty(n_full, dtype=torch.int8, device=dev)
        scales = torch.empty(n_full // args.block, device=dev)
        quantize_blocks(x[:n_full].view(-1, args.block), codes.view(-1, args.block), scales)
        return codes, scales

    codes, scales = kd.int8_quantize(x, args.block)
    members = [kd.int8_quantize(torch.randn(args.numel, device=dev, generator=gen), args.block) for _ in range(3)]
    all_codes = torch.stack([c for c, _ in members])
    all_scales = torch.stack([s for _, s in members])
    p4, s4 = kd.int4_quantize(x, args.int4_block)
    members4 = [kd.int4_quantize(torch.randn(args.numel, device=dev, generator=gen), args.int4_block) for _ in range(3)]
    all_p4, all_s4 = torch.stack([p for p, _ in members4]), torch.stack([s for _, s in members4])
    rows = args.numel // args.channels
    act = x[: rows * args.channels].view(rows, args.channels)
    buf = (0.5 * torch.randn(act.shape, device=dev, generator=gen)).contiguous()

    # the spec is the CPU codec (torch on CUDA is not: its division by a scalar is a reciprocal multiply), so
    # the kernels' bits are compared with it, and any difference is a figure of the line, not a reason to stop
    spec = check_against_cpu(x, codes, scales, act, buf, args)
    spec.update(check_int4_against_cpu(x, p4, s4, args))
    kernels = {
        "int8_quantize": (lambda: kd.int8_quantize(x, args.block), torch_quantize),
        "int8_dequantize": (lambda: kd.int8_dequantize(codes, scales, args.block),
                            lambda: codes[:n_full].view(-1, args.block).float().mul(scales[: n_full // args.block, None])),
        "owner_mean_requantize_3": (lambda: kd.int8_mean_requantize(all_codes, all_scales, args.block), None),
        "int4_quantize": (lambda: kd.int4_quantize(x, args.int4_block), None),
        "int4_dequantize": (lambda: kd.int4_dequantize(p4, s4, args.int4_block, args.numel), None),
        "int4_owner_mean_requantize_3": (lambda: kd.int4_mean_requantize(all_p4, all_s4, args.int4_block, args.numel),
                                         None),
        "acsgd_delta_4bit": (lambda: kd.channels_quantize_pack(act, 4, m=buf),
                             lambda: quantize_channels(act - buf, 4)),
        "acsgd_scales_pass": (lambda: channel_scales(act, 4, buf), None),
    }
    out: dict[str, dict] = {}
    for name, (kernel, torch_ref) in kernels.items():
        k_s = cuda_time(kernel, args.reps)
        scale = 3 if "owner" in name else 1  # GB of float32 the members' contributions stand for
        row = {"triton_gb_s": round(scale * gb / k_s, 1), "vs_copy": round(scale * copy_s / k_s, 3),
               "ms": round(k_s * 1e3, 3)}
        if torch_ref is not None:
            t_s = cuda_time(torch_ref, args.reps)
            row["torch_gb_s"] = round(gb / t_s, 1)
            row["vs_torch"] = round(t_s / k_s, 2)
        out[name] = row
    timed = {k: v for k, v in out.items() if k != "acsgd_scales_pass"}
    print(json.dumps({
        "benchmark": "gpu_codec", "measured": True, "device": torch.cuda.get_device_name(dev), "numel": args.numel,
        "copy_gb_s": round(gb / copy_s, 1), "kernels": out, "cpu_spec": spec,
        "target": "every kernel >= 0.5x the device-to-device copy", "met": all(r["vs_copy"] >= 0.5 for r in timed.values()),
    }))


def check_against_cpu(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, act: torch.Tensor,
                      buf: torch.Tensor, args: argparse.Namespace) -> dict[str, object]:
    """The kernels' outputs against the CPU codec on the same inputs: equal, or how many elements differ."""
    from potluck.compression.int8 import quantize_blocks
    from potluck.kernels import device as kd
    from potluck.kernels.quant import dequantize_channels, pack_bits, quantize_channels

    n_full = args.numel - args.numel % args.block
    xc = x[:n_full].cpu()
    ref_codes = torch.empty(n_full, dtype=torch.int8)
    ref_scales = torch.empty(n_full // args.block)
    quantize_blocks(xc.view(-1, args.block), ref_codes.view(-1, args.block), ref_scales)
    got_codes, got_scales = codes[:n_full].cpu(), scales[: n_full // args.block].cpu()
    a, m = act.cpu(), buf.cpu()
    q, s = quantize_channels(a - m, 4)
    packed, kscales, new_m = kd.channels_quantize_pack(act, 4, m=buf)
    ref_m = m + dequantize_channels(q, s)
    return {
        "int8_codes_differing": int((got_codes != ref_codes).sum()),
        "int8_scales_differing": int((got_scales.view(torch.int32) != ref_scales.view(torch.int32)).sum()),
        "acsgd_packed_equal": bool(torch.equal(packed.cpu(), pack_bits(q, 4))),
        "acsgd_scales_equal": bool(torch.equal(kscales.cpu().view(torch.int32), s.view(torch.int32))),
        "acsgd_buffer_equal": bool(new_m is not None and torch.equal(new_m.cpu().view(torch.int32),
                                                                     ref_m.view(torch.int32))),
    }


def check_int4_against_cpu(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                           args: argparse.Namespace) -> dict[str, object]:
    """The int4 kernel's packed codes and scales against the CPU codec's encoding of the same vector."""
    import numpy as np

    from potluck.compression.int4 import Int4BlockCodec

    before = os.environ.get("POTLUCK_TRITON", "force")
    os.environ["POTLUCK_TRITON"] = "off"  # the torch path on the CPU: the spec
    try:
        ref = Int4BlockCodec(args.int4_block).encode(x.cpu())
    finally:
        os.environ["POTLUCK_TRITON"] = before
    got_p, got_s = packed.cpu().numpy(), scales.cpu().numpy()
    return {
        "int4_bytes_differing": int((got_p != np.frombuffer(ref.payload, np.uint8)).sum()),
        "int4_scales_differing": int((got_s.view(np.int32) != np.frombuffer(ref.scales, np.int32)).sum()),
    }


if __name__ == "__main__":
    main()
