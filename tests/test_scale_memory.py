"""What the coordinator keeps between ticks at scale, and how the scale benchmark counts memory: each peer's
page row kept until its record changes, and the PSS of the coordinator's processes beside their RSS."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from potluck.coordinator.rounds.history import KEEP_DETAIL
from potluck.coordinator.rounds.rounds import KEEP_ROUNDS, Rounds
from potluck.coordinator.status.snapshot import PEERS_INLINE, flag_counts, grid_cells, inline_peers, peer_rows
from potluck.coordinator.swarm.membership import PeerTable
from potluck.coordinator.trust.integrity import Integrity
from potluck.coordinator.trust.trust import Trust
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.identity import Identity
from potluck.protos.net.swarm import SwarmNode
from potluck.protos.wire.records import AuditReport, Member, PeerRecord, Round


def swarm_scale() -> Any:
    """``benchmarks/swarm_scale.py`` as a module (benchmarks are scripts, not a package)."""
    path = Path(__file__).parents[1] / "benchmarks" / "swarm_scale.py"
    if str(path.parent) not in sys.path:  # (it imports its process figures from beside it, as a script run from there does)
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("swarm_scale", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_scale_benchmark_counts_memory_a_forked_child_shares_once() -> None:
    """``swarm_scale.py`` sums its coordinator's processes' PSS as well as their RSS: the DHT process is forked
    and shares the pages of the imports it inherited, which RSS counts in both."""
    bench = swarm_scale()
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


def test_the_grid_cells_kept_between_builds_show_each_members_state_now() -> None:
    """The round's cells are made once and their states set at each build: a member without a row is lost."""
    ids = [f"12D3KooW{c * 44}" for c in "abc"]
    current = Round(step=3, stages=1, members=[Member(peer_id=p, address="x:1", replica=i) for i, p in enumerate(ids)])
    first = grid_cells(current, {ids[0]: {"state": "training"}, ids[1]: {"state": "syncing"}})
    assert [(c["replica"], c["peer"], c["state"]) for c in first] == [(0, ids[0], "training"), (1, ids[1], "syncing"),
                                                                      (2, ids[2], "lost")]
    again = grid_cells(current, {ids[2]: {"state": "training"}})
    assert again is first and [c["state"] for c in again] == ["lost", "lost", "training"]


def test_the_rounds_progress_of_peers_long_gone_is_forgotten_with_churn() -> None:
    """Every peer's progress was kept for good: at 10 % churn a minute of 1,000 peers, 6,000 more a run-hour. It is
    kept for the peers the table still holds (their reports), and a bounded number more."""
    rounds, table = Rounds(stages=1), PeerTable(heartbeat_timeout_s=5.0, keep_gone=10)
    for t in range(200):  # each second one peer joins and another falls silent
        table.update({f"p{i}": PeerRecord(peer_id=f"p{i}", address="x:1", seq=t + 1, inner_step=t) for i in range(t, t + 20)},
                     now=float(t))
        rounds.observe(table.reports(), float(t))
    held = len(table.reports())
    assert held <= 40 and len(rounds._progress) <= 2 * held + 100, (held, len(rounds._progress))
    assert {r.peer_id for r in table.reports()} <= set(rounds._progress)


def test_the_tables_reports_kept_between_ticks_are_every_views_report_made_anew_in_order() -> None:
    """Only the views that changed have their reports made again (newcomers go last, as in the views' order): after
    every update of a churning swarm -- joins, heartbeats, silences, goodbyes, comebacks, evictions, the longest
    gone forgotten -- the list is the one made anew from every view."""
    rng = random.Random(3)
    table, seq, forgot = PeerTable(heartbeat_timeout_s=12.0, keep_gone=25), dict[str, int](), 0
    for t in range(300):
        batch = {}
        for pid in rng.sample([f"p{i}" for i in range(t // 3, t // 3 + 60)], 6):  # (new ids keep coming)
            seq[pid] = seq.get(pid, 0) + 1
            batch[pid] = PeerRecord(peer_id=pid, address="x:1", seq=seq[pid], version=seq[pid] // 2,
                                    state="left" if rng.random() < 0.1 else "training")
        known = set(table.peers)
        table.update(batch, now=float(t))
        forgot += bool(known - set(table.peers))
        if t % 7 == 0 and table.peers:
            table.evict(rng.choice(sorted(table.peers)))
        if t % 3 == 0:  # (asked on some ticks only, as a coordinator that skips: the changes pile up)
            assert table.reports() == [v.report() for v in table.peers.values()], t
    assert table.reports() == [v.report() for v in table.peers.values()]
    assert 0 < forgot < 100, forgot  # (most updates keep every view: the reports were not all made anew)


def test_the_flag_counts_kept_between_builds_are_those_of_the_whole_history() -> None:
    """The entries past the detail window no longer change, so their counts are kept: through new entries, the
    newest ones' flags changing in place, and rollbacks, the counts are those of a pass over the whole history."""
    rng = random.Random(5)
    history: list[dict[str, Any]] = []

    def entry(step: int) -> dict[str, Any]:
        return {"step": step, "clipped": rng.sample("abcd", rng.randint(0, 2)), "rejected": rng.sample("cdef", rng.randint(0, 1))}

    for t in range(400):
        if t % 50 == 49:  # a rollback: the newest entries go, new ones come after
            history = history[: len(history) - rng.randint(1, 30)]
        history = history + [entry(len(history) + 1)]
        history[-1 - rng.randint(0, min(len(history), KEEP_DETAIL) - 1)]["clipped"] = rng.sample("abcd", 1)  # (in place)
        want = ({}, {})
        for h in history:
            for kind, counts in zip(("clipped", "rejected"), want, strict=True):
                for pid in h[kind]:
                    counts[pid] = counts.get(pid, 0) + 1
        assert flag_counts(history) == want, t


def test_the_inline_peers_are_the_most_telling_in_order_as_a_sort_by_attention_chose_them() -> None:
    """Chosen by class without sorting every row (a sort with a key function per row, at every build of a big
    swarm's snapshot): the same rows, in the same order, as the sort it replaced."""
    rng = random.Random(7)
    states = ["failed", "lost", "training", "syncing", "waiting", "left", "finished"]
    for n in (10, 199, 200, 201, 450, 2000):
        peers = [{"id": f"p{i}", "state": rng.choice(states)} for i in range(n)]
        order = {"failed": 0, "lost": 1, "left": 3, "finished": 3}
        want = peers if n <= PEERS_INLINE else [peers[i] for i in sorted(sorted(
            range(n), key=lambda i: (order.get(peers[i]["state"], 2), i))[:PEERS_INLINE])]
        assert inline_peers(peers) == want, n


def test_a_big_record_reaches_the_dht_process_through_a_file_and_a_small_one_through_its_pipe() -> None:
    """A plan past SPILL_BYTES (600 KB at 1,000 members) is written to a private file the DHT process reads and
    removes (through the pipe it held the coordinator's loop while a busy DHT process read it a chunk at a time);
    what peers read back is the same record either way."""
    from potluck.protos.net import spill as spilling
    from potluck.protos.net.dhtguard import run_key
    from potluck.protos.net.identity import Identity
    from potluck.protos.net.swarm import SwarmNode
    from potluck.protos.wire.records import Member, Plan, Round

    coord = Identity.generate()
    a = SwarmNode(coord, coordinator=coord.peer_id, host="127.0.0.1", node_id_source=run_key(coord.peer_id, "peers"))
    b = SwarmNode(Identity.generate(), coordinator=coord.peer_id, initial_peers=a.maddrs, host="127.0.0.1")
    spills: list[str] = []
    write = a.spill.write
    a.spill.write = lambda value: spills.append(write(value)) or spills[-1]  # type: ignore[method-assign]
    try:
        sizes = []
        for n, seq in ((3, 1), (600, 2), (2100, 3)):  # (a few hundred bytes; ~80 KB; over 4x SPILL_BYTES)
            members = [Member(peer_id=f"12D3KooW{i:044d}", address=f"10.0.0.{i % 250}:{1000 + i}", replica=i) for i in range(n)]
            plan = Plan(seq=seq, rounds=[Round(step=seq, members=members)], ts=0.0)
            assert a.publish_plan(plan, ttl=60.0) is True
            assert b.get_plan() == plan and a.get_plan() == plan
            sizes.append(len(a.seal(plan, 60.0)["body"]))
        assert sizes[0] < spilling.SPILL_BYTES < sizes[1] and sizes[2] > 4 * spilling.SPILL_BYTES, sizes
        assert len(spills) == 2 and all(p.startswith(str(a.spill.dir)) for p in spills)  # (only the big ones)
        assert not any(Path(p).exists() for p in spills) and os.listdir(a.spill.dir) == []  # (read, then removed)
        assert os.stat(a.spill.dir).st_mode & 0o777 == 0o700
    finally:
        b.shutdown()
        a.shutdown()
    assert not Path(str(a.spill.dir)).exists() and spilling.SPILL_BYTES == 1 << 16


def test_the_benchmarks_steady_decisions_leave_out_the_round_decided_before_they_began() -> None:
    """The first round (a join burst: every peer new) is decided before the measured window and stays the latest
    decision until the next: it was counted as a steady one (its second at 1,000 peers was the 'decide max').
    Decisions are told apart by their count, so two that took as long are two, and one decided between two
    samples is taken from the final window when the whole window came after the start."""
    bench = swarm_scale()

    def at(t: float, count: int, last: float | None) -> dict:
        return {"t": t, "state": {"coordinator": {"decide_s": {"count": count, "last": last}}}}

    samples = [at(0, 0, None), at(1, 1, 0.9), at(2, 1, 0.9), at(3, 1, 0.9), at(4, 2, 0.05), at(5, 3, 0.05), at(6, 5, 0.07)]
    assert bench.steady_decisions(samples, 2.5, {"max": 0.9, "window": 5, "count": 5}) == [0.05, 0.05, 0.07]
    # (the decision numbered 4, between two samples: in a final window made only of steady ones)
    assert bench.steady_decisions(samples, 2.5, {"max": 0.2, "window": 4, "count": 5}) == [0.05, 0.05, 0.07, 0.2]


MMAP_PROBE = """
import ctypes, json, sys
from potluck.protos.runtime.heap import tame
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype, libc.malloc.restype = Info, ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
tamed = tame() if sys.argv[1] == "tame" else None
libc.free(libc.malloc(4 << 20))  # a big block, freed (glibc's default then keeps blocks up to 4 MB in its heap)
before = libc.mallinfo2().hblks
block = libc.malloc(1 << 20)
print(json.dumps({"tamed": tamed, "own_pages": libc.mallinfo2().hblks - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
def test_a_tamed_allocator_gives_big_blocks_pages_of_their_own_after_a_big_free() -> None:
    """glibc raises the size from which a block gets pages of its own each time it frees such a block: after
    one 4 MB free, a 1 MB block lands in the heap (where its freed pages stay mapped). Tamed, it does not."""
    def probe(mode: str) -> dict[str, Any]:
        out = subprocess.run([sys.executable, "-c", MMAP_PROBE, mode], capture_output=True, text=True, timeout=60,
                             check=True)
        return json.loads(out.stdout)  # type: ignore[no-any-return]

    assert probe("default") == {"tamed": None, "own_pages": 0}  # (the default this guards against)
    assert probe("tame") == {"tamed": True, "own_pages": 1}


async def _frozen(dht: object, node: object) -> int:
    return gc.get_freeze_count()


def test_the_dht_process_never_walks_what_it_inherited() -> None:
    """The DHT process is forked from a process holding torch's, hivemind's and gRPC's objects: its collections
    leave them alone (a walk writes every object's header, and so copies the page out of shared memory)."""
    inherited = len(gc.get_objects())
    node = SwarmNode(Identity.generate(), coordinator="c", host="127.0.0.1")
    try:
        assert node.dht.run_coroutine(_frozen) >= inherited // 2
    finally:
        node.shutdown()


SHED_PROBE = """
import json, mmap, sys
from potluck.protos.runtime.heap import shed

def mapped(path):
    kb, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                kb += int(line.split()[1])
    return kb << 10

path, mode = sys.argv[1], sys.argv[2]
with open(path, "rb") as f:
    pages = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
touched = sum(pages[i] for i in range(0, len(pages), mmap.PAGESIZE))
before = mapped(path)
given = shed() if mode == "shed" else 0
print(json.dumps({"before": before, "after": mapped(path), "given": given}))
"""


def test_shed_gives_back_the_pages_a_library_mapping_had_touched(tmp_path: Path) -> None:
    """The coordinator's start-up drops what its imports touched of the libraries' pages (torch's CUDA build
    touches ~380 MB of them): a file mapped like a library, read through, keeps its 16 MB resident until shed."""
    if tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit()) < (5, 4):
        pytest.skip("MADV_PAGEOUT needs Linux 5.4")
    where = Path(__file__).resolve().parents[1]  # (on disk: tmpfs pages cannot be dropped without swap)
    with tempfile.TemporaryDirectory(dir=where, prefix=".shed-") as folder:
        lib = Path(folder) / "probe.so"
        with open(lib, "wb") as f:
            f.write(os.urandom(16 << 20))
            f.flush()
            os.fsync(f.fileno())  # (clean pages, as a library's are)

        def probe(mode: str) -> dict[str, int]:
            out = subprocess.run([sys.executable, "-c", SHED_PROBE, str(lib), mode], capture_output=True, text=True,
                                 timeout=60, check=True)
            return json.loads(out.stdout)  # type: ignore[no-any-return]

        kept, shed = probe("keep"), probe("shed")
    assert kept["after"] == kept["before"] >= 15 << 20  # (unshed, they stay)
    assert shed["before"] >= 15 << 20 and shed["after"] <= 1 << 20
    assert shed["given"] >= 14 << 20


def test_the_audits_the_coordinator_remembers_are_those_of_the_rounds_it_keeps() -> None:
    """The audits drawn and the auditors' reports seen were kept for the whole run: a few per shard per step, for
    ever. They are kept for the rounds the coordinator keeps; within those, a report seen again is acted on once."""
    # (one auditor a shard: with second audits a shard's "unserved" is said by each of its two auditors)
    cfg = apply_overrides(RunConfig(), {"sync.audit_fraction": 1.0, "sync.second_audit": 0.0})
    integrity = Integrity(cfg, Trust(probation_steps=0), rng=random.Random(3))
    members = [Member(peer_id=f"12D3KooW{i:044d}", address="x:1", replica=i) for i in range(8)]
    rounds: dict[int, Round] = {1: Round(step=1, members=members)}
    events = []
    for step in range(1, 121):
        view = Rounds(stages=1)
        view.rounds, view.committed = rounds, step
        owned, audits = integrity.roles(members, view)
        rounds[step + 1] = Round(step=step + 1, members=owned, audits=audits)
        for old in sorted(rounds)[:-KEEP_ROUNDS]:
            del rounds[old]
        said = [AuditReport(step=a.step, epoch=a.epoch, stage=a.stage, group=a.group, shard=a.shard, owner=a.owner,
                            verdict="unserved" if a.shard == 0 else "ok") for a in audits]
        records = {m.peer_id: PeerRecord(peer_id=m.peer_id, address="x:1", audits=[r for r, a in zip(said, audits, strict=True)
                                                                                  if a.auditor == m.peer_id])
                   for m in members}
        events += integrity.observe(records, rounds.get)
        events += integrity.observe(records, rounds.get)  # (the same records again: nothing new)
        integrity.committed(rounds[step + 1], step + 1, [])
    assert len(events) == 120, "each step's unserved shard said once"
    window = (KEEP_ROUNDS + 2) * len(members)
    assert len(integrity._answered) <= window and len(integrity._reported) <= KEEP_ROUNDS + 2
    assert len(integrity._assigned) <= window
