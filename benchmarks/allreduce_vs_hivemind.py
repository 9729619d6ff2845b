"""The outer all-reduce at real sizes against hivemind's: 3 peers on loopback, int8 vs uint8.

Ours: ``--peers`` member processes, each a real gRPC server with mutual TLS (certificates from one
run CA), signing its results and averaging robustly, exactly as a run does; every member averages a
vector of ``--numel`` float32 values drawn from its own seed. All members start a round together (a
barrier) and the figure is the slowest member's ``AllReduce.run`` time. Every round is checked: all
members end with bit-identical results, and member 0 compares them with the exact mean of the inputs
(relative L2 error, over the whole vector and each half).

hivemind: ``benchmarks/hivemind_allreduce.py`` (real DHT nodes and ``DecentralizedAverager`` with
``Uniform8BitQuantization``, group formed beforehand, only the all-reduce timed), run in its own venv
with numpy < 2.4 (with numpy 2.4 its decoder fails and it averages half the vector), which checks the
mean the same way. Our members set the C allocator as a peer does (what a round frees waits for the next
round: :func:`potluck.protos.runtime.heap.hold`; ``--allocator default`` leaves glibc's defaults, to measure what
that saves); the median page faults a member takes in a round and the members' peak resident set are printed.
Both sides pin ``--threads`` torch threads per process; rounds alternate between
the two in the same run (``--trials`` pairs). Target (issue 16): ours <= 0.5x hivemind's time; since verified reduction (issue 48): <= 0.45x, every check on.

    python benchmarks/allreduce_vs_hivemind.py [--numel 20000000] [--peers 3] [--rounds 3] [--trials 1] [--allocator hold|default]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchargs import bench_parser

HERE = Path(__file__).resolve().parent


def _inputs(seed: int, member: int, rnd: int, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rnd * 1009 + member)
    return torch.randn(numel, generator=gen).mul_(0.01)


def _member(idx: int, args: argparse.Namespace, ca_path: str, conn, barrier) -> None:  # type: ignore[no-untyped-def]
    from potluck.compression.int8 import make_codec
    from potluck.peer.reduce.allreduce import AllReduce, MemberAddr, RoundInfo
    from potluck.protos import potluck_pb2 as pb
    from potluck.protos.net.certs import CertificateAuthority, TlsIdentity
    from potluck.protos.net.identity import Identity
    from potluck.protos.net.transport import PeerClient, PeerServer, Traffic
    from potluck.protos.runtime.heap import Heap, hold

    if args.allocator == "hold":
        hold()  # as a peer does at start (potluck.cli's peer command): what a round frees waits for the next round
    torch.set_num_threads(args.threads)
    identity = Identity.generate()
    ca = CertificateAuthority.load_or_create(Path(ca_path), "bench")
    tls = TlsIdentity.generate()
    tls.adopt(ca.issue(identity.peer_id, tls.public_pem, 3600), ca.cert_pem, identity.peer_id)
    traffic = Traffic()
    client = PeerClient(traffic, tls=tls)
    step = [0]
    ar = AllReduce(run_id="bench", me=identity.peer_id, numel=args.numel, codec=make_codec("int8"), client=client,
                   chunk_bytes=1 << 20, rpc_timeout=600, sign=identity.sign,
                   ping=lambda pid, t: pb.PingReply(state="syncing", version=step[0] - 1))

    class Handlers:
        def push_contribution(self, chunks):  # type: ignore[no-untyped-def]
            return ar.inbox.on_contribution(chunks)

        def push_result(self, chunks):  # type: ignore[no-untyped-def]
            return ar.inbox.on_result(chunks)

    server = PeerServer(Handlers(), traffic, host="127.0.0.1", port=0, tls=tls)
    Heap(give_back=args.allocator != "hold").settle(time.monotonic())  # as a peer does once set up (potluck.peer.daemon.Session): collections off the step
    try:
        conn.send((identity.peer_id, f"127.0.0.1:{server.port}"))
        members = tuple(MemberAddr(p, a) for p, a in sorted(conn.recv()))
        for rnd in range(args.rounds + 1):
            step[0] = rnd + 1
            ar.expect(rnd + 1, "base")  # as a peer does when its previous step lands, before training
            delta = _inputs(args.seed, idx, rnd, args.numel)  # stands in for the inner phase
            barrier.wait()
            faults, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            mean, stats = ar.run(RoundInfo(rnd + 1, members, identity.peer_id, "base"), delta, wait_s=600)
            seconds = time.perf_counter() - t0
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            assert min(stats.contributors.values()) == args.peers, stats.contributors
            digest = hashlib.blake2b(mean.numpy().tobytes(), digest_size=16).hexdigest()
            errors: list[float] = []
            if idx == 0:  # off the clock: the exact mean of everyone's inputs
                exact = sum(_inputs(args.seed, k, rnd, args.numel) for k in range(args.peers)) / args.peers
                half = args.numel // 2
                errors = [float((mean[a:b] - exact[a:b]).norm() / exact[a:b].norm())
                          for a, b in ((0, args.numel), (0, half), (half, args.numel))]
            conn.send((seconds, digest, errors, stats.bytes_sent, faults, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
    finally:
        server.stop(0.1)
        ar.close()
        client.close()


def ours(args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(args.peers)
    with tempfile.TemporaryDirectory(prefix="potluck-ca-") as tmp:
        ca_path = str(Path(tmp) / "ca.key")
        from potluck.protos.net.certs import CertificateAuthority
        CertificateAuthority.load_or_create(Path(ca_path), "bench")
        pipes = [ctx.Pipe() for _ in range(args.peers)]
        procs = [ctx.Process(target=_member, args=(k, args, ca_path, pipes[k][1], barrier), daemon=True)
                 for k in range(args.peers)]
        for p in procs:
            p.start()
        try:
            addrs = [pipes[k][0].recv() for k in range(args.peers)]
            for k in range(args.peers):
                pipes[k][0].send(addrs)
            rounds, errors, sent, faults, peak = [], [], [], [], 0
            for _ in range(args.rounds + 1):
                replies = [pipes[k][0].recv() for k in range(args.peers)]
                if len({r[1] for r in replies}) != 1:
                    raise SystemExit("members ended a round with different results")
                rounds.append(max(r[0] for r in replies))
                errors.append(replies[0][2])
                sent.append(statistics.mean(r[3] for r in replies))
                faults.append(statistics.mean(r[4] for r in replies))
                peak = max([peak] + [r[5] for r in replies])
            for p in procs:
                p.join(timeout=60)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
    worst = max(max(e) for e in errors)
    if worst > 0.02:
        raise SystemExit(f"our all-reduce is off the exact mean by {worst:.3%} (relative L2)")
    return {"rounds": [round(s, 3) for s in rounds[1:]], "median_s": round(statistics.median(rounds[1:]), 3),
            "max_rel_err": round(worst, 5), "bytes_sent_per_member": round(statistics.mean(sent[1:])),
            "page_faults_per_member_round": round(statistics.median(faults[1:])), "member_peak_rss_mb": round(peak / 1024)}


def hivemind(args: argparse.Namespace) -> dict:
    setup = subprocess.run([sys.executable, str(HERE / "hivemind_allreduce.py"), "--setup"], check=True,
                           capture_output=True, text=True)
    python = setup.stdout.strip().splitlines()[-1]
    out = subprocess.run([python, str(HERE / "hivemind_allreduce.py"), "--numel", str(args.numel), "--peers",
                          str(args.peers), "--rounds", str(args.rounds), "--threads", str(args.threads),
                          "--seed", str(args.seed)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the hivemind baseline failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--numel", type=int, default=20_000_000)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per trial, after one warm-up round")
    parser.add_argument("--trials", type=int, default=1, help="ours, then hivemind, this many times")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--allocator", choices=["hold", "default"], default="hold",
                        help="our members' C allocator: as a peer sets it (potluck.protos.runtime.heap.hold), or glibc's "
                             "defaults (to measure what holding freed memory saves)")
    args = parser.parse_args()
    mine: list[dict] = []
    theirs: list[dict] = []
    for _ in range(args.trials):
        mine.append(ours(args))
        theirs.append(hivemind(args))
    ours_s = statistics.median(s for m in mine for s in m["rounds"])
    hm_s = statistics.median(s for h in theirs for s in h["rounds"])
    print(json.dumps({
        "benchmark": "allreduce_vs_hivemind", "numel": args.numel, "peers": args.peers, "threads": args.threads,
        "allocator": args.allocator,
        "potluck_median_s": round(ours_s, 3), "hivemind_median_s": round(hm_s, 3),
        "ratio": round(ours_s / hm_s, 3), "target_ratio": 0.45,
        "potluck": mine, "hivemind": theirs,
    }))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
