"""The outer all-reduce at R = 8, 32 and 64 members, with and without grouped averaging.

In one process: ``R`` members (``diloco_allreduce.Member``), each a real gRPC server on 127.0.0.1 with
mutual TLS (certificates of one run CA: each member is its own client to the others, as on separate
hosts) with its own client and :class:`~potluck.peer.reduce.allreduce.AllReduce`, exactly as peers hold them; each round every
member starts at one barrier and averages its own random vector of ``--numel`` float32 values (int8
blocks of ``--block``). The figure of a round is the time from the barrier to the slowest member's
result; each configuration runs one warm-up round and ``--rounds`` timed ones (median), and every
round checks that members of one group end bit-identical. Three configurations per ``R``, one JSON
line each (its wall time and bytes beside the full all-reduce's of the same ``R``, measured just before):

* ``full``: one all-reduce of all ``R`` members (``sync.group_size = 0``): ``2 R (R - 1)`` streams;
* ``grouped``: the same vector, each member averaging with its group of at most ``--group-size``
  (the coordinator's rows and diagonals, alternating over the rounds): ``2 R (G - 1)`` streams;
* ``grouped_state``: the vector a grouped outer step really averages, theta and momentum as
  differences from the group's base (twice ``--numel``), in the same groups.

Bytes per member are what each member's client sent (``Traffic``'s "outer" kind: all-reduce payloads
and headers), averaged over the members. All members share this box's cores, so the wall time is
mostly Python and gRPC per-stream work, the cost that grows with the number of streams. Deadlines
are 600 s: on 2 cores a full all-reduce of 64 members takes minutes, and with a peer's usual grace an
owner's result push to its backup timed out and the all-reduce went wrong (see the issue's report).

With ``--procs N`` the members are spread over N worker processes (``allreduce_procs.py``): at R = 64
one process cannot hold the full all-reduce's ~4,000 streams a round.

    python benchmarks/allreduce_groups.py [--sizes 8,32,64] [--group-size 4] [--numel 65536] [--rounds 3] [--procs 1]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from allreduce_procs import measure_spread
from benchargs import bench_parser
from diloco_allreduce import Member  # (benchmarks/ is on the path of a script run from it)

from potluck.compression.int8 import Int8BlockCodec
from potluck.coordinator.rounds.groups import partition
from potluck.peer.reduce.allreduce import MemberAddr, RoundInfo
from potluck.protos.net.certs import CertificateAuthority

RUN = "bench"  # (diloco_allreduce.Member's run)


def measure(members: int, group_size: int, numel: int, block: int, rounds: int, ca: CertificateAuthority) -> dict:
    """Median wall time and mean bytes per member of ``rounds`` all-reduces (after a warm-up)."""
    ms = [Member(numel, Int8BlockCodec(block), ca, rpc_timeout=600.0) for _ in range(members)]
    walls, sent, sizes = [], [], []
    try:
        for rnd in range(rounds + 1):
            step = rnd + 1
            groups = partition(members, group_size, step)
            sizes.append(max(groups.count(g) for g in set(groups)))
            infos = [RoundInfo(step, tuple(MemberAddr(m.id, m.address) for m, g in zip(ms, groups, strict=True)
                                              if g == groups[i]), ms[i].id, "base") for i in range(members)]
            for m in ms:
                m.step = step
                m.ar.expect(step, "base")
            gen = torch.Generator().manual_seed(rnd)
            deltas = [torch.randn(numel, generator=gen).mul_(0.01) for _ in ms]
            barrier = threading.Barrier(members + 1)
            out: list[tuple[torch.Tensor, int, float] | BaseException | None] = [None] * members

            def go(i: int, info: RoundInfo, delta: torch.Tensor, out: list = out, barrier: threading.Barrier = barrier,
                   ) -> None:
                barrier.wait()
                try:
                    mean, stats = ms[i].ar.run(info, delta, wait_s=600.0, grace_s=600.0)
                    out[i] = (mean, stats.bytes_sent, time.perf_counter())
                except BaseException as err:  # reported below
                    out[i] = err

            threads = [threading.Thread(target=go, args=(i, infos[i], deltas[i])) for i in range(members)]
            for t in threads:
                t.start()
            barrier.wait()
            t0 = time.perf_counter()
            for t in threads:
                t.join()
            bad = [o for o in out if not isinstance(o, tuple)]
            if bad:
                raise SystemExit(f"an all-reduce of {members} members failed: {bad[0]!r}")
            done = [o for o in out if isinstance(o, tuple)]
            for g in set(groups):
                firsts = [done[i][0] for i in range(members) if groups[i] == g]
                if not all(torch.equal(firsts[0], x) for x in firsts[1:]):
                    raise SystemExit(f"members of group {g} ended with different results")
            if rnd:
                walls.append(max(o[2] for o in done) - t0)
                sent.append(statistics.fmean(o[1] for o in done))
    finally:
        for m in ms:
            m.close()
    g = max(sizes)
    return {"wall_s_median": round(statistics.median(walls), 3), "wall_s": [round(w, 3) for w in walls],
            "bytes_per_member": round(statistics.fmean(sent)), "numel": numel, "largest_group": g,
            "streams_per_step": 2 * members * (g - 1) if group_size else 2 * members * (members - 1)}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--sizes", default="8,32,64", help="members R, comma-separated")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--numel", type=int, default=1 << 16, help="float32 values each member averages")
    parser.add_argument("--block", type=int, default=256, help="int8 block size (sync.block_size)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per configuration, after a warm-up")
    parser.add_argument("--procs", type=int, default=1, help="worker processes the members are spread over")
    parser.add_argument("--configs", default="full,grouped,grouped_state", help="which, comma-separated (full "
                        "first: the others' ratios are to it)")
    args = parser.parse_args()
    if not set(args.configs.split(",")) <= {"full", "grouped", "grouped_state"}:
        parser.error(f"--configs: one or more of full, grouped, grouped_state, not {args.configs!r}")
    if args.group_size < 2:
        parser.error("--group-size must be at least 2")
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(args.numel < r * args.block for r in sizes):
        parser.error(f"--numel must hold at least one block of {args.block} per member (R x block)")
    if args.procs < 1 or any(r < args.procs for r in sizes):
        parser.error("--procs must be at least 1 and at most the smallest size")
    with tempfile.TemporaryDirectory(prefix="potluck-ca-") as tmp:
        ca_key = Path(tmp) / "ca.key"
        ca = CertificateAuthority.load_or_create(ca_key, RUN)
        configs = {"full": (0, args.numel), "grouped": (args.group_size, args.numel),
                   "grouped_state": (args.group_size, 2 * args.numel)}
        for r in sizes:
            full: dict | None = None
            for name in args.configs.split(","):
                group_size, numel = configs[name]
                t0 = time.perf_counter()
                row = (measure(r, group_size, numel, args.block, args.rounds, ca) if args.procs == 1 else
                       measure_spread(r, group_size, numel, args.block, args.rounds, ca_key, args.procs))
                full = full or (row if name == "full" else None)
                print(json.dumps({"benchmark": "allreduce_groups", "members": r, "config": name, "group_size": group_size,
                                  **row, "block": args.block, "rounds": args.rounds,
                                  "wall_vs_full": round(row["wall_s_median"] / full["wall_s_median"], 3) if full else None,
                                  "bytes_vs_full": round(row["bytes_per_member"] / full["bytes_per_member"], 3) if full
                                  else None,
                                  "transport": "gRPC on 127.0.0.1, mutual TLS, " + (
                                      "one process" if args.procs == 1 else f"{args.procs} processes"),
                                  "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
