"""Outer-step traffic and time: 2 real peers on loopback, a ~2M-parameter model, H=50.

Prints one JSON line with, all measured in this run:

* bytes each peer sent per outer step with the int8 codec (serialized gRPC messages: codes,
  scales, headers), next to the bytes of an fp32 all-reduce of the same vector through the same
  code path (raw codec, two in-process members, real gRPC);
* total communication against fully synchronous data parallel, which all-reduces fp32 gradients
  every inner step (H times per outer step);
* the share of wall time the peers spent in outer steps (network and waiting), from the peers'
  own accounting;
* what security costs: the same swarm run again with ``coordinator.insecure`` (plain gRPC), and,
  less noisy, the int8 all-reduce of the same vector between two in-process members over real gRPC,
  alternating rounds with mutual TLS + signed results + robust aggregation (what every run does)
  and without any of it (plain gRPC, no signing or verifying, a plain mean).

Targets (issue 2): traffic per outer step <= 0.3x fp32; outer-step time < 5% of wall time.
Target (issue 12): mTLS + signatures cost < 5% of the outer step time.

    python benchmarks/diloco_allreduce.py [--outer-steps 4] [--inner-steps 50] [--security-rounds 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from benchargs import bench_parser

from potluck.compression.int8 import Codec, make_codec
from potluck.local import LocalSwarm
from potluck.peer.reduce.allreduce import AllReduce, MemberAddr, RoundInfo
from potluck.protos import potluck_pb2 as pb
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.certs import CertificateAuthority, TlsIdentity
from potluck.protos.net.identity import Identity
from potluck.protos.net.transport import PeerClient, PeerServer, Traffic


def run_swarm(args: argparse.Namespace, workdir: Path, insecure: bool = False) -> dict:
    cfg = apply_overrides(RunConfig(), {
        "coordinator.insecure": insecure,
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


class Member:
    """A member of an in-process all-reduce, as a peer holds one: its own gRPC server (with mutual TLS when
    ``ca`` certifies it), client and :class:`~potluck.peer.reduce.allreduce.AllReduce`; ``step`` is the step it
    averages (asked about another member, it says it is syncing that one)."""

    def __init__(self, numel: int, codec: str | Codec = "raw", ca: CertificateAuthority | None = None,
                 rpc_timeout: float = 60.0) -> None:
        identity = Identity.generate()
        self.id = identity.peer_id
        self.traffic = Traffic()
        tls = None
        if ca is not None:  # certified by the run's CA, as the coordinator admits a peer
            tls = TlsIdentity.generate()
            tls.adopt(ca.issue(self.id, tls.public_pem, 3600), ca.cert_pem, self.id)
        self.client = PeerClient(self.traffic, tls=tls)
        self.step = 1
        self.ar = AllReduce(run_id="bench", me=self.id, numel=numel, client=self.client, chunk_bytes=1 << 20,
                            codec=make_codec(codec) if isinstance(codec, str) else codec, rpc_timeout=rpc_timeout,
                            sign=identity.sign, ping=lambda pid, t: pb.PingReply(state="syncing", version=self.step - 1))
        self.ar.expect(1, "base")
        self.server = PeerServer(self, self.traffic, host="127.0.0.1", port=0, tls=tls)
        self.address = f"127.0.0.1:{self.server.port}"

    def push_contribution(self, chunks):  # type: ignore[no-untyped-def]
        return self.ar.inbox.on_contribution(chunks)

    def push_result(self, chunks):  # type: ignore[no-untyped-def]
        return self.ar.inbox.on_result(chunks)

    def close(self) -> None:
        self.server.stop(0.1)
        self.ar.close()
        self.client.close()


def fp32_allreduce_bytes(numel: int) -> tuple[float, float]:
    """Bytes each of 2 members sends in an fp32 all-reduce of ``numel`` floats, and its seconds."""
    members = [Member(numel), Member(numel)]
    order = sorted(members, key=lambda m: m.id)
    out: dict[str, tuple] = {}

    def go(m: Member) -> None:
        info = RoundInfo(1, tuple(MemberAddr(x.id, x.address) for x in order), m.id, "base")
        out[m.id] = m.ar.run(info, torch.randn(numel), wait_s=60)

    threads = [threading.Thread(target=go, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for m in members:
        m.close()
    return statistics.mean(out[m.id][1].bytes_sent for m in members), max(out[m.id][1].seconds for m in members)


def _allreduce_round(members: list[Member], step: int, numel: int) -> float:
    """One all-reduce of a random vector among ``members``; the slowest member's seconds."""
    order = sorted(members, key=lambda m: m.id)
    seconds: dict[str, float] = {}

    def go(m: Member) -> None:
        info = RoundInfo(step, tuple(MemberAddr(x.id, x.address) for x in order), m.id, "base")
        stats = m.ar.run(info, torch.randn(numel), wait_s=60)[1]
        # the figure is worth something only if every shard averaged both members' contributions
        assert min(stats.contributors.values()) == len(members), stats.contributors
        seconds[m.id] = stats.seconds

    for m in members:
        m.step = step
        m.ar.expect(step, "base")
    threads = [threading.Thread(target=go, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seconds) == len(members), "a member's all-reduce failed"
    return max(seconds.values())


def security_cost(numel: int, rounds: int) -> tuple[float, float]:
    """Median seconds of an int8 all-reduce of ``numel`` floats between two members, with everything a
    run does for security, and with none of it (the verification is switched off for that member set
    only: signatures are neither made nor checked, the mean is plain). Rounds alternate, one warm-up each."""
    import potluck.peer.reduce.allreduce as allreduce_module

    ca = CertificateAuthority.load_or_create(Path(tempfile.mkdtemp(prefix="potluck-ca-")) / "ca.key", "bench")
    secure = [Member(numel, "int8", ca) for _ in range(2)]
    plain = [Member(numel, "int8") for _ in range(2)]
    for m in plain:
        m.ar.sign, m.ar.clip_factor, m.ar.reject_below = (lambda digest: b""), 0.0, None
    verify = allreduce_module.verify
    times: dict[str, list[float]] = {"secure": [], "plain": []}
    try:
        for step in range(1, rounds + 2):
            times["secure"].append(_allreduce_round(secure, step, numel))
            allreduce_module.verify = lambda *a: True  # type: ignore[assignment]
            try:
                times["plain"].append(_allreduce_round(plain, step, numel))
            finally:
                allreduce_module.verify = verify
    finally:
        for m in secure + plain:
            m.close()
    return statistics.median(times["secure"][1:]), statistics.median(times["plain"][1:])


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--outer-steps", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--security-rounds", type=int, default=8, help="all-reduce rounds each way (0: skip)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="potluck-bench-") as tmp:
        state = run_swarm(args, Path(tmp) / "secure")
        plain_state = run_swarm(args, Path(tmp) / "insecure", insecure=True) if args.security_rounds else None
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
    outer_s = statistics.median(h["outer_s"] for h in hist)
    step_wall_s = (compute + sync) / len(peers) / max(len(hist), 1)  # one outer step, inner steps included
    security: dict = {}
    if plain_state is not None:
        secure_s, plain_s = security_cost(params, args.security_rounds)
        security = {
            "allreduce_s_secure": round(secure_s, 4),
            "allreduce_s_plain": round(plain_s, 4),
            "security_cost_of_allreduce": round(secure_s / plain_s - 1, 4),
            "security_cost_of_outer_step": round((secure_s - plain_s) / step_wall_s, 4),
            "target_security_cost_of_outer_step": 0.05,
            "swarm_outer_step_s_median_insecure": round(statistics.median(h["outer_s"] for h in plain_state["history"]), 3),
        }
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
        "outer_step_s_median": round(outer_s, 3),
        "outer_step_wall_s": round(step_wall_s, 2),
        **security,
        "fp32_allreduce_s": round(fp32_s, 3),
        "wall_s": round(state["wall_s"], 1),
        "identical_parameters_every_step": all(len(set(h["state_hashes"].values())) == 1 for h in hist),
    }
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
