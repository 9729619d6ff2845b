"""Model FLOPs utilization of one peer's inner steps on a GPU (issue 17: >= 40 % on an H100).

The peer's own training step (:class:`potluck.peer.runner.StageRunner` with ``train.precision``,
``checkpoint_activations`` and ``compile`` as a run file sets them, fp32 master weights, AdamW,
gradient clipping) on the whole model as one stage, Llama-style ``--preset`` (default
``llama-150m``: d_model 768, 24 blocks; with the 32k vocabulary of ``--vocab`` 200M parameters,
151M of them outside the embedding: the issue's ~125M class), ``--seq`` tokens per sample, ``--batch`` samples per step,
random tokens. After ``--warmup`` steps, ``--steps`` steps are timed (CUDA synchronized).

Model FLOPs per token are counted the PaLM way: ``6 N`` for the ``N`` parameters of the matmuls
(embedding lookups excluded, the output head included) plus ``12 L d s`` for attention scores, the
backward pass included; activation recomputation is not counted (it is overhead, not model work).
MFU is achieved model FLOP/s over the device's dense bf16 peak (a table of known cards; unknown
cards print ``mfu: null``). The baseline in the same run is the same step in fp32 (TF32 off), the
precision of a peer before issue 17.

Without CUDA it prints one line with ``"measured": false``; ``--device cpu`` runs it anyway (small
sizes; no peak is known, so only tokens/s and FLOP/s).

    python benchmarks/mfu.py [--preset llama-150m] [--seq 1024] [--batch 8] [--compile] [--checkpoint]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

PEAK_BF16_TFLOPS = {"H100 SXM": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0,
                    "GH200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "4090": 165.0}


def peak_tflops(name: str) -> float | None:
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):  # the most specific name first
        if key in name:
            return PEAK_BF16_TFLOPS[key]
    return None


def run(args: argparse.Namespace, precision: str) -> dict:
    from potluck.models import build_stage, lm_loss
    from potluck.peer.runner import StageRunner
    from potluck.protos.config import ModelConfig, TrainConfig

    device = torch.device(args.device)
    cfg = ModelConfig(preset=args.preset, vocab_size=args.vocab, seq_len=args.seq)
    torch.manual_seed(0)
    layers = build_stage(cfg, 0, device=device)
    train = TrainConfig(batch_size=args.batch, precision=precision, checkpoint_activations=args.checkpoint,
                        compile=args.compile)
    runner = StageRunner(layers, train, device)
    params = list(layers.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        runner.precision.backward(lm_loss(runner(x), y))
        runner.precision.unscale(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        runner.precision.step(opt)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    seconds = (time.perf_counter() - t0) / args.steps
    embed = sum(p.numel() for n, p in layers.named_parameters() if "embed" in n or n.startswith("0."))
    n_matmul = sum(p.numel() for p in params) - embed
    d, n_layers = layers_dims(cfg)
    flops_per_token = 6 * n_matmul + 12 * n_layers * d * args.seq
    tok_s = args.batch * args.seq / seconds
    return {"precision": runner.precision.mode, "compiled": runner.compiled, "params": sum(p.numel() for p in params),
            "matmul_params": n_matmul, "s_per_step": round(seconds, 4), "tokens_per_s": round(tok_s, 1),
            "model_tflops": round(flops_per_token * tok_s / 1e12, 2)}


def layers_dims(cfg) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    return cfg.d_model, cfg.n_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="llama-150m")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--checkpoint", action="store_true", help="activation checkpointing")
    ap.add_argument("--no-baseline", action="store_true", help="skip the fp32 run")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"benchmark": "mfu", "measured": False, "reason": "no CUDA device on this machine"}))
        return
    name = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu"
    peak = peak_tflops(name) if args.device.startswith("cuda") else None
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 baseline is fp32
    ours = run(args, "auto")
    base = None if args.no_baseline else run(args, "fp32")
    print(json.dumps({
        "benchmark": "mfu", "measured": True, "device": name, "preset": args.preset, "vocab": args.vocab,
        "seq": args.seq, "batch": args.batch, "checkpoint_activations": args.checkpoint,
        "peak_bf16_tflops": peak, "mfu": round(ours["model_tflops"] / peak, 4) if peak else None,
        "target_mfu": 0.40, "ours": ours, "fp32_baseline": base,
        "speedup_vs_fp32": round(ours["tokens_per_s"] / base["tokens_per_s"], 2) if base else None,
    }))


if __name__ == "__main__":
    main()
