"""Compute utilization with overlapped outer steps against blocking ones, over an emulated WAN.

A real swarm (coordinator + peer processes, hivemind DHT, gRPC with mutual TLS) of ``--peers`` peers,
S = 1, H = ``--inner-steps``, the ~2.1M-parameter model of ``diloco_allreduce.py``, every link between
two peers emulated at ``--mbps`` and ``--delay-ms`` one way by the transport (:mod:`potluck.protos.testkit.netem`).
The same run is made twice, blocking (``diloco.overlap = false``) and overlapped (``true``), in the
order given by ``--order``. Compute utilization is the coordinator's ``compute_utilization``: the share
of the peers' wall time spent in inner steps, ``sum(compute_s) / sum(compute_s + sync_s)``, where
``sync_s`` is what the training loop spent in (or waiting for) outer steps.

Prints one JSON line: both utilizations, the outer steps' own seconds hidden behind training, the
final eval loss of both runs (equal tokens), and whether every step ended bit-identical on all peers.
Target (issue 16): >= 0.95 with overlap on; INTELLECT-1 reports 83-96 %.

    python benchmarks/overlap_utilization.py [--peers 4] [--inner-steps 50] [--outer-steps 5] [--mbps 100] [--delay-ms 50]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchargs import bench_parser, swarm_arguments

from potluck.local import LocalSwarm
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig


def run_swarm(args: argparse.Namespace, workdir: Path, overlap: bool) -> dict:
    workdir.mkdir(parents=True)
    topology = workdir / "wan.json"
    topology.write_text(json.dumps({"regions": ["wan"], "delay_ms": [[args.delay_ms]],
                                    "bandwidth_mbps": [[args.mbps]]}))
    cfg = apply_overrides(RunConfig(), {
        "run_id": "bench-overlap",
        "model.d_model": 240, "model.n_layers": 3, "model.n_heads": 4, "model.seq_len": 64,
        "train.batch_size": 16,
        "diloco.inner_steps": args.inner_steps, "diloco.outer_steps": args.outer_steps, "diloco.overlap": overlap,
        "membership.min_peers": args.peers, "coordinator.host": "127.0.0.1", "coordinator.checkpoint_every": 0,
        "coordinator.journal_dir": str(workdir / "journal"), "data.eval_every": args.outer_steps,
    })
    swarm = LocalSwarm(workdir)
    try:
        swarm.start_coordinator(cfg)
        t0 = time.monotonic()
        for _ in range(args.peers):
            swarm.start_peer("--netem", str(topology), "--region", "wan")

        def finished(s: dict) -> bool:
            if all(p.poll() is not None for p in swarm.peers) and not s["run"]["finished"]:
                raise SystemExit(f"every peer exited before the run finished; logs in {workdir / 'logs'}")
            return s["run"]["finished"] and bool(s["history"]) and len(s["history"][-1]["state_hashes"]) == args.peers \
                and s["history"][-1]["eval_loss"] is not None

        state = swarm.wait_state(finished, 1800, "the run to finish")
        wall = time.monotonic() - t0
    finally:
        swarm.stop()
    peers = state["peers"]
    hist = state["history"]
    return {
        "utilization": round(state["run"]["compute_utilization"], 4),
        "compute_s": round(sum(p["compute_s"] for p in peers), 1),
        "sync_s": round(sum(p["sync_s"] for p in peers), 2),
        "hidden_s": round(sum(p["hidden_s"] for p in peers), 2),
        "final_eval_loss": round(hist[-1]["eval_loss"], 4),
        "identical": all(len(set(h["state_hashes"].values())) == 1 for h in hist),
        "steps": [h["step"] for h in hist],
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = bench_parser(__doc__)
    swarm_arguments(parser, peers=4, outer_steps=5, model=False)
    parser.add_argument("--mbps", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--order", choices=["blocking-first", "overlap-first"], default="blocking-first")
    args = parser.parse_args()
    modes = [False, True] if args.order == "blocking-first" else [True, False]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="potluck-bench-") as tmp:
        for overlap in modes:
            name = "overlap" if overlap else "blocking"
            results[name] = run_swarm(args, Path(tmp) / name, overlap)
    o, b = results["overlap"], results["blocking"]
    print(json.dumps({
        "benchmark": "overlap_utilization",
        "peers": args.peers, "stages": 1, "inner_steps": args.inner_steps, "outer_steps": args.outer_steps,
        "link_mbps": args.mbps, "link_delay_ms_one_way": args.delay_ms,
        "utilization_overlap": o["utilization"], "utilization_blocking": b["utilization"],
        "target_utilization_overlap": 0.95,
        "eval_loss_ratio_overlap_vs_blocking": round(o["final_eval_loss"] / b["final_eval_loss"], 4),
        "overlap": o, "blocking": b,
    }))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
