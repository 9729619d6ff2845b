"""Outer-step traffic and time: 2 real peers on loopback, a ~2M-parameter model, H=50.

Prints one JSON line with, all measured in this run:

* bytes each peer sent per outer step with the int8 codec (serialized gRPC messages: codes,
  scales, headers), next to the bytes of an fp32 all-reduce of the same vector through the same
  code path (raw codec, two in-process members, real gRPC);
* total communication against fully synchronous data parallel, which all-reduces fp32 gradients
  every inner step (H times per outer step);
* the share of wall time the peers spent in outer steps (network and waiting), from the peers'
  own accounting.

Targets (issue 2): traffic per outer step <= 0.3x fp32; outer-step time < 5% of wall time.

    python benchmarks/diloco_allreduce.py [--outer-steps 4] [--inner-steps 50]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from potluck.compression.int8 import make_codec
from potluck.local import LocalSwarm
from potluck.peer.allreduce import AllReduce, MemberAddr, RoundInfo
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config import RunConfig, apply_overrides
from potluck.protos.identity import Identity
from potluck.protos.transport import PeerClient, PeerServer, Traffic


def run_swarm(args: argparse.Namespace, workdir: Path) -> dict:
    cfg = apply_overrides(RunConfig(), {
        "run_id": "bench",
        "model.d_model": 240, "model.n_layers": 3, "model.n_heads": 4, "model.seq_len": 64,
        "train.batch_size": 16,
        "diloco.inner_steps": args.inner_steps, "diloco.outer_steps": args.outer_steps,
        "membership.min_peers": 2, "coordinator.host": "127.0.0.1", "coordinator.checkpoint_every": 0,
        "coordinator.journal_dir": str(workdir / "journal"), "data.eval_every": 0,
    })
    swarm = LocalSwarm(workdir)
    try:
        swarm.start_coordinator(cfg)
        t0 = time.monotonic()
        for _ in range(2):
            swarm.start_peer()
        finished_at: float | None = None

        def done(state: dict) -> bool:
            nonlocal finished_at
            hist = state["history"]
            if state["run"]["finished"] and finished_at is None:
                finished_at = time.monotonic()
            # a peer's final record may never arrive: 30 s after the end, report what the coordinator saw
            return state["run"]["finished"] and ((hist and len(hist[-1]["state_hashes"]) == 2)
                                                 or time.monotonic() - finished_at > 30)

        state = swarm.wait_state(done, 1800, "the run to finish")
        state["wall_s"] = time.monotonic() - t0
        return state
    finally:
        swarm.stop()


class _Member:
    def __init__(self, numel: int) -> None:
        identity = Identity.generate()
        self.id = identity.peer_id
        self.traffic = Traffic()
        self.client = PeerClient(self.traffic)
        self.ar = AllReduce(run_id="fp32", me=self.id, numel=numel, codec=make_codec("raw"), client=self.client,
                            chunk_bytes=1 << 20, rpc_timeout=60, ping=lambda pid, t: pb.PingReply(state="syncing"),
                            sign=identity.sign)
        self.ar.expect(1, "base")
        self.server = PeerServer(self, self.traffic, host="127.0.0.1", port=0)
        self.address = f"127.0.0.1:{self.server.port}"

    def push_contribution(self, chunks):  # type: ignore[no-untyped-def]
        return self.ar.on_contribution(chunks)

    def push_result(self, chunks):  # type: ignore[no-untyped-def]
        return self.ar.on_result(chunks)


def fp32_allreduce_bytes(numel: int) -> tuple[float, float]:
    """Bytes each of 2 members sends in an fp32 all-reduce of ``numel`` floats, and its seconds."""
    members = [_Member(numel), _Member(numel)]
    order = sorted(members, key=lambda m: m.id)
    out: dict[str, tuple] = {}

    def go(m: _Member) -> None:
        info = RoundInfo(1, tuple(MemberAddr(x.id, x.address) for x in order), m.id, "base")
        out[m.id] = m.ar.run(info, torch.randn(numel), wait_s=60)

    threads = [threading.Thread(target=go, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for m in members:
        m.server.stop(0.1)
        m.ar.close()
    return statistics.mean(out[m.id][1].bytes_sent for m in members), max(out[m.id][1].seconds for m in members)


def main() -> None:
    # a SIGTERM (e.g. from `timeout`) unwinds through ProcessGroup's cleanup instead of orphaning the swarm
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outer-steps", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="potluck-bench-") as tmp:
        state = run_swarm(args, Path(tmp))
    hist = state["history"]
    params = state["run"]["model"]["parameters"]
    per_peer = [h["bytes"]["outer"] / len(h["state_hashes"]) for h in hist if h["state_hashes"]]
    fp32_bytes, fp32_s = fp32_allreduce_bytes(params)
    peers = state["peers"]  # the run's only peers: the two this benchmark started
    if not all("compute_s" in p for p in peers):
        raise SystemExit("the coordinator's status has no compute_s/sync_s per peer")
    compute = sum(p["compute_s"] for p in peers)
    sync = sum(p["sync_s"] for p in peers)
    int8_bytes = statistics.mean(per_peer)
    result = {
        "benchmark": "diloco_outer_allreduce",
        "peers": 2,
        "parameters": params,
        "inner_steps": args.inner_steps,
        "outer_steps": args.outer_steps,
        "bytes_per_peer_per_outer_step": round(int8_bytes),
        "fp32_allreduce_bytes_per_peer": round(fp32_bytes),
        "traffic_ratio_vs_fp32": round(int8_bytes / fp32_bytes, 4),
        "target_traffic_ratio": 0.3,
        "sync_dp_bytes_per_peer_per_outer_step": round(args.inner_steps * fp32_bytes),
        "total_comm_ratio_vs_sync_dp": round(int8_bytes / (args.inner_steps * fp32_bytes), 5),
        "outer_time_fraction": round(sync / (compute + sync), 4) if compute + sync else None,
        "peer_states": sorted(p["state"] for p in peers),
        "target_outer_time_fraction": 0.05,
        "outer_step_s_median": round(statistics.median(h["outer_s"] for h in hist), 3),
        "fp32_allreduce_s": round(fp32_s, 3),
        "wall_s": round(state["wall_s"], 1),
        "identical_parameters_every_step": all(len(set(h["state_hashes"].values())) == 1 for h in hist),
    }
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
