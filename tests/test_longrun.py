"""What a process that runs for days pays for its long life, kept flat: the interpreter's full garbage
collections (run between a loop's iterations, over what survived since the last one, not in the middle
of a coordinator's tick) and a client's gRPC channels (those of peers long gone are closed). Issue 30:
at 300 peers a full collection was the whole of a tick's p99.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAP_PROBE = """
import gc, json, time
from potluck.protos.runtime.heap import NEVER, Heap
started = [[i] for i in range(50_000)]  # what a loop made before it settled: never walked again
heap = Heap(every_s=5.0, whole_every_s=20.0)
heap.settle(100.0)
assert gc.get_threshold()[2] == NEVER and not heap.due(104.9) and heap.due(105.0)
class Node:
    pass
def cycles(n):
    held = [Node() for _ in range(n)]  # pairs in cycles
    for a, b in zip(held[::2], held[1::2]):
        a.other, b.other = b, a
    return held
held = cycles(20_000)
gc.collect(1)
gc.collect(1)  # (alive long enough to reach the oldest generation)
del held  # now garbage there: only a full collection finds it
grown = [[] for _ in range(300_000)]  # what a loop keeps: the young generations fill and collect hundreds of times
kept = sum(1 for o in gc.get_objects() if isinstance(o, Node))
heap.collect(105.0)  # frees them, and freezes what lives
after = dict(heap.section())
held = cycles(10_000)
heap.collect(110.0)  # frozen while alive...
del held  # ... garbage since: only the whole pass finds it
heap.collect(115.0)
before_whole = heap.freed
heap.collect(120.0)
print(json.dumps({"kept": kept, "first": after, "before_whole": before_whole, "section": heap.section(),
                  "due": heap.due(124.0)}))
"""


def test_a_settled_heap_leaves_full_collections_to_the_loop_and_they_skip_what_the_start_made() -> None:
    out = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout)
    first, sec = got["first"], got["section"]
    assert first["frozen"] > 300_000  # the start's objects, the interpreter's, and what the loop kept since
    assert got["kept"] == 20_000  # the young collections ran, but no automatic full one freed the cycles
    assert first["collections"] == 1 and first["freed"] >= 20_000 and 0 < first["last_s"] == first["max_s"]
    assert got["before_whole"] == first["freed"]  # a cycle frozen while alive waits for the whole pass...
    assert sec["freed"] >= first["freed"] + 10_000 and sec["collections"] == 4 and not got["due"]  # ... which frees it


def test_a_client_closes_the_channels_of_peers_long_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    from potluck.protos.net import transport
    monkeypatch.setattr(transport, "KEEP_CHANNELS", 3)
    clock = [1000.0]
    monkeypatch.setattr(transport.time, "monotonic", lambda: clock[0])
    client = transport.PeerClient(transport.Traffic())
    try:
        for port in (1001, 1002, 1003):
            client.stub(f"127.0.0.1:{port}")
        clock[0] += transport.IDLE_CHANNEL_S - 1
        fresh = client.stub("127.0.0.1:1003")  # used again just now
        client.stub("127.0.0.1:1004")  # over the bound, but nobody idle long enough: all kept
        assert len(client._channels) == 4
        clock[0] += 2
        client.stub("127.0.0.1:1005")  # 1001 and 1002 idle past the bound: closed; 1003 and 1004 not
        assert sorted(k[0] for k in client._channels) == ["127.0.0.1:1003", "127.0.0.1:1004", "127.0.0.1:1005"]
        assert client.stub("127.0.0.1:1003") is fresh and client.stub("127.0.0.1:1001") is not None
    finally:
        client.close()


def test_a_coordinator_that_pinged_four_times_its_channel_bound_holds_about_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 4x KEEP_CHANNELS (the real bound, 256): four waves of 256 new peers, each wave half an hour after the
    one before (the churn of a long run); the client never holds more than one wave's channels."""
    from potluck.protos.net import transport
    clock = [0.0]
    monkeypatch.setattr(transport.time, "monotonic", lambda: clock[0])
    client = transport.PeerClient(transport.Traffic())
    held = []
    try:
        for wave in range(4):
            clock[0] += transport.IDLE_CHANNEL_S + 1
            for i in range(transport.KEEP_CHANNELS):
                client.stub(f"127.0.0.1:{10_000 + wave * transport.KEEP_CHANNELS + i}")
                held.append(len(client._channels))
        assert max(held) == held[-1] == transport.KEEP_CHANNELS  # (1,024 made, 768 closed)
    finally:
        client.close()


def test_a_client_forgets_the_channels_of_a_peer_lost_and_only_those() -> None:
    """A peer lost to the run (or evicted) takes its channel with it at once, not after IDLE_CHANNEL_S of churn;
    another peer's channel, and a relay's that the lost peer was reached through, stay open."""
    from potluck.protos.net import transport
    from potluck.protos.net.relay import relayed_address
    client = transport.PeerClient(transport.Traffic())
    try:
        client.stub("127.0.0.1:2001", "lost")
        kept = client.stub("127.0.0.1:2002", "other")
        relay = client.stub("127.0.0.1:2003", "relay")
        client.stub(relayed_address("127.0.0.1:2003", "relay"), "natted")  # (through the relay's channel)
        assert len(client._channels) == 3
        client.forget("lost")
        client.forget("natted")  # (no channel of its own: nothing closes)
        client.forget("never-seen")
        assert sorted(k[0] for k in client._channels) == ["127.0.0.1:2002", "127.0.0.1:2003"]
        assert client.stub("127.0.0.1:2002", "other") is kept and client.stub("127.0.0.1:2003", "relay") is relay
        assert client.stub("127.0.0.1:2001", "lost") is not None and len(client._channels) == 3  # (back: a new one)
    finally:
        client.close()


def test_the_peer_table_says_when_a_peer_is_lost_or_evicted_once() -> None:
    from potluck.coordinator.swarm.membership import PeerTable
    from potluck.protos.wire.records import PeerRecord

    lost: list[str] = []
    table = PeerTable(heartbeat_timeout_s=10.0)
    table.on_lost = lost.append
    table.update({p: PeerRecord(peer_id=p, address=f"127.0.0.1:{i + 1}", seq=1) for i, p in enumerate("abc")}, now=0.0)
    table.update({"a": PeerRecord(peer_id="a", address="127.0.0.1:1", seq=2)}, now=9.0)
    table.evict("c")
    assert lost == ["c"]
    table.update({}, now=12.0)  # b's heartbeats stopped past the timeout; a's did not yet
    table.update({}, now=13.0)
    assert lost == ["c", "b"]
    table.update({}, now=20.0)
    assert lost == ["c", "b", "a"]


def test_the_peer_tables_reports_are_made_again_exactly_when_a_view_changes() -> None:
    """``PeerTable.reports`` is kept between ticks; after every kind of change (a join, a newer record, a goodbye,
    a peer lost, back, evicted, forgotten) it is what making every view's report anew gives."""
    import random

    from potluck.coordinator.swarm.membership import PeerTable
    from potluck.protos.wire.records import PeerRecord

    rng = random.Random(5)
    table = PeerTable(heartbeat_timeout_s=3.0, keep_gone=4)
    seq: dict[str, int] = {}
    for tick in range(300):
        now = float(tick)
        fresh = {}
        for pid in rng.sample([f"p{i}" for i in range(12)], rng.randint(0, 5)):
            seq[pid] = seq.get(pid, 0) + rng.choice((0, 1, 1))  # (an old seq changes nothing)
            state = rng.choice(("training", "training", "left"))
            fresh[pid] = PeerRecord(peer_id=pid, address=f"127.0.0.1:{1 + int(pid[1:])}", seq=seq[pid], version=tick,
                                    state=state)
        table.update(fresh, now=now)
        if rng.random() < 0.05 and table.peers:
            table.evict(rng.choice(sorted(table.peers)))
        assert table.reports() == [v.report() for v in table.peers.values()]
        assert table.reports() is not table.reports()  # (a copy: a caller cannot change the one kept)


@pytest.mark.parametrize("idle_s", [1.0, None])
def test_a_coordinators_channel_closes_its_idle_connection_and_calls_again(tmp_path, idle_s) -> None:  # type: ignore[no-untyped-def]
    """With ``idle_connection_s`` (the coordinator's client), a channel that carried no call for that long lets its
    TLS connection go (about 120 KB each) and connects again for the next call; without it, it stays connected."""
    import threading

    import grpc
    from test_relay import RUN, Handlers, Node

    from potluck.protos import potluck_pb2 as pb
    from potluck.protos.net.certs import CertificateAuthority
    from potluck.protos.net.transport import PeerClient, PeerServer

    ca = CertificateAuthority.load_or_create(tmp_path / "ca.key", RUN)
    peer, coordinator = Node(ca), Node(ca)
    server = PeerServer(Handlers(peer.id), peer.traffic, host="127.0.0.1", port=0, tls=peer.tls)
    client = PeerClient(coordinator.traffic, tls=coordinator.tls, idle_connection_s=idle_s)
    try:
        where = f"127.0.0.1:{server.port}"
        request = pb.PingRequest(header=coordinator.header())
        assert client.ping(where, request, 10.0, peer=peer.id).peer_id == peer.id
        (channel,) = client._channels.values()
        states: list[grpc.ChannelConnectivity] = []
        idle = threading.Event()
        channel.subscribe(lambda s: (states.append(s), s == grpc.ChannelConnectivity.IDLE and idle.set()))
        went_idle = idle.wait(10.0 if idle_s else 2.0)  # (without: twice the 1 s the other waits)
        assert went_idle == (idle_s is not None), states
        assert client.ping(where, request, 10.0, peer=peer.id).peer_id == peer.id  # (connects again)
    finally:
        client.close()
        server.stop(0)


TRIM_PROBE = """
import json
from potluck.protos.runtime.heap import Heap
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
held = [bytes(1000) for _ in range(200_000)]  # 200 MB of the C allocator's heap (over 512 bytes: not pymalloc's)
keep = held[::50]  # every 50th stays: the heap cannot shrink from its top, only by giving back its free pages
del held
before = rss()
heap = Heap()
heap.settle(0.0)
heap.collect(30.0)
print(json.dumps({"before": before, "after": rss(), "trimmed": heap.section()["trimmed"], "kept": len(keep)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim, and /proc")
def test_a_full_collection_gives_the_c_allocators_free_pages_back() -> None:
    """What a burst freed in the C allocator's heap (a join burst's TLS connections, say) stays mapped until
    trimmed: the loop's periodic full collection trims it."""
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout)
    assert got["trimmed"] == 1 and got["before"] - got["after"] > 100 << 20, got


HOLD_PROBE = """
import json, resource, sys
import torch
from potluck.protos.runtime.heap import Heap, hold, resident
held = hold() if sys.argv[1] == "hold" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
keep = []
def step(i):  # what a peer's round does with its big buffers: made, written, freed; a few small things made meanwhile stay
    a = torch.empty(32 << 20).fill_(1.0)  # 128 MB, 4x glibc's largest mmap threshold (32 MB)
    keep.append(bytes(1000 + i))
    b = torch.empty(4 << 20).fill_(2.0)  # 16 MB, under it
    return float(a[-1] + b[-1])
heap = Heap(give_back=held is None)
heap.settle(0.0)
warm = 8 if held else 1  # (held: where freed blocks land in the heap settles within a few steps; the control's
for i in range(warm):      # steps each fault their 128 MB in again, a second of this VM's host faults apiece)
    step(i)
heap.collect(30.0)
f0, settled = faults(), resident()
for i in range(4):
    step(warm + i)
print(json.dumps({"held": held, "faults": faults() - f0, "grew": resident() - settled, "trimmed": heap.section()["trimmed"]}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, and /proc")
def test_a_peer_holds_what_a_step_frees_and_the_next_step_takes_no_page_faults() -> None:
    """A peer's big buffers come back every step: with glibc's defaults one over its mmap threshold is unmapped
    when freed and faulted in (and zeroed) again the next step, 32,768 pages for this 128 MB one; a peer's
    allocator (``hold``) keeps it for the next step, its full collections do not give it back, and what it
    holds does not grow from step to step."""
    procs = {mode: subprocess.Popen([sys.executable, "-c", HOLD_PROBE, mode], stdout=subprocess.PIPE, text=True)
             for mode in ("hold", "default")}  # (both at once: each is mostly torch's import)
    try:
        runs = {mode: json.loads(p.communicate(timeout=120)[0]) for mode, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    held, default = runs["hold"], runs["default"]
    assert held["held"] is True and held["trimmed"] == 0, held
    assert held["faults"] < 1_000 and held["grew"] < 4 << 20, held  # four steps in the memory the first ones left
    assert default["faults"] >= 4 * 32_768, default  # (the control: the defaults fault the 128 MB in again each step)
