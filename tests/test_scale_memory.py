"""What the coordinator keeps between ticks at scale, and how the scale benchmark counts memory: each peer's
page row kept until its record changes, and the PSS of the coordinator's processes beside their RSS."""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

from potluck.coordinator.membership import PeerTable
from potluck.coordinator.snapshot import peer_rows
from potluck.protos.wire.records import PeerRecord


def test_the_scale_benchmark_counts_memory_a_forked_child_shares_once() -> None:
    """``swarm_scale.py`` sums its coordinator's processes' PSS as well as their RSS: the DHT process is forked
    and shares the pages of the imports it inherited, which RSS counts in both."""
    spec = importlib.util.spec_from_file_location("swarm_scale", Path(__file__).parents[1] / "benchmarks" / "swarm_scale.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ballast = bytearray(64 << 20)  # (touched: 64 MB the child shares, copy on write)
    ballast[::4096] = b"x" * len(ballast[::4096])
    child = os.fork()
    if child == 0:
        signal.pause()
        os._exit(0)
    try:
        parent = os.getpid()
        rss, pss = bench.rss(parent) + bench.rss(child), bench.pss(parent) + bench.pss(child)
        assert 0 < pss < rss - (48 << 20)  # (the ballast, counted once, not twice)
        assert bench.pss(-1) == 0 and bench.rss(-1) == 0  # (a process gone: nothing, no error)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_snapshots_peer_rows_kept_between_builds_are_the_rows_made_anew() -> None:
    """Each peer's page row is kept on its view and made again only when its record, liveness or place changed;
    the rows (and their keys' order) are those a build from nothing gives, after each kind of change."""
    ids = [f"12D3KooW{i:044d}" for i in range(6)]
    table = PeerTable(5.0)
    table.update({p: PeerRecord(peer_id=p, address=f"10.0.0.1:{i}", seq=1, version=1) for i, p in enumerate(ids)}, now=0.0)
    tasklets = {p: {"stage": 0, "replica": i} for i, p in enumerate(ids)}
    hist = [{"clipped": [ids[1]], "rejected": []}]

    def both(now: float) -> tuple[list[dict], list[dict]]:
        kept = peer_rows(list(table.peers.values()), tasklets, now, hist)
        for view in table.peers.values():
            view.page_row = None
        return kept, peer_rows(list(table.peers.values()), tasklets, now, hist)

    for now, change in enumerate([
            lambda: None,
            lambda: table.update({ids[0]: PeerRecord(peer_id=ids[0], address="10.0.0.1:0", seq=2, version=2)}, now=1.0),
            lambda: table.update({ids[2]: PeerRecord(peer_id=ids[2], address="10.0.0.1:2", seq=2, state="left")}, now=2.0),
            lambda: table.update({}, now=9.0),  # (everyone else lost)
            lambda: tasklets.update({ids[3]: {"stage": 1, "replica": 0}}),
            lambda: hist.append({"clipped": [ids[1]], "rejected": [ids[4]]})], start=1):
        both(float(now))  # (kept from the build before)
        change()
        kept, fresh = both(float(now) + 0.5)
        assert kept == fresh and [list(r) for r in kept] == [list(r) for r in fresh], now
    assert {r["state"] for r in fresh} == {"lost", "left"} and fresh[1]["clipped"] == 2 and fresh[4]["rejected"] == 1
