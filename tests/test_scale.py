"""What keeps the coordinator's cost flat as the swarm grows (issue 30); the figures at 1,000 peers are
``benchmarks/swarm_scale.py``'s, these check the behaviours with real DHT nodes and tens of peers.

* the DHT process survives calls of more than 16 KB (a plan of 4 rounds of 30 members killed it);
* heartbeats go straight to the coordinator's node, which reads only the records that changed;
* the history fold, given only what changed, makes the same history as given everything;
* a snapshot of a big swarm holds 200 peers and does not grow with the swarm; the rest page through
  ``/api/v1/peers``, which refuses a bad query with a clear 400;
* the plan holds the newest rounds that fit in a record, the membership table forgets the longest
  gone, and a decision's pings do not hold up the loop.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from functools import partial
from typing import Any

import grpc
import pytest
from fake_state import make_state
from hivemind.utils import get_dht_time
from rawhttp import raw_request

from potluck.coordinator.rounds import history
from potluck.coordinator.rounds.rounds import Rounds
from potluck.coordinator.status.snapshot import PEERS_INLINE, RunInfo, Series, build
from potluck.coordinator.status.status import StatusServer
from potluck.coordinator.swarm.membership import PeerTable
from potluck.coordinator.swarm.pings import Answer, Polled, Waiting, Why
from potluck.coordinator.swarm.publisher import Publisher
from potluck.coordinator.swarm.service import Pinger
from potluck.coordinator.trust.integrity import Integrity
from potluck.coordinator.trust.trust import Trust
from potluck.peer.swarm.heartbeat import Heartbeat
from potluck.protos import potluck_pb2 as pb
from potluck.protos import potluck_pb2_grpc as pb_grpc
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import RunConfig
from potluck.protos.net.dhtguard import run_key
from potluck.protos.net.feed import Feed, store_at
from potluck.protos.net.identity import Identity
from potluck.protos.net.swarm import SwarmNode
from potluck.protos.net.transport import PeerClient, Traffic
from potluck.protos.wire.envelope import canonical, seal
from potluck.protos.wire.records import MAX_AUDITS, Manifest, Member, PeerRecord, Round, StepReport

COORD = Identity.generate()


async def _echo_size(dht: Any, node: Any, blob: bytes) -> int:
    return len(blob)


@pytest.fixture(scope="module")
def nodes() -> Iterator[tuple[SwarmNode, SwarmNode]]:
    """The coordinator's node (its id is its peers key's, as bootstrap makes it) and a peer's."""
    a = SwarmNode(COORD, coordinator=COORD.peer_id, host="127.0.0.1", node_id_source=run_key(COORD.peer_id, "peers"))
    b = SwarmNode(Identity.generate(), coordinator=COORD.peer_id, initial_peers=a.maddrs, host="127.0.0.1")
    try:
        yield a, b
    finally:
        b.shutdown()
        a.shutdown()


def test_the_dht_process_takes_calls_of_more_than_16_kb(nodes: tuple[SwarmNode, SwarmNode]) -> None:
    """Python sends a message over 16 KB as a header, then a body; hivemind read the header alone, took the
    body for the next header and its DHT process died. Twenty calls of 200 KB each now all arrive."""
    a, _ = nodes
    for i in range(20):
        blob = bytes([i]) * 200_000
        assert a.dht.run_coroutine(partial(_echo_size, blob=blob), return_future=True).result(timeout=15) == len(blob)
    assert a.dht.is_alive()


def beat(who: Identity, seq: int, state: str = "training") -> dict:
    return seal(who, PeerRecord(peer_id=who.peer_id, address="127.0.0.1:1", state=state, seq=seq), 60)


def test_the_coordinator_reads_only_the_records_that_changed(nodes: tuple[SwarmNode, SwarmNode]) -> None:
    a, b = nodes
    peers = [Identity.generate() for _ in range(30)]
    key = run_key(COORD.peer_id, "peers")

    def store(who: Identity, seq: int, state: str = "training") -> None:  # what SwarmNode.publish_peer does
        fn = partial(store_at, peer=COORD.peer_id, key=key, subkey=who.peer_id, value=beat(who, seq, state),
                     expiration=get_dht_time() + 60)
        assert b.dht.run_coroutine(fn)

    for who in peers:
        store(who, 1)
    feed = Feed(a, "peers", PeerRecord, "peer record", every_s=0.0, local=True)
    before = time.monotonic()
    changed, refused = feed.read()
    assert len(changed) == 30 and not refused and feed.last_changed == 30 and len(feed.records) == 30
    assert feed._unseen is None  # (nothing kept for a feed nobody takes from: it would only grow)
    assert feed.take() == set(feed.records)  # (the first time: every record held; then what changed since)
    assert feed.as_of is not None and before <= feed.as_of <= time.monotonic()  # when the read that brought them began
    assert feed.read() == ([], []) and feed.last_changed == 0  # nothing changed: nothing crosses, nothing re-verified
    store(peers[3], 2, "left")
    store(peers[7], 2)
    changed, _ = feed.read()
    assert sorted(changed) == sorted([peers[3].peer_id, peers[7].peer_id]) and feed.last_changed == 2
    assert feed.records[peers[3].peer_id].state == "left" and feed.records[peers[7].peer_id].seq == 2
    a.changes("peers", feed._ack, local=True).result(timeout=15)  # an answer the reader never took ...
    store(peers[9], 3)
    changed, _ = feed.read()
    assert changed == [peers[9].peer_id]  # ... is not lost: the next read brings what changed since the last one taken
    assert feed.take() == {peers[i].peer_id for i in (3, 7, 9)} and feed.take() == set()  # (every read's, once)
    odd = seal(peers[12], Manifest.model_construct(run_id="r"), 60)  # signed, but no peer record: opened there ...
    b.dht.run_coroutine(partial(store_at, peer=COORD.peer_id, key=key, subkey=peers[12].peer_id, value=odd,
                                expiration=get_dht_time() + 60))
    changed, refused = feed.read()  # ... refused here by the parse, said, and not held
    assert changed == [peers[12].peer_id] and peers[12].peer_id not in feed.records
    assert len(refused) == 1 and "malformed PeerRecord" in refused[0], refused
    assert feed.take() == {peers[12].peer_id}  # (its record went: the consumer drops what it made of it)


def test_a_heartbeat_lands_while_the_coordinator_is_away(nodes: tuple[SwarmNode, SwarmNode]) -> None:
    """Heartbeats go straight to the coordinator's node; when that node does not answer (here: a peer id no
    node has), the record is stored the usual way, on the key's nearest live nodes (a goodbye after the
    coordinator stopped was lost)."""
    a, b = nodes
    who = Identity.generate()
    fn = partial(store_at, peer=Identity.generate().peer_id, key=run_key(COORD.peer_id, "peers"), subkey=who.peer_id,
                 value=beat(who, 5, "left"), expiration=get_dht_time() + 60)
    assert b.dht.run_coroutine(fn, return_future=True).result(timeout=30)
    assert a.get_peers()[0][who.peer_id].state == "left"


def test_folding_only_what_changed_makes_the_same_history() -> None:
    ids = [f"12D3KooW{c * 44}" for c in "abcdefgh"]
    rounds = {s: Round(step=s, members=[Member(peer_id=p, address="x:1", replica=i) for i, p in enumerate(ids)])
              for s in range(1, 8)}
    round_at = partial(lambda r, s: r.get(min(s, 7)), rounds)

    def rec(pid: str, v: int) -> PeerRecord:
        return PeerRecord(peer_id=pid, address="x:1", version=v, seq=v,
                          recent=[StepReport(step=s, state_hash=f"h{s}", loss=2.0 + s / 10, outer_bytes=10)
                                  for s in range(max(1, v - 3), v + 1)])

    whole: list[dict] = []
    part: list[dict] = []
    memo: history.Memo = {}
    last: dict[str, PeerRecord] = {}
    for v in range(1, 8):
        now = {pid: rec(pid, v) for pid in ids[: 4 + v % 4]}  # a few fall silent and come back
        changed = [r for pid, r in now.items() if last.get(pid) != r]
        last.update(now)
        for done in (v - 1, v):  # step v's reports come in before it commits; it commits a tick later, nothing new
            whole, _ = history.fold(whole, list(last.values()), round_at, done, now=float(done))
            part, _ = history.fold(part, changed if done < v else [], round_at, done, now=float(done), memo=memo,
                                   everyone=list(last.values()))
    assert json.dumps(part, sort_keys=True) == json.dumps(whole, sort_keys=True)
    assert part[-1]["hash_counts"] == {"0": {"h7": 7}} and part[-1]["state_hashes"]  # (8 members: maps kept)


def big_snapshot(n: int, steps: int = 6) -> dict[str, Any]:
    """The coordinator's own fold and build for ``n`` peers in one stage, all members of every round."""
    ids = [f"12D3KooW{i:044d}" for i in range(n)]
    cfg, table, rounds = RunConfig(), PeerTable(8.0), Rounds(stages=1)
    members = [Member(peer_id=p, address=f"10.0.0.1:{i}", replica=i) for i, p in enumerate(ids)]
    hist: list[dict] = []
    for v in range(1, steps + 1):
        rounds.decide(members, now=float(v), decided_at=float(v))
        recs = {p: PeerRecord(peer_id=p, address=f"10.0.0.1:{i}", state="training", version=v, seq=v,
                              state_hash=f"h{v}", replica=i, tokens_per_s=float(i),
                              recent=[StepReport(step=v, state_hash=f"h{v}", loss=3.0, replica=i, members=n)])
                for i, p in enumerate(ids)}
        table.update(recs, now=float(v))
        rounds.observe(table.reports(), now=float(v))
        hist, _ = history.fold(hist, table.records(), rounds.round_at, rounds.committed, now=float(v))
    return build(RunInfo("run", "12D3coord", "/ip4/1", "http://x/", 0.0, False), cfg, list(table.peers.values()),
                 rounds, hist, [], [], Series(), {}, now=float(steps))


def api_bytes(snap: dict[str, Any]) -> int:
    return len(json.dumps({k: v for k, v in snap.items() if not k.startswith("_")}))


def test_a_big_swarms_snapshot_holds_200_peers_and_does_not_grow_with_it() -> None:
    small, big = big_snapshot(300), big_snapshot(600)
    assert big["peers_summary"] == {"total": 600, "shown": PEERS_INLINE, "truncated": True,
                                    "by_state": {"training": 600}, "live": 600}
    assert len(big["peers"]) == PEERS_INLINE and len(big["_peers"]) == 600
    entry = big["history"][-1]
    assert entry["state_hashes"] == {} and entry["hash_counts"] == {"0": {"h6": 600}}  # past 64 members: counts
    # what grows with the swarm is the round and its grid (a cell per member), not the peers or the history
    per_member = (api_bytes(big) - api_bytes(small)) / 300
    assert per_member < 400, per_member
    assert api_bytes(big) < 1_000_000


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[StatusServer, dict[str, Any]]]:
    state = make_state(300, steps=12, seed=5)
    srv = StatusServer("127.0.0.1", 0, lambda: state)
    try:
        yield srv, state
    finally:
        srv.stop()


def get(srv: StatusServer, path: str) -> tuple[int, Any]:
    code, _, body = raw_request(srv.port, "GET", path)
    return code, json.loads(body)


def test_the_peers_api_pages_sorts_and_filters_every_peer(server: tuple[StatusServer, dict[str, Any]]) -> None:
    srv, state = server
    everyone = state["_peers"]
    assert state["peers_summary"]["truncated"] and len(everyone) == 300
    code, page = get(srv, "/api/v1/peers?offset=250&limit=100")
    assert code == 200 and page["total"] == page["known"] == 300
    assert [p["id"] for p in page["peers"]] == [p["id"] for p in everyone[250:]]
    _, fast = get(srv, "/api/v1/peers?sort=-tokens_per_s&limit=5")
    assert [p["tokens_per_s"] for p in fast["peers"]] == sorted((p["tokens_per_s"] for p in everyone), reverse=True)[:5]
    _, lost = get(srv, "/api/v1/peers?state=lost&limit=500")
    assert lost["total"] == sum(p["state"] == "lost" for p in everyone) > 0
    assert all(p["state"] == "lost" for p in lost["peers"])
    named = everyone[123]
    _, found = get(srv, f"/api/v1/peers?q={named['id'][-10:].lower()}")
    assert [p["id"] for p in found["peers"]] == [named["id"]]


@pytest.mark.parametrize("query,says", [
    ("limit=0", "limit must be a whole number from 1 to 500"),
    ("limit=ten", "limit must be a whole number"),
    ("offset=-1", "offset must be a whole number"),
    ("sort=fastest", "sort must be one of"),
    ("state=asleep", "state must be live, gone or one of"),
    ("page=2", "unknown parameter 'page'"),
    ("limit=5&limit=6", "'limit' given more than once"),
    ("q=" + "x" * 129, "at most 128 characters"),
])
def test_a_bad_peers_query_is_a_clear_400(server: tuple[StatusServer, dict[str, Any]], query: str, says: str) -> None:
    srv, _ = server
    code, body = get(srv, "/api/v1/peers?" + query)
    assert code == 400 and says in body["error"], body


def test_the_plan_holds_the_newest_rounds_that_fit_and_says_when_none_does(monkeypatch: pytest.MonkeyPatch,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    class Node:
        identity = COORD

        def seal(self, record: Any, ttl: float, raw: dict | None = None) -> dict:
            return seal(COORD, record, ttl, raw)

        def sealed_size(self, value: dict, ttl: float) -> int:
            return len(json.dumps(value["body"].decode()))

    monkeypatch.setattr("potluck.coordinator.swarm.publisher.MAX_PLAN_BYTES", 64 << 10)
    pub = Publisher(Node(), Manifest(run_id="r", coordinator=COORD.peer_id, config={}), set())  # type: ignore[arg-type]

    def rounds(n: int) -> list[Round]:
        return [Round(step=s, members=[Member(peer_id=f"12D3KooW{i:044d}", address=f"10.0.0.1:{i}", replica=i)
                                       for i in range(n)]) for s in range(1, 5)]

    plan = pub.fitting(made := rounds(30))
    assert plan is not None and [r.step for r in plan.rounds] == [1, 2, 3, 4]
    again = pub.fitting(made)  # (its rounds' JSON kept from the last plan: the same bytes as dumped whole)
    body = json.loads(pub._sealed[1]["body"])
    assert again is not None and {k: v for k, v in body.items() if k != "_expires"} == again.model_dump(mode="json")
    assert pub._sealed[1]["body"] == canonical(body) and len(pub._dumped) == 4
    assert [r.step for r in pub.fitting(rounds(200)).rounds] == [3, 4]  # type: ignore[union-attr]
    assert pub.fitting(rounds(700)) is None
    assert "makes a plan of" in caplog.text and "it is not published" in caplog.text


def test_a_peer_polls_the_plans_head_and_reads_the_plan_only_when_it_is_newer(
        nodes: tuple[SwarmNode, SwarmNode]) -> None:
    """Every peer polls for a new plan several times a second; a plan of 1,000 members is ~700 KB. The
    peer reads the small head and fetches the plan itself once per new plan (real DHT nodes)."""
    a, b = nodes
    pub = Publisher(a, Manifest(run_id="r", coordinator=COORD.peer_id, config={}), set())
    members = [Member(peer_id=f"12D3KooW{i:044d}", address=f"10.0.0.1:{i}", replica=i) for i in range(300)]
    plan_reads: list[int] = []
    read = b.get_plan
    b.get_plan = lambda min_seq=0: plan_reads.append(min_seq) or read(min_seq)  # type: ignore[method-assign]
    beat = Heartbeat(b, Manifest(run_id="r", coordinator=COORD.peer_id, config={}),
                     lambda: PeerRecord(peer_id="x", address="x:1"), heartbeat_s=60.0, ttl_s=60.0)
    told, sealed = list[int](), list[object]()
    beat.on_plan = lambda plan: (told.append(plan.rounds[-1].step), 1 / 0)  # type: ignore[func-returns-value]
    a.seal = lambda record, ttl, raw=None: sealed.append(record) or seal(COORD, record, ttl, raw)  # type: ignore
    try:
        for step in (1, 2):
            pub.new_plan()
            pub.publish([Round(step=s, members=members) for s in range(1, step + 1)])
            assert all(answer.result(timeout=10) for _, answer in pub._pending)  # (stored: the test's own wait)
            assert len(sealed) == step  # (a plan is signed once: what its size was measured on is what is stored)
            deadline = time.monotonic() + 20
            while beat.plan is None or beat.plan.rounds[-1].step < step:
                assert time.monotonic() < deadline, f"the peer never read the plan of step {step}"
                beat._refresh(with_manifest=False)
            reads = len(plan_reads)
            for _ in range(5):  # the same plan: only its head is read
                beat._refresh(with_manifest=False)
            assert len(plan_reads) == reads, plan_reads
        assert told == [1, 2]  # (each newer plan told once, to a hook that raises: the heartbeat lives on)
    finally:
        del b.get_plan, a.seal


def test_the_membership_table_forgets_the_longest_gone_past_its_bound() -> None:
    table = PeerTable(heartbeat_timeout_s=5.0, keep_gone=3)
    ids = [f"p{i}" for i in range(10)]
    table.update({p: PeerRecord(peer_id=p, address="x:1", seq=1) for p in ids}, now=0.0)
    for k in range(6):  # six fall silent, one a second
        table.update({q: PeerRecord(peer_id=q, address="x:1", seq=2 + k) for q in ids if q not in ids[: k + 1]},
                     now=1.0 + k)
    table.update({q: PeerRecord(peer_id=q, address="x:1", seq=20) for q in ids[6:]}, now=11.5)
    assert sorted(table.peers) == sorted(ids[3:])  # the live four, and the three that went last
    assert [v.record.peer_id for v in table.changed] == ids[6:]


def test_a_decisions_pings_run_off_the_loop_and_wake_it_when_done() -> None:
    """The loop does not wait for the answers; the pinger wakes it when they are in (it decided up to a tick later)."""
    client, answered = PeerClient(Traffic()), threading.Event()
    pinger = Pinger(client, "run", "me", done=answered.set)
    recs = [PeerRecord(peer_id=f"p{i}", address="127.0.0.1:1", seq=1) for i in range(3)]  # nobody listens there
    t0 = time.monotonic()
    assert pinger.poll(recs) == Waiting(Why.STARTED) and time.monotonic() - t0 < 0.5  # it does not wait for them
    assert answered.wait(30)
    answer = pinger.poll(recs)
    assert isinstance(answer, Answer) and answer.records == [] and answer.began >= t0
    client.close()


def test_a_decisions_pings_go_out_all_at_once() -> None:
    """48 peers, each of whose answers waits until all 48 pings have arrived: they all answer, so none waited for
    another's answer (32 threads pinged in turn, and with churn a decision waited 2 s timeouts in waves: 6 s at
    1,000 peers). A peer that answers as another id does not count."""
    n = 48
    arrived = threading.Barrier(n, timeout=10)

    class Peers(pb_grpc.PeerServiceServicer):
        def Ping(self, request: pb.PingRequest, context: object) -> pb.PingReply:  # noqa: N802 (gRPC's name)
            arrived.wait()
            return pb.PingReply(peer_id="p0", sent_at=request.sent_at)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=n))
    pb_grpc.add_PeerServiceServicer_to_server(Peers(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = PeerClient(Traffic())
    try:
        answered = client.ping_all([(f"127.0.0.1:{port}", ("p0", "p1", "")[i % 3]) for i in range(n)],
                                   pb.PingRequest(header=pb.Header(run_id="run", sender="me")), timeout=15)
        assert answered == [i % 3 != 1 for i in range(n)] and not arrived.broken
    finally:
        client.close()
        server.stop(0)


def test_a_decision_pings_only_the_peers_its_reports_do_not_show_at_work() -> None:
    """Members whose records hold the committed step of this epoch just averaged (or fetched) it with their peers:
    a decision pings the others only (at 1,000 members, the newcomers: pinging all took 3-6 s). A peer at an older
    version or of another epoch is pinged like a stranger."""
    table = PeerTable(heartbeat_timeout_s=60.0)
    recs = {p: PeerRecord(peer_id=p, address="127.0.0.1:1", seq=1, version=v, epoch=e)  # nobody listens there
            for p, v, e in (("a", 7, 2), ("b", 7, 2), ("old", 6, 2), ("other-epoch", 7, 1), ("new", 0, 0))}
    table.update(recs, now=0.0)
    proven = table.at_work(7, 2)
    assert proven == {"a", "b"} and table.at_work(0, 0) == set()  # (version 0 proves nothing: anyone holds it)
    # a member of the round that made v7 whose record lags (a busy peer) but heartbeats is proven too; not a stale one
    made = Round(step=7, epoch=2, members=[Member(peer_id=p, address="x:1", replica=i) for i, p in enumerate(["a", "old"])])
    table.fresh_s = 2.0
    assert table.at_work(7, 2, made, now=1.0) == {"a", "b", "old"} and table.at_work(7, 2, made, now=2.5) == {"a", "b"}
    pinged: list[str] = []

    class Client:
        def ping_all(self, targets: list[tuple[str, str]], request: object, timeout: float) -> list[bool]:
            pinged.extend(peer for _, peer in targets)
            return [False] * len(targets)

    pinger = Pinger(Client(), "run", "me")  # type: ignore[arg-type]
    answer: Polled = Waiting(Why.STARTED)
    deadline = time.monotonic() + 30
    while not isinstance(answer, Answer) and time.monotonic() < deadline:
        answer = pinger.poll(recs.values(), lambda: proven)
        time.sleep(0.02)
    assert isinstance(answer, Answer) and sorted(r.peer_id for r in answer.records) == ["a", "b"]
    assert sorted(pinged) == ["new", "old", "other-epoch"]


def test_a_peer_evicted_while_the_decisions_pings_ran_is_not_in_the_round() -> None:
    """A lie proven in the tick that decides the rerun: the pings began before the proof, and the liar answered
    them. The rerun named it as a member and shard owner, and every honest peer then waited 4.6 s for a shard
    nobody would reduce (in a lying owner's run)."""
    recs = [PeerRecord(peer_id=p, address="x:1", seq=1) for p in ("a", "b", "liar")]

    class Client:
        def ping_all(self, targets: list[tuple[str, str]], request: object, timeout: float) -> list[bool]:
            return [True] * len(targets)

    pinger, deadline = Pinger(Client(), "run", "me"), time.monotonic() + 30  # type: ignore[arg-type]
    assert pinger.poll(recs) == Waiting(Why.STARTED)  # (the pings start: all three)
    while isinstance(answer := pinger.poll(recs[:2]), Waiting) and time.monotonic() < deadline:  # (then only two)
        time.sleep(0.02)
    assert isinstance(answer, Answer) and [r.peer_id for r in answer.records] == ["a", "b"]


def test_a_rounds_audits_stay_within_its_bound_and_draw_as_before() -> None:
    """Auditors are drawn from a pool sorted once per stage (once per shard was a second at 1,000 owners);
    the draws are those of the per-shard choice it replaces, and past MAX_AUDITS shards a round carries a
    random MAX_AUDITS of them (Round.audits' own bound: more made the round invalid)."""
    cfg = apply_overrides(RunConfig(), {"sync.audit_fraction": 0.5, "sync.second_audit": 0.0})

    def stage_of(n: int) -> Round:
        return Round(step=3, members=[Member(peer_id=f"12D3KooW{i:044d}", address="x:1", replica=i) for i in range(n)])

    def before(made: Round, nxt: list[Member], rng: random.Random) -> list[tuple[int, str, str]]:  # the old picker
        out, ids = [], {m.peer_id for m in nxt}
        for shard, m in enumerate(made.stage_members(0)):
            if rng.random() >= 0.5:
                continue
            candidates = sorted(p.peer_id for p in made.members if p.peer_id != m.peer_id and p.peer_id in ids)
            if candidates:
                out.append((shard, m.peer_id, rng.choice(candidates)))
        return out

    small = stage_of(9)
    nxt = small.members[2:]  # two left: they own shards of the step but audit nothing
    got = Integrity(cfg, Trust(probation_steps=0), rng=random.Random(7)).audits(small, nxt)
    assert [(a.shard, a.owner, a.auditor) for a in got] == before(small, nxt, random.Random(7)) != []
    big = stage_of(700)
    audits = Integrity(apply_overrides(cfg, {"sync.audit_fraction": 1.0}), Trust(probation_steps=0),
                       rng=random.Random(7)).audits(big, big.members)
    assert len(audits) == MAX_AUDITS and len({a.shard for a in audits}) == MAX_AUDITS
    assert all(a.auditor != a.owner for a in audits)
    Round(step=4, members=big.members, audits=audits)  # a valid round



def test_a_share_of_audited_shards_gets_a_second_independent_auditor() -> None:
    """``sync.second_audit``: a drawn share of the audited shards has a second auditor, never the owner nor the first
    (an auditor colluding with the owner cannot hide its lie); none with 0, every one with 1, about the share in
    between; a pool of one other member has no second."""
    def stage_of(n: int) -> Round:
        return Round(step=3, members=[Member(peer_id=f"12D3KooW{i:044d}", address="x:1", replica=i) for i in range(n)])

    made = stage_of(8)
    for share, low, high in ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (0.25, 0.2, 0.3)):
        cfg = apply_overrides(RunConfig(), {"sync.audit_fraction": 1.0, "sync.second_audit": share})
        integrity = Integrity(cfg, Trust(probation_steps=0), rng=random.Random(3))
        seconds = 0
        for _ in range(200):
            audits = integrity.audits(made, made.members)
            by_shard: dict[int, list[str]] = {}
            for a in audits:
                by_shard.setdefault(a.shard, []).append(a.auditor)
                assert a.auditor != a.owner
            assert len(by_shard) == 8 and all(len(set(v)) == len(v) <= 2 for v in by_shard.values())
            seconds += sum(len(v) == 2 for v in by_shard.values())
        assert low <= seconds / 1600 <= high, (share, seconds / 1600)
    big = stage_of(700)  # (700 shards, 1,400 audits asked: over 4x the bound a round carries)
    cfg = apply_overrides(RunConfig(), {"sync.audit_fraction": 1.0, "sync.second_audit": 1.0})
    audits = Integrity(cfg, Trust(probation_steps=0), rng=random.Random(5)).audits(big, big.members)
    assert len(audits) == MAX_AUDITS and all(a.auditor != a.owner for a in audits)
    Round(step=4, members=big.members, audits=audits)  # a valid round
    pair = stage_of(2)
    assert [len([a for a in Integrity(cfg, Trust(probation_steps=0)).audits(pair, pair.members) if a.shard == j])
            for j in range(2)] == [1, 1]
