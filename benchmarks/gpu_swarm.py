"""A swarm of a real model on one machine's GPU: what an outer step costs beyond its all-reduce, and how much
of the wall time the training loop spends outside its inner steps (issue 28).

A real swarm (a coordinator and ``--peers`` peer processes: hivemind DHT, gRPC with mutual TLS) trains
``--preset`` (default ``llama-150m``, seq ``--seq``, a 4,096-token vocabulary: what the synthetic source holds, 108M parameters) on ``--device`` (every peer on the
one GPU), ``--batch`` samples an inner step, H = ``--inner-steps``, ``--outer-steps`` outer steps, each
peer at its defaults (bf16, compiled layers, the fewest micro-batches that fit), with
``diloco.overlap`` when ``--overlap`` is given.

From the coordinator's history, per committed step: the slowest member's outer step (``outer_s``),
the longest all-reduce (``allreduce_s``) and their difference (``rest_s``: copies, the update, the
snapshot: target <= 0.3 s at 150M parameters). From the peers: the share of their training loop's time
spent outside inner steps (``idle_fraction``: sync_s / (compute_s + sync_s), what the loop waited for
outer steps; target <= 5 % with ``--overlap``), and tokens/s from the first trained token to the end.
The first outer step also pays the compilation and is left out of the medians.

    python benchmarks/gpu_swarm.py [--peers 1|2] [--overlap] [--device cuda|cpu] [--preset llama-150m]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from potluck.local import LocalSwarm, SwarmError
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig


def main() -> None:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--peers", type=int, default=1)
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--preset", default="llama-150m")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=4096, help="the synthetic source holds at most 4096 tokens")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--inner-steps", type=int, default=50)
    ap.add_argument("--outer-steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"benchmark": "gpu_swarm", "measured": False, "reason": "no CUDA device on this machine"}))
        return
    if args.device == "cpu":  # a small stand-in that runs the same path on a CPU
        model = {"model.preset": "llama-20m", "model.seq_len": 64, "model.vocab_size": 256}
    else:
        model = {"model.preset": args.preset, "model.seq_len": args.seq, "model.vocab_size": args.vocab}
    with tempfile.TemporaryDirectory(prefix="potluck-bench-") as tmp:
        cfg = apply_overrides(RunConfig(), {
            "run_id": "bench-gpu-swarm", **model, "train.batch_size": args.batch if args.device != "cpu" else 4,
            "diloco.inner_steps": args.inner_steps, "diloco.outer_steps": args.outer_steps,
            "diloco.overlap": args.overlap, "data.eval_every": 0, "data.num_samples": 1 << 14,
            "membership.min_peers": args.peers, "coordinator.host": "127.0.0.1", "coordinator.checkpoint_every": 0,
            "coordinator.journal_dir": str(Path(tmp) / "journal"),
        })
        swarm = LocalSwarm(Path(tmp))
        started: float | None = None
        try:
            swarm.start_coordinator(cfg)
            for _ in range(args.peers):
                swarm.start_peer("--device", args.device)

            def done(state: dict) -> bool:
                nonlocal started
                if started is None and state["run"]["tokens_trained"] > 0:
                    started = time.monotonic()
                if not state["run"]["finished"] and not swarm.alive():
                    raise SwarmError(f"every peer exited before the run finished:\n{swarm.tail('peer-0')}")
                return bool(state["run"]["finished"]) and len(state["history"]) == args.outer_steps

            state = swarm.wait_state(done, args.timeout, "the run to finish")
            end = time.monotonic()
        finally:
            swarm.stop()
    hist = state["history"]
    steps = [{"step": h["step"], "members": h["members"], "outer_s": h["outer_s"], "allreduce_s": h.get("allreduce_s"),
              "rest_s": round(h["outer_s"] - h["allreduce_s"], 3)
              if h["outer_s"] is not None and h.get("allreduce_s") is not None else None} for h in hist]
    later = [s for s in steps[1:] if s["rest_s"] is not None] or [s for s in steps if s["rest_s"] is not None]
    wall = end - (started or end)
    loops = [(p["compute_s"], p["sync_s"]) for p in state["peers"] if p["compute_s"] + p["sync_s"] > 0]
    print(json.dumps({
        "benchmark": "gpu_swarm", "measured": True, "device": args.device, "peers": args.peers,
        "overlap": args.overlap, "model": model, "batch": cfg.train.batch_size, "inner_steps": args.inner_steps,
        "outer_steps": args.outer_steps,
        "rest_s_median": round(statistics.median(s["rest_s"] for s in later), 3) if later else None,
        "target_rest_s": 0.3,
        "allreduce_s_median": round(statistics.median(s["allreduce_s"] for s in later), 3) if later else None,
        "outer_s_median": round(statistics.median(s["outer_s"] for s in later), 3) if later else None,
        "idle_fraction": round(statistics.mean(s / (c + s) for c, s in loops), 4) if loops else None,
        "target_idle_fraction": 0.05 if args.overlap else None,
        "tokens_per_s": round(state["run"]["tokens_trained"] / wall, 1) if wall > 0 else None,
        "wall_s": round(wall, 1), "steps": steps,
    }))


if __name__ == "__main__":
    main()
