"""The coordinator's pings of its peers: a newcomer is pinged when it shows up, so a decision need not.

(Most of a decision's time at 1,000 peers with churn was waiting for the newcomers' pings: 0.16 s of a median
decision on a machine of its own, and a second for the first round after a join burst.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from potluck.coordinator.health import Health
from potluck.coordinator.swarm import service
from potluck.coordinator.swarm.membership import PeerTable
from potluck.coordinator.swarm.service import Pinger
from potluck.protos import potluck_pb2 as pb
from potluck.protos.wire.records import PeerRecord


class Client:
    """A client whose pings are answered by whoever is in ``up`` (peer id -> address), and counted."""

    def __init__(self, up: dict[str, str]) -> None:
        self.up, self.pinged, self.lock = up, list[str](), threading.Lock()

    def ping_all(self, targets: list[tuple[str, str]], request: object, timeout: float) -> list[bool]:
        with self.lock:
            self.pinged.extend(peer for _, peer in targets)
        return [self.up.get(peer) == address for address, peer in targets]

    def ping_each(self, targets: list[tuple[str, str]], request: object, timeout: float,
                  answered: Callable[[str, bool], None]) -> None:
        for (_, peer), ok in zip(targets, self.ping_all(targets, request, timeout), strict=True):
            answered(peer, ok)


def until(cond: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def rec(pid: str, address: str = "h:1", seq: int = 1) -> PeerRecord:
    return PeerRecord(peer_id=pid, address=address, seq=seq)


def primed(pinger: Pinger, client: Client, n: int) -> None:
    until(lambda: len(client.pinged) >= n and pinger._primer is None, f"{n} primed pings")


def test_a_decision_takes_a_newcomers_answer_to_its_first_ping_at_once() -> None:
    client = Client({"a": "h:1", "b": "h:1"})
    pinger = Pinger(client, "run", "me")  # type: ignore[arg-type]
    for r in (rec("a"), rec("b")):
        pinger.prime(r)
    primed(pinger, client, 2)
    t0 = time.monotonic()
    answer = pinger.poll([rec("a"), rec("b")])
    assert answer is not None, "no one was left to ping: the answer is there at once"
    assert [r.peer_id for r in answer[0]] == ["a", "b"] and answer[1] >= t0
    assert sorted(client.pinged) == ["a", "b"], "pinged once each, when they showed up"


def test_a_newcomers_first_answer_serves_the_next_decision_only() -> None:
    """A member killed after the decision that took its join-time answer holds a record short of the committed
    step: the decision after pings it (as before priming) and leaves it out, whatever its first answer said."""
    client, done = Client({"a": "h:1"}), threading.Event()
    pinger = Pinger(client, "run", "me", done=done.set)  # type: ignore[arg-type]
    pinger.prime(rec("a"))
    primed(pinger, client, 1)
    assert pinger.poll([rec("a")]) is not None  # the next decision: taken as it is
    del client.up["a"]  # (then killed)
    assert pinger.poll([rec("a")]) is None and done.wait(10)  # the one after: pinged again
    answer = pinger.poll([rec("a")])
    assert answer is not None and answer[0] == [] and client.pinged == ["a", "a"]


def test_a_decisions_pings_start_while_the_round_before_settles_and_wait_for_it() -> None:
    """Not due yet (the committed round's members still report it), the pings start and their answer is kept:
    asked again before it is due, nobody is pinged twice; once due, the answer is taken without a ping. (At 1,000
    peers with churn the newcomers' pings were most of a decision's time, 0.2-1.1 s on a 2-core box.)"""
    client, done = Client({"a": "h:1", "b": "h:1", "new": "h:1"}), threading.Event()
    pinger = Pinger(client, "run", "me", done=done.set)  # type: ignore[arg-type]
    recs = [rec("a"), rec("b"), rec("gone")]
    t0 = time.monotonic()
    assert pinger.poll(recs, lambda: {"b"}, due=False) is None and done.wait(10)
    assert pinger.poll(recs, lambda: {"b"}, due=False) is None, "kept for the decision, not taken"
    assert sorted(client.pinged) == ["a", "gone"], "pinged once, the proven one not at all"
    for r in (rec("new"), rec("silent")):  # (joined while the round settled; one answered its first ping)
        pinger.prime(r)
    until(lambda: pinger._primer is None, "the newcomers' first pings")
    answer = pinger.poll([*recs[:2], rec("new"), rec("silent")], lambda: {"b"})  # (due: "gone" is not live any more)
    assert answer is not None and answer[1] >= t0
    assert [r.peer_id for r in answer[0]] == ["a", "b", "new"], "a newcomer since the pings: in on its own answer"
    assert sorted(client.pinged) == ["a", "gone", "new", "silent"], "nobody pinged twice"
    done.clear()
    assert pinger.poll(recs[:2], lambda: set(), due=False) is None and done.wait(10)  # (taken: the next round pings)
    assert sorted(client.pinged) == ["a", "a", "b", "gone", "new", "silent"]


def test_a_peer_proven_when_the_pings_began_but_not_once_due_is_pinged_by_the_decision() -> None:
    """A member killed while the committed round settled: its fresh heartbeat proved it when the pings began, and
    it was not pinged. Once due its heartbeat is stale and its record short of the committed step: the decision
    pings it, and leaves it out (a swarm test caught the round after it decided with the dead member in)."""
    client, done = Client({"a": "h:1"}), threading.Event()
    pinger = Pinger(client, "run", "me", done=done.set)  # type: ignore[arg-type]
    recs = [rec("a"), rec("victim")]
    assert pinger.poll(recs, lambda: {"a", "victim"}, due=False) is None and not done.is_set()
    assert pinger.poll(recs, lambda: {"a"}) is None and done.wait(10), "due: the victim is pinged"
    answer = pinger.poll(recs, lambda: set())  # ("a"'s proof lapsed while the victim's ping ran: asked once, at due)
    assert answer is not None and [r.peer_id for r in answer[0]] == ["a"] and client.pinged == ["victim"]


def test_a_proof_that_lapses_while_the_round_settles_is_pinged_then_not_once_due(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A member whose heartbeat goes stale while the committed round settles is pinged then (each RECHECK_S), so
    the decision, once due, need not (at 1,000 peers on 2 cores such pings were 0.05-0.3 s of a decision)."""
    monkeypatch.setattr(service, "RECHECK_S", 0.0)
    client, done = Client({"a": "h:1", "slow": "h:1"}), threading.Event()
    pinger = Pinger(client, "run", "me", done=done.set)  # type: ignore[arg-type]
    recs = [rec("a"), rec("slow")]
    assert pinger.poll(recs, lambda: {"a", "slow"}, due=False) is None and client.pinged == []
    assert pinger.poll(recs, lambda: {"a"}, due=False) is None and done.wait(10) and client.pinged == ["slow"]
    answer = pinger.poll(recs, lambda: {"a"})
    assert answer is not None and [r.peer_id for r in answer[0]] == ["a", "slow"] and client.pinged == ["slow"]


def test_a_decisions_time_counts_from_when_it_was_due_not_from_pings_that_began_before() -> None:
    health = Health()
    assert not health.due(False, now=5.0) and health.decision_began(5.5) == 5.5  # (nothing due: its pings' start)
    assert health.due(True, now=10.0) and health.due(True, now=11.0)
    assert health.decision_began(9.0) == 10.0, "pinged while the round before settled: from when it was due"
    assert health.decision_began(10.5) == 10.5, "pinged after it was due: from the pings"
    health.due(False, now=12.0)  # (decided: the next one is due from its own time)
    assert health.due(True, now=20.0) and health.decision_began(9.0) == 20.0


def test_a_newcomer_that_did_not_answer_or_moved_or_answered_long_ago_is_pinged_by_the_decision() -> None:
    """A primed ping that failed proves nothing; nor does an answer at another address (the peer restarted
    elsewhere) or one older than max_age_s. Those are pinged by the decision, the others are not."""
    client = Client({"ok": "h:1", "moved": "h:1", "old": "h:1"})
    done = threading.Event()
    pinger = Pinger(client, "run", "me", done=done.set, primed_s=0.5)  # type: ignore[arg-type]
    pinger.prime(rec("old"))
    primed(pinger, client, 1)
    until(lambda: time.monotonic() - pinger._answered["old"][1] > 0.5, "the old answer to age past primed_s")
    for r in (rec("ok"), rec("silent"), rec("moved")):
        pinger.prime(r)
    primed(pinger, client, 4)
    client.pinged.clear()
    client.up["moved"] = "h:2"
    now = [rec("ok"), rec("silent"), rec("moved", "h:2", seq=2), rec("old")]
    assert pinger.poll(now) is None  # pings go out for three of them
    assert done.wait(10)
    answer = pinger.poll(now)
    assert answer is not None and sorted(r.peer_id for r in answer[0]) == ["moved", "ok", "old"]
    assert sorted(client.pinged) == ["moved", "old", "silent"]


def test_the_table_tells_who_joined_or_came_back_and_no_one_else() -> None:
    table, seen = PeerTable(heartbeat_timeout_s=1.0), list[str]()
    table.on_seen = lambda r: seen.append(r.peer_id)
    table.update({"a": rec("a"), "b": rec("b")}, now=0.0)
    assert sorted(seen) == ["a", "b"]
    table.update({"a": rec("a", seq=2), "b": rec("b")}, now=0.5)  # a heartbeat: nobody new
    assert sorted(seen) == ["a", "b"]
    table.update({"a": rec("a", seq=2), "b": rec("b")}, now=5.0)  # both lost
    assert all(not v.live for v in table.peers.values())
    table.update({"a": rec("a", "h:9", seq=3), "b": rec("b")}, now=5.5)  # a is back (at another address)
    assert sorted(seen[:2]) == ["a", "b"] and seen[2:] == ["a"]
    assert table.peers["a"].live and not table.peers["b"].live


def test_a_fresh_start_short_of_min_peers_keeps_its_answer_and_pings_only_the_peers_it_lacks() -> None:
    """The first round after 1,000 joins was short of ``min_peers`` on its first answer (the last joiners' own pings
    still ran): taken, its answer spent every newcomer's too, and all 960 were pinged again (1.2 s more). Kept, those
    that answered are not pinged again; a silent one is, by itself, once in PING_TIMEOUT_S; a newcomer is in on its
    own first answer; and once ``short`` says go on, the answer is taken with those that answered."""
    client, done = Client({"a": "h:1", "b": "h:1", "new": "h:1"}), threading.Event()
    pinger = Pinger(client, "run", "me", done=done.set)  # type: ignore[arg-type]
    recs, waits = [rec("a"), rec("b"), rec("silent")], list[int]()

    def short(answered: int) -> bool:
        waits.append(answered)
        return answered < 3 and len(waits) < 4

    assert pinger.poll(recs, short=short) is None and done.wait(10)
    assert pinger.poll(recs, short=short) is None and waits == [2], "short: wait on"
    until(lambda: pinger._primer is None, "the silent one's own ping")
    assert pinger.poll(recs, short=short) is None and waits == [2, 2]
    until(lambda: pinger._primer is None, "no second ping within PING_TIMEOUT_S")
    assert sorted(client.pinged) == ["a", "b", "silent", "silent"], "the answered ones are not pinged again"
    pinger.prime(rec("new"))
    until(lambda: pinger._primer is None, "the newcomer's first ping")
    answer = pinger.poll([*recs, rec("new")], short=short)
    assert answer is not None and [r.peer_id for r in answer[0]] == ["a", "b", "new"] and waits == [2, 2, 3]
    assert pinger.poll(recs[:2], lambda: {"a", "b"}) is not None, "taken: the next decision starts anew"


def test_a_fresh_start_with_everyone_primed_keeps_their_answers_until_it_is_due() -> None:
    """Pings warm up once 4 in 5 of ``min_peers`` are live; if every one of them had just answered its own first
    ping, there was nobody to ping, and by the time the round was due (a second or more later) the first joiners'
    answers were older than ``primed_s``: the decision pinged them. The answer is kept from when the pings would
    have begun."""
    client = Client({"a": "h:1", "b": "h:1"})
    pinger = Pinger(client, "run", "me", primed_s=0.3)  # type: ignore[arg-type]
    for r in (rec("a"), rec("b")):
        pinger.prime(r)
    primed(pinger, client, 2)
    assert pinger.poll([rec("a"), rec("b")], due=False) is None
    until(lambda: time.monotonic() - pinger._answered["a"][1] > 0.3, "the primed answers to age past primed_s")
    answer = pinger.poll([rec("a"), rec("b")])
    assert answer is not None and [r.peer_id for r in answer[0]] == ["a", "b"] and sorted(client.pinged) == ["a", "b"]


class Slow(Client):
    """Pings of ``held`` wait for ``go``."""

    def __init__(self, up: dict[str, str], held: str) -> None:
        super().__init__(up)
        self.held, self.go = held, threading.Event()

    def ping_all(self, targets: list[tuple[str, str]], request: object, timeout: float) -> list[bool]:
        if any(peer == self.held for _, peer in targets):
            assert self.go.wait(10)
        return super().ping_all(targets, request, timeout)


def test_a_newcomer_whose_first_ping_is_in_flight_is_not_pinged_twice() -> None:
    client, done = Slow({"x": "h:1", "y": "h:1"}, held="x"), threading.Event()
    pinger = Pinger(client, "run", "me", done=done.set)  # type: ignore[arg-type]
    pinger.prime(rec("x"))
    until(lambda: pinger._priming == {"x"} and not pinger._queue, "the newcomer's ping in flight")
    assert pinger.poll([rec("x"), rec("y")], due=False) is None and done.wait(10)
    client.go.set()
    until(lambda: pinger._primer is None, "the newcomer's answer")
    answer = pinger.poll([rec("x"), rec("y")])
    assert answer is not None and sorted(r.peer_id for r in answer[0]) == ["x", "y"]
    assert sorted(client.pinged) == ["x", "y"], "each pinged once"


def test_each_answer_to_a_newcomers_ping_counts_as_it_comes_not_when_the_slowest_does(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Real mutual-TLS pings: a peer that answers at once is primed while another's ping still waits on its
    handler, and a dead address fails alone (the primer's batches of 150 waited 0.8 s for their slowest)."""
    from test_relay import RUN, Handlers, Node

    from potluck.protos.net.certs import CertificateAuthority
    from potluck.protos.net.transport import PeerServer

    class Stalled(Handlers):
        def __init__(self, me: str) -> None:
            super().__init__(me)
            self.go = threading.Event()

        def ping(self, request: pb.PingRequest) -> pb.PingReply:
            assert self.go.wait(20)
            return super().ping(request)

    ca = CertificateAuthority.load_or_create(tmp_path / "ca.key", RUN)
    fast, slow, coordinator = Node(ca), Node(ca), Node(ca)
    stalled = Stalled(slow.id)
    servers = [PeerServer(Handlers(fast.id), fast.traffic, host="127.0.0.1", port=0, tls=fast.tls),
               PeerServer(stalled, slow.traffic, host="127.0.0.1", port=0, tls=slow.tls)]
    pinger = Pinger(coordinator.client, RUN, coordinator.id)
    try:
        recs = [rec(fast.id, f"127.0.0.1:{servers[0].port}"), rec(slow.id, f"127.0.0.1:{servers[1].port}"),
                rec("12D3KooWdead", "127.0.0.1:1")]
        for r in recs:
            pinger.prime(r)
        until(lambda: fast.id in pinger._answered and "12D3KooWdead" in pinger._answered, "the fast and dead answers")
        assert pinger._answered[fast.id][0] == recs[0].address and pinger._answered["12D3KooWdead"][0] == ""
        assert slow.id in pinger._priming and slow.id not in pinger._answered, "the stalled one is still on its way"
        stalled.go.set()
        until(lambda: not pinger._priming, "the stalled answer")
        assert pinger._answered[slow.id][0] == recs[1].address
    finally:
        stalled.go.set()
        coordinator.client.close()
        for server in servers:
            server.stop(0)


def test_the_answers_a_pinger_holds_are_those_not_yet_spent_at_four_times_its_pruning_bound() -> None:
    """Each newcomer's answer is held until a decision spends it (or it is stale): 256 newcomers, a decision, and
    256 more leave the second 256 held, not 512 (each answer comes alone; the pass over them is amortised)."""
    first, second = [rec(f"a{i}") for i in range(256)], [rec(f"b{i}") for i in range(256)]
    client = Client({r.peer_id: r.address for r in first + second})
    pinger = Pinger(client, "run", "me")  # type: ignore[arg-type]
    for r in first:
        pinger.prime(r)
    primed(pinger, client, 256)
    answer = pinger.poll(first)
    assert answer is not None and len(answer[0]) == 256 and len(client.pinged) == 256, "all in on their own answers"
    for r in second:
        pinger.prime(r)
    primed(pinger, client, 512)
    assert set(pinger._answered) == {r.peer_id for r in second}
