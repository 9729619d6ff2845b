"""What a peer's inner phase holds on its GPU, by the allocator's count, for each memory option (issue 50).

Each option trains ``--steps`` inner steps of the whole model of ``--preset`` (one stage, the peer's own
:class:`~potluck.peer.training.stage.StageWorker` and optimizer, random tokens) in a process of its own, and reports:

* ``peak_mib``: ``torch.cuda.max_memory_allocated`` over the steps (weights, gradients, optimizer state,
  activations and the allocator's workspaces: what the card must hold);
* ``state_bytes_per_param``: weights + gradients (for ``train.step_in_backward``, the most one parameter held at
  once) + the optimizer's state, counted tensor by tensor after the steps;
* ``vs_yardstick``: those bytes over the issue's yardstick, the weights as bf16 + the optimizer's state (target
  <= 1.1x), and ``peak_vs_yardstick``, the allocator's peak over the same (activations included).

The outer state is never on the device (host memory, pinned: ``peer/reduce/allreduce.py``), so it is not here. Without
CUDA, ``--device cuda`` prints ``"measured": false``; ``--device cpu`` counts the tensors only (no allocator peak).

    python benchmarks/device_memory.py [--device cuda] [--preset llama-1b] [--seq 1024] [--batch 8] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

OPTIONS = {
    "fp32 + AdamW": {},
    "adamw8bit": {"train.optimizer": "adamw8bit"},
    "bf16 weights": {"train.weights": "bf16"},
    "bf16 weights + adamw8bit": {"train.weights": "bf16", "train.optimizer": "adamw8bit"},
    "bf16 weights, stepped in the backward": {"train.weights": "bf16", "train.step_in_backward": True,
                                              "train.grad_clip": 0.0},
    "bf16 weights + adamw8bit, stepped in the backward": {"train.weights": "bf16", "train.optimizer": "adamw8bit",
                                                          "train.step_in_backward": True, "train.grad_clip": 0.0},
}
TARGET = 1.1


def child(args: argparse.Namespace, settings: dict) -> dict:
    from potluck.models import stage_bounds
    from potluck.peer.training.inbackward import StepInBackward
    from potluck.peer.training.stage import StageWorker
    from potluck.protos.config.files import apply_overrides
    from potluck.protos.config.runconfig import RunConfig

    device = torch.device(args.device)
    rc = apply_overrides(RunConfig(), {"model.preset": args.preset, "model.vocab_size": args.vocab,
                                       "model.seq_len": args.seq, "train.batch_size": args.batch,
                                       "train.warmup_steps": 0, "train.checkpoint_activations": True, **settings,
                                       "data.source": "shards", "data.path": "(none: random tokens)"})
    torch.manual_seed(0)
    worker = StageWorker(rc, 0, stage_bounds(rc.model, rc.pipeline)[0], device, None, link=None)  # type: ignore[arg-type]
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    batch = (list(range(args.batch)), tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.steps):
        worker.train_step(batch)
    opt = worker.optimizer
    assert opt is not None
    if device.type == "cuda":
        torch.cuda.synchronize(device)

    def nbytes(ts) -> int:  # type: ignore[no-untyped-def]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    n = sum(p.numel() for p in worker.params)
    optimizer = nbytes(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    grads = opt.peak_grad_bytes if isinstance(opt, StepInBackward) else nbytes(p.grad for p in worker.params)
    state = nbytes(worker.params) + grads + optimizer
    yardstick = 2 * n + optimizer
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"params": n, "state_bytes_per_param": round(state / n, 2), "vs_yardstick": round(state / yardstick, 3),
            "peak_mib": round(peak / 2**20, 1) if peak is not None else None,
            "peak_vs_yardstick": round(peak / yardstick, 3) if peak is not None else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)  # (one option, in a process of its own)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args, OPTIONS[args.child])))
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"benchmark": "device_memory", "measured": False, "reason": "no CUDA device on this machine"}))
        return
    options = {}
    for name in OPTIONS:
        done = subprocess.run([sys.executable, __file__, "--child", name, "--device", args.device, "--preset",
                               args.preset, "--vocab", str(args.vocab), "--seq", str(args.seq), "--batch",
                               str(args.batch), "--steps", str(args.steps)], capture_output=True, text=True)
        if done.returncode != 0:
            options[name] = {"error": done.stderr.strip().splitlines()[-1][:300] if done.stderr.strip() else
                             f"exit {done.returncode}"}
            continue
        options[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps({"benchmark": "device_memory", "measured": args.device.startswith("cuda"),
                      "device": torch.cuda.get_device_name(torch.device(args.device))
                      if args.device.startswith("cuda") else "cpu", "preset": args.preset, "seq_len": args.seq,
                      "batch": args.batch, "checkpoint_activations": True, "target_vs_yardstick": TARGET,
                      "options": options}))


if __name__ == "__main__":
    main()
