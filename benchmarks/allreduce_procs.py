"""``allreduce_groups.py --procs N``: the same all-reduce rounds with the members spread over N processes.

At R = 64 one process holds 64 gRPC servers and ~4,000 streams a round (with their threads) behind one
interpreter lock: the full all-reduce did not finish in it. Here each worker process (``spawn``ed) holds
``R / N`` members -- each still its own gRPC server with mutual TLS, client and
:class:`~potluck.peer.reduce.allreduce.AllReduce` -- so streams between members of different workers cross
process boundaries as they cross hosts. The parent decides each round's groups and hands every worker
its members' :class:`~potluck.peer.reduce.shards.RoundInfo`; all workers start at one barrier, and the round's
figure is the time from the barrier to the slowest member's result (``perf_counter`` is the system's
monotonic clock, one for every process). Members of one group must end bit-identical: each worker sends
back a digest of every member's result.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import statistics
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

RUN = "bench"


def measure_spread(members: int, group_size: int, numel: int, block: int, rounds: int, ca_key: Path,
                   procs: int) -> dict:
    """Median wall time and mean bytes per member of ``rounds`` all-reduces (after a warm-up), members in
    ``procs`` worker processes."""
    from potluck.coordinator.rounds.groups import partition
    from potluck.peer.reduce.shards import MemberAddr, RoundInfo

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(procs + 1)
    counts = [members // procs + (w < members % procs) for w in range(procs)]
    pipes, workers = [], []
    for count in counts:
        parent, child = ctx.Pipe()
        w = ctx.Process(target=_worker, args=(child, count, numel, block, str(ca_key), barrier), daemon=True)
        w.start()
        pipes.append(parent)
        workers.append(w)
    try:
        addrs = [MemberAddr(*a) for conn in pipes for a in _answer(conn, 600)]
        owner = [w for w, count in enumerate(counts) for _ in range(count)]  # global member index -> its worker
        walls, sent, sizes = [], [], []
        for rnd in range(rounds + 1):
            step = rnd + 1
            groups = partition(members, group_size, step)
            sizes.append(max(groups.count(g) for g in set(groups)))
            infos = [RoundInfo(step, tuple(a for a, g in zip(addrs, groups, strict=True) if g == groups[i]),
                               addrs[i].peer_id, "base") for i in range(members)]
            for w, conn in enumerate(pipes):
                conn.send(("round", step, rnd, [(i, infos[i]) for i in range(members) if owner[i] == w]))
            barrier.wait(timeout=600)
            t0 = time.perf_counter()
            done: dict[int, tuple[str, int, float]] = {}
            for conn in pipes:
                done.update(_answer(conn, 1800))
            for g in set(groups):
                digests = {done[i][0] for i in range(members) if groups[i] == g}
                if len(digests) != 1:
                    raise SystemExit(f"members of group {g} ended with different results")
            if rnd:
                walls.append(max(d[2] for d in done.values()) - t0)
                sent.append(statistics.fmean(d[1] for d in done.values()))
    finally:
        for conn in pipes:
            try:
                conn.send(("close",))
            except OSError:
                pass
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()
    g = max(sizes)
    return {"wall_s_median": round(statistics.median(walls), 3), "wall_s": [round(w, 3) for w in walls],
            "bytes_per_member": round(statistics.fmean(sent)), "numel": numel, "largest_group": g,
            "streams_per_step": 2 * members * (g - 1) if group_size else 2 * members * (members - 1)}


def _answer(conn: Connection, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise SystemExit(f"a worker did not answer within {timeout:.0f} s")
    kind, payload = conn.recv()
    if kind == "error":
        raise SystemExit(f"a worker failed: {payload}")
    return payload


def _worker(conn: Connection, count: int, numel: int, block: int, ca_key: str, barrier: Any) -> None:
    from diloco_allreduce import Member  # (benchmarks/ is on a spawned worker's path: the script's folder)

    from potluck.compression.int8 import Int8BlockCodec
    from potluck.protos.net.certs import CertificateAuthority

    ca = CertificateAuthority.load_or_create(ca_key, RUN)
    ms = [Member(numel, Int8BlockCodec(block), ca, rpc_timeout=1800.0) for _ in range(count)]
    conn.send(("ok", [(m.id, m.address) for m in ms]))
    try:
        while True:
            message = conn.recv()
            if message[0] == "close":
                return
            _, step, rnd, mine = message
            out = _round(ms, mine, step, rnd, numel, barrier)
            bad = [o for o in out.values() if isinstance(o, BaseException)]
            conn.send(("error", repr(bad[0])) if bad else ("ok", out))
    finally:
        for m in ms:
            m.close()



def _round(ms: list, mine: list, step: int, rnd: int, numel: int, barrier: Any) -> dict[int, Any]:
    """This worker's members' part of one round: (digest, bytes sent, end time) or the error, by member index."""
    import torch

    out: dict[int, Any] = {}
    start = threading.Event()

    def go(k: int, index: int, info: Any, delta: torch.Tensor) -> None:
        start.wait()
        try:
            mean, stats = ms[k].ar.run(info, delta, wait_s=1800.0, grace_s=1800.0)
            out[index] = (hashlib.sha256(mean.numpy().tobytes()).hexdigest(), stats.bytes_sent, time.perf_counter())
        except BaseException as err:  # reported to the parent
            out[index] = err

    for k in range(len(mine)):
        ms[k].step = step
        ms[k].ar.expect(step, "base")
    threads = [threading.Thread(target=go, args=(k, index, info, torch.randn(
        numel, generator=torch.Generator().manual_seed(rnd * 100_003 + index)).mul_(0.01)))
        for k, (index, info) in enumerate(mine)]
    for t in threads:
        t.start()
    barrier.wait(timeout=600)  # (one place per worker, and the parent's)
    start.set()
    for t in threads:
        t.join()
    return out
