"""Activation memory of one training step with and without ``train.checkpoint_activations``.

Each configuration runs in a fresh Python process, through the peer's own forward
(:class:`potluck.peer.training.runner.StageRunner`, the built-in ``tiny`` family by default, long sequences
and many layers so that activations dominate the parameters):

1. one warm-up step on a single sample: AdamW's moments, the gradients and torch's kernels and
   thread pools are allocated, with almost no activations;
2. the baseline: the peak resident set (``ru_maxrss``) so far, or on a GPU the bytes allocated;
3. one step on the whole batch: its peak minus the baseline is the step's activation memory (plus
   the few transient buffers a step needs anyway, the same in both configurations);
4. ``--steps`` more steps, timed, for tokens/s.

On a GPU the peak is ``torch.cuda.max_memory_allocated`` (reset before the measured step), which
counts tensors only. On a CPU it is the process's peak RSS, measured twice: with glibc's malloc as a
peer runs it, and with ``MALLOC_MMAP_THRESHOLD_=65536``, which maps every tensor on its own and
unmaps it when freed, so that the RSS follows the bytes alive. The first is what the machine must
have; it overstates the checkpointed run, whose recomputed activations come and go inside a heap
that glibc keeps at its high-water mark once its dynamic threshold has risen. The second is the
activation memory itself, and ``memory_ratio`` is its ratio; tokens/s are from the first pair.

    python benchmarks/activation_memory.py [--d-model 256] [--n-layers 8] [--seq 512] [--batch 8] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = """
import json, resource, sys, time
import torch
from potluck.models import build_stage, lm_loss
from potluck.peer.training.runner import StageRunner
from potluck.protos.config.runconfig import ModelConfig, TrainConfig
a = json.loads(sys.argv[1])
torch.manual_seed(0)
device = torch.device(a["device"])
cfg = ModelConfig(vocab_size=a["vocab"], d_model=a["d_model"], n_layers=a["n_layers"], n_heads=a["n_heads"],
                  seq_len=a["seq"])
layers = build_stage(cfg, 0, device=device)
runner = StageRunner(layers, TrainConfig(batch_size=a["batch"], precision=a["precision"],
                                         checkpoint_activations=a["checkpoint"]), device)
opt = torch.optim.AdamW(layers.parameters(), lr=1e-4)
tokens = torch.randint(0, a["vocab"], (a["batch"], a["seq"] + 1), device=device)
x, y = tokens[:, :-1], tokens[:, 1:]

def step(n):
    opt.zero_grad(set_to_none=True)
    runner.precision.backward(lm_loss(runner(x[:n]), y[:n]))
    runner.precision.step(opt)

def peak():
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

def sync():
    if device.type == "cuda":
        torch.cuda.synchronize(device)

step(1)
sync()
if device.type == "cuda":
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) / 2**20
else:
    base = peak()
step(a["batch"])
sync()
top = peak()
t0 = time.perf_counter()
for _ in range(a["steps"]):
    step(a["batch"])
sync()
seconds = time.perf_counter() - t0
print(json.dumps({"baseline_mib": base, "peak_mib": top, "params": sum(p.numel() for p in layers.parameters()),
                  "tokens_per_s": a["steps"] * a["batch"] * a["seq"] / seconds}))
"""


def child(args: dict, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, timeout=3600,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise SystemExit(f"child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    ap.add_argument("--precision", default="fp32", choices=["auto", "fp32", "bf16", "fp16"])
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    args = {"d_model": a.d_model, "n_layers": a.n_layers, "n_heads": a.n_heads, "seq": a.seq, "batch": a.batch,
            "vocab": a.vocab, "steps": a.steps, "precision": a.precision, "device": a.device}
    plain = child({**args, "checkpoint": False})
    ckpt = child({**args, "checkpoint": True})
    live_plain, live_ckpt = plain, ckpt
    cpu = not a.device.startswith("cuda")
    if cpu:
        mmap = {"MALLOC_MMAP_THRESHOLD_": "65536"}
        live_plain, live_ckpt = child({**args, "checkpoint": False}, mmap), child({**args, "checkpoint": True}, mmap)

    def step_mib(r: dict) -> float:
        return r["peak_mib"] - r["baseline_mib"]

    print(json.dumps({
        "benchmark": "activation_memory", "device": a.device, "precision": a.precision, "family": "tiny",
        "d_model": a.d_model, "n_layers": a.n_layers, "seq": a.seq, "batch": a.batch, "params": plain["params"],
        "measure": "peak RSS growth of one step (ru_maxrss)" if cpu else "cuda max_memory_allocated growth",
        "plain_step_mib": round(step_mib(live_plain), 1),
        "checkpointed_step_mib": round(step_mib(live_ckpt), 1),
        "memory_ratio": round(step_mib(live_ckpt) / step_mib(live_plain), 3),
        "default_malloc_plain_step_mib": round(step_mib(plain), 1) if cpu else None,
        "default_malloc_checkpointed_step_mib": round(step_mib(ckpt), 1) if cpu else None,
        "default_malloc_memory_ratio": round(step_mib(ckpt) / step_mib(plain), 3) if cpu else None,
        "plain_tokens_per_s": round(plain["tokens_per_s"], 1),
        "checkpointed_tokens_per_s": round(ckpt["tokens_per_s"], 1),
        "speed_ratio": round(ckpt["tokens_per_s"] / plain["tokens_per_s"], 3),
    }))

if __name__ == "__main__":
    main()
