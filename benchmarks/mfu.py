"""Model FLOPs utilization of a peer's own inner step on a GPU, at the peer's defaults (issue 28: >= 45 %).

The step is the peer's (:meth:`potluck.peer.training.stage.StageWorker.train_step`: ``train.precision``,
``compile`` and ``grad_accum`` as the run file leaves them, i.e. 'auto': bf16 autocast, each layer
compiled, the fewest micro-batches that fit; fp32 master weights, fused AdamW, gradient clipping)
on the whole model as one stage: Llama-style ``--preset`` (default ``llama-150m``: d_model 768, 24
blocks; with the 32k vocabulary of ``--vocab``, 151M matmul parameters), ``--seq`` tokens a sample,
``--batch`` samples an inner step (the run's global batch for this peer), random tokens. After
``--warmup`` steps (compilation happens there), ``--steps`` steps are timed (CUDA synchronized).

Model FLOPs per token are counted the PaLM way: ``6 N`` for the ``N`` parameters of the matmuls
(embedding lookups excluded, the output head included) plus ``12 L d s`` for attention scores, the
backward pass included; activation recomputation is not counted (it is overhead, not model work).
MFU is achieved model FLOP/s over the device's dense bf16 peak (a table of known cards; unknown
cards print ``mfu: null``). ``--variants`` adds other settings measured in the same run (``--set``
style, ``;`` between settings of one variant, ``,`` between variants), and the baseline is the same
step in fp32 eager (TF32 off), the precision of a peer before issue 17.

Without CUDA it prints one line with ``"measured": false``; ``--device cpu`` runs it anyway (small
sizes; no peak is known, so only tokens/s and FLOP/s).

    python benchmarks/mfu.py [--preset llama-150m] [--seq 1024] [--batch 32] [--variants "train.compile=false"]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import torch

PEAK_BF16_TFLOPS = {"H100 SXM": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0,
                    "GH200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "4090": 165.0}
DEFAULT_VARIANTS = "train.compile=false,potluck.compile_scope=stage"


def peak_tflops(name: str) -> float | None:
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):  # the most specific name first
        if key in name:
            return PEAK_BF16_TFLOPS[key]
    return None


def run(args: argparse.Namespace, settings: dict[str, Any]) -> dict:
    from potluck.models import stage_bounds
    from potluck.peer.training.stage import StageWorker
    from potluck.protos.config.files import apply_overrides
    from potluck.protos.config.runconfig import RunConfig

    device = torch.device(args.device)
    scope = settings.pop("potluck.compile_scope", "layer")
    rc = apply_overrides(RunConfig(), {"model.preset": args.preset, "model.vocab_size": args.vocab,
                                       "model.seq_len": args.seq, "train.batch_size": args.batch,
                                       "train.warmup_steps": 0, **settings,
                                       # random tokens are fed below: the run's data is never read (and a synthetic
                                       # source's table cannot hold a 32k vocabulary)
                                       "data.source": "shards", "data.path": "(none: random tokens)"})
    torch.manual_seed(0)
    worker = StageWorker(rc, 0, stage_bounds(rc.model, rc.pipeline)[0], device, None, link=None)  # type: ignore[arg-type]
    worker.runner.compile_scope = scope
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    batch = (list(range(args.batch)), tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        worker.train_step(batch)
    sync()
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        worker.train_step(batch)
    sync()
    seconds = (time.perf_counter() - t0) / args.steps
    layers, params = worker.layers, worker.params
    embed = sum(p.numel() for n, p in layers.named_parameters() if "embed" in n or n.startswith("0."))
    n_matmul = sum(p.numel() for p in params) - embed
    flops_per_token = 6 * n_matmul + 12 * rc.model.n_layers * rc.model.d_model * args.seq
    tok_s = args.batch * args.seq / seconds
    out = {"settings": {**settings, **({"potluck.compile_scope": scope} if scope != "layer" else {})},
           "precision": worker.runner.precision.mode, "compiled": worker.runner.compiled,
           "grad_accum": worker.accum, "params": sum(p.numel() for p in params), "matmul_params": n_matmul,
           "s_per_step": round(seconds, 4), "warmup_s": round(warmup_s, 1), "tokens_per_s": round(tok_s, 1),
           "model_tflops": round(flops_per_token * tok_s / 1e12, 2)}
    if device.type == "cuda":
        out["max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    del worker
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return out


def parse_variants(text: str) -> list[dict[str, Any]]:
    out = []
    for variant in filter(None, (v.strip() for v in text.split(","))):
        out.append(dict(kv.split("=", 1) for kv in variant.split(";")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="llama-150m")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32, help="samples an inner step: the run's batch for this peer")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="other settings to measure ('' for none)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the fp32 run")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"benchmark": "mfu", "measured": False, "reason": "no CUDA device on this machine"}))
        return
    cuda = args.device.startswith("cuda")
    name = torch.cuda.get_device_name(torch.device(args.device)) if cuda else "cpu"
    peak = peak_tflops(name) if cuda else None
    defaults = run(args, {})
    variants = [run(args, v) for v in parse_variants(args.variants)]
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 baseline is fp32
    base = None if args.no_baseline else run(args, {"train.precision": "fp32", "train.compile": "false"})

    def mfu(r: dict) -> float | None:
        return round(r["model_tflops"] / peak, 4) if peak else None

    for r in (defaults, *variants):
        r["mfu"] = mfu(r)
    best = max((defaults, *variants), key=lambda r: r["tokens_per_s"])
    print(json.dumps({
        "benchmark": "mfu", "measured": True, "device": name, "preset": args.preset, "vocab": args.vocab,
        "seq": args.seq, "batch": args.batch, "peak_bf16_tflops": peak,
        "mfu": defaults["mfu"], "target_mfu": 0.45, "best_mfu": best["mfu"], "best_settings": best["settings"],
        "defaults": defaults, "variants": variants, "fp32_baseline": base,
        "speedup_vs_fp32": round(defaults["tokens_per_s"] / base["tokens_per_s"], 2) if base else None,
    }))


if __name__ == "__main__":
    main()
