"""What a pipeline costs on one box: the same model as S = 2 stage processes against S = 1, one process.

Two real swarms (a coordinator and its peers: processes, hivemind DHT, gRPC with mutual TLS), one
after the other, train the same model with the same global batch:

* ``unsplit``: one peer holds the whole model (S = 1);
* ``pipeline``: two peers hold a stage each (S = 2, one replica), ``--micro-batches`` micro-batches an
  inner step (GPipe: with 8 the bubble is (S - 1) / (m + S - 1) = 1/9, 11 %), AC-SGD 4-bit
  activations and 8-bit gradients across the boundary (the defaults).

On a CPU both configurations get the box's cores: the unsplit peer ``--threads`` torch threads, each
stage peer ``--threads / 2`` (``--threads`` defaults to the box's cores). With ``--device cuda``
every peer trains on the one GPU (both stages share it), in the run's default precision (bf16).

Throughput is tokens that entered the model (stage 0) per second in the steady state: the median over
the outer steps after the first (which pays compilation and first visits) of each step's tokens over
the seconds since the step before (``history[].tokens_per_s``: inner and outer steps both count). The
stage-0 peer's live ``tokens_per_s`` (an average that still carries the first steps) and the whole
window from the first trained token are printed beside it. Start-up stays outside.

Target (issue #26): pipeline / unsplit >= 0.75 on CPU, >= 0.8 on one GPU.

    python benchmarks/pipeline_scale.py [--device cpu|cuda] [--preset llama-150m] [--micro-batches 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchargs import bench_parser

from potluck.local import LocalSwarm, SwarmError
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig

CPU_MODEL = {"model.d_model": 256, "model.n_layers": 4, "model.n_heads": 4, "model.seq_len": 128}


def model_settings(args: argparse.Namespace) -> dict[str, Any]:
    if args.preset:
        return {"model.preset": args.preset, "model.seq_len": args.seq_len or 1024, "model.vocab_size": 4096}
    return {**CPU_MODEL, **({"model.seq_len": args.seq_len} if args.seq_len else {})}


def run_swarm(args: argparse.Namespace, workdir: Path, stages: int) -> dict[str, Any]:
    workdir.mkdir(parents=True)
    cfg = apply_overrides(RunConfig(), {
        "run_id": f"bench-pipeline-scale-{stages}", **model_settings(args),
        "train.batch_size": args.batch, "pipeline.stages": stages, "pipeline.micro_batches": args.micro_batches,
        "diloco.inner_steps": args.inner_steps, "diloco.outer_steps": args.outer_steps,
        "data.num_samples": args.num_samples, "data.eval_every": 0, "links.placement": "sticky",
        "membership.min_peers": stages, "coordinator.host": "127.0.0.1", "coordinator.checkpoint_every": 0,
        "coordinator.journal_dir": str(workdir / "journal"),
    })
    threads = max(1, args.threads // stages) if args.device == "cpu" else args.threads
    swarm = LocalSwarm(workdir, threads=threads)
    first: tuple[float, int] | None = None
    live: list[float] = []

    def done(state: dict) -> bool:
        nonlocal first
        run = state["run"]
        if first is None and run["tokens_trained"] > 0:
            first = (time.monotonic(), run["tokens_trained"])
        stage0 = [p for p in state["peers"] if p["state"] == "training" and (p["tasklet"] or {}).get("stage", 0) == 0]
        if first is not None and stage0 and stage0[0]["tokens_per_s"] > 0:
            live.append(stage0[0]["tokens_per_s"])
        if not run["finished"] and not swarm.alive():
            raise SwarmError(f"every peer exited before the run finished:\n{swarm.tail('peer-0')}")
        return bool(run["finished"])

    try:
        swarm.start_coordinator(cfg)
        for _ in range(stages):
            swarm.start_peer("--device", args.device)
        state = swarm.wait_state(done, args.timeout, "the run to finish")
        end = time.monotonic()
    finally:
        swarm.stop()
    assert first is not None
    hist = state["history"]
    # the steady state: each outer step after the first (which pays compilation and the first visits), its tokens
    # over the seconds since the step before (inner steps and the outer step both count)
    rates = [h["tokens_per_s"] for h in hist[1:] if h.get("tokens_per_s")]
    messages = args.inner_steps * args.outer_steps * args.micro_batches
    sent = {k: sum(h["bytes"].get(k, 0) for h in hist) for k in ("activations", "gradients")}
    fp32 = {k: sum(h["bytes_fp32"].get(k, 0) for h in hist) for k in ("activations", "gradients")}
    return {
        "stages": stages, "threads_per_peer": threads,
        "tokens_per_s": round(statistics.median(rates), 1) if rates else None,
        "tokens_per_s_live_median": round(statistics.median(live), 1) if live else None,
        "tokens_per_s_window": round((state["run"]["tokens_trained"] - first[1]) / (end - first[0]), 1),
        "live_samples": len(live),
        "bytes_per_activation_message": round(sent["activations"] / messages) if stages > 1 else 0,
        "bytes_per_gradient_message": round(sent["gradients"] / messages) if stages > 1 else 0,
        "activations_vs_fp32": round(sent["activations"] / fp32["activations"], 4) if fp32["activations"] else None,
    }


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--preset", default=None, help="a Llama preset (e.g. llama-150m) instead of the CPU model")
    parser.add_argument("--seq-len", type=int, default=0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--outer-steps", type=int, default=2)
    parser.add_argument("--num-samples", type=int, default=1 << 14)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                        help="CPU: torch threads of the unsplit peer; each stage peer gets half")
    parser.add_argument("--order", choices=["unsplit-first", "pipeline-first"], default="unsplit-first")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    order = [1, 2] if args.order == "unsplit-first" else [2, 1]
    results: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="potluck-bench-") as tmp:
        for stages in order:
            results[stages] = run_swarm(args, Path(tmp) / f"s{stages}", stages)
    unsplit, piped = results[1], results[2]
    ratio = (round(piped["tokens_per_s"] / unsplit["tokens_per_s"], 3)
             if piped["tokens_per_s"] and unsplit["tokens_per_s"] else None)
    print(json.dumps({
        "benchmark": "pipeline_scale", "device": args.device, "model": model_settings(args),
        "batch": args.batch, "micro_batches": args.micro_batches, "bubble": round(1 / (args.micro_batches + 1), 3),
        "tokens_per_s_pipeline": piped["tokens_per_s"], "tokens_per_s_unsplit": unsplit["tokens_per_s"],
        "pipeline_vs_unsplit": ratio, "target": 0.8 if args.device == "cuda" else 0.75,
        "pipeline": piped, "unsplit": unsplit,
    }))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
