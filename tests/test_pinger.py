"""The coordinator's pings of its peers: a newcomer is pinged when it shows up, so a decision need not.

(Most of a decision's time at 1,000 peers with churn was waiting for the newcomers' pings: 0.16 s of a median
decision on a machine of its own, and a second for the first round after a join burst.)

What the pinger decides (potluck.coordinator.swarm.pings) is tested as values, with explicit times: no clock, no
threads, no network. The threaded Pinger that carries it out is tested last, against a fake client and real
mutual-TLS peers, waiting on conditions."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping

from potluck.coordinator.health import Health
from potluck.coordinator.swarm.membership import PeerTable
from potluck.coordinator.swarm.pings import (
    NEVER,
    Action,
    Answer,
    Heard,
    Kept,
    PingAll,
    PingerState,
    PingRules,
    Polled,
    Prime,
    Waiting,
    Why,
    pinged,
    poll,
    pruned,
    wakes,
)
from potluck.coordinator.swarm.service import Pinger
from potluck.protos import potluck_pb2 as pb
from potluck.protos.wire.records import PeerRecord

RULES = PingRules(max_age_s=10.0, primed_s=3.0, recheck_s=1.0, wake_s=0.05, ping_timeout_s=2.0)


def rec(pid: str, address: str = "h:1", seq: int = 1) -> PeerRecord:
    return PeerRecord(peer_id=pid, address=address, seq=seq)


def recs(*pids: str) -> list[PeerRecord]:
    return [rec(p) for p in pids]


def ids(records: Collection[PeerRecord]) -> list[str]:
    return [r.peer_id for r in records]


def heard(at: float, *pids: str, address: str = "h:1") -> dict[str, Heard]:
    return {p: Heard(address, at) for p in pids}


class Look:
    """A pinger's state, and the loop's polls of it: each returns what :func:`poll` said (the state is kept)."""

    def __init__(self, rules: PingRules = RULES) -> None:
        self.state = PingerState(rules)
        self.heard: dict[str, Heard] = {}
        self.priming: set[str] = set()

    def poll(self, records: list[PeerRecord], now: float, proven: Callable[[], Collection[str]] = frozenset,
             due: bool = True, short: Callable[[int], bool] = lambda answered: False) -> tuple[Polled, list[Action]]:
        self.state, polled, actions = poll(self.state, records, now, self.heard, self.priming, proven, due, short)
        return polled, actions

    def pinged(self, now: float, asked: Collection[str], ok: Collection[str] = ()) -> None:
        """The decision's pings are in: ``asked`` were pinged, ``ok`` answered."""
        assert self.state.pinging
        self.state = pinged(self.state, asked, ok, now)


def started(polled: Polled, actions: list[Action]) -> list[str]:
    """The peers a poll that started the decision's pings pinged."""
    assert polled == Waiting(Why.STARTED) and len(actions) == 1 and isinstance(actions[0], PingAll), (polled, actions)
    return ids(actions[0].records)


# What the pinger decides: values in, values out.


def test_a_decision_takes_a_newcomers_answer_to_its_first_ping_at_once() -> None:
    look = Look()
    look.heard = heard(1.0, "a", "b")
    polled, actions = look.poll(recs("a", "b"), now=1.5)
    assert polled == Answer(recs("a", "b"), began=1.5) and actions == [], "no one was left to ping: at once"
    assert look.state.kept is None and look.state.taken == 1.5


def test_a_newcomers_first_answer_serves_the_next_decision_only() -> None:
    """A member killed after the decision that took its join-time answer holds a record short of the committed
    step: the decision after pings it (as before priming) and leaves it out, whatever its first answer said."""
    look = Look()
    look.heard = heard(1.0, "a")
    assert look.poll(recs("a"), now=1.5)[0] == Answer(recs("a"), 1.5)  # the next decision: taken as it is
    assert started(*look.poll(recs("a"), now=2.0)) == ["a"]  # the one after (killed meanwhile): pinged again
    assert look.poll(recs("a"), now=2.5) == (Waiting(Why.IN_FLIGHT), []), "nothing is decided while they run"
    look.pinged(3.0, ["a"])
    assert look.poll(recs("a"), now=3.1)[0] == Answer([], began=2.0), "began: when its pings did"


def test_a_decisions_pings_start_while_the_round_before_settles_and_wait_for_it() -> None:
    """Not due yet (the committed round's members still report it), the pings start and their answer is kept:
    asked again before it is due, nobody is pinged twice; once due, the answer is taken without a ping. (At 1,000
    peers with churn the newcomers' pings were most of a decision's time, 0.2-1.1 s on a 2-core box.)"""
    look, live = Look(), recs("a", "b", "gone")
    assert started(*look.poll(live, 1.0, lambda: {"b"}, due=False)) == ["a", "gone"], "the proven one is not pinged"
    look.pinged(1.2, ["a", "gone"], ok=["a"])
    assert look.poll(live, 1.3, lambda: {"b"}, due=False) == (Waiting(Why.NOT_DUE), []), "kept, not taken"
    look.heard = {**heard(1.5, "new"), **heard(1.5, "silent", address="")}  # (joined while the round settled)
    polled, actions = look.poll([*live[:2], rec("new"), rec("silent")], 2.0, lambda: {"b"})  # (due; "gone" left)
    assert polled == Answer(recs("a", "b", "new"), began=1.0) and actions == [], "a newcomer since: on its own answer"
    assert started(*look.poll(live[:2], 2.5, lambda: set(), due=False)) == ["a", "b"], "taken: the next round pings"


def test_a_peer_proven_when_the_pings_began_but_not_once_due_is_pinged_by_the_decision() -> None:
    """A member killed while the committed round settled: its fresh heartbeat proved it when the pings began, and
    it was not pinged. Once due its heartbeat is stale and its record short of the committed step: the decision
    pings it, and leaves it out (a swarm test caught the round after it decided with the dead member in)."""
    look, live = Look(), recs("a", "victim")
    assert look.poll(live, 1.0, lambda: {"a", "victim"}, due=False) == (Waiting(Why.NOT_DUE), [])
    assert started(*look.poll(live, 1.5, lambda: {"a"})) == ["victim"], "due: the victim is pinged"
    look.pinged(1.7, ["victim"])
    asked = list[int]()
    polled, _ = look.poll(live, 1.8, lambda: asked.append(1) or set())  # ("a"'s proof lapsed while the ping ran)
    assert polled == Answer(recs("a"), began=1.0) and asked == [], "proofs are asked once, when the decision is due"


def test_a_proof_that_lapses_while_the_round_settles_is_pinged_then_not_once_due() -> None:
    """A member whose heartbeat goes stale while the committed round settles is pinged then (each recheck_s), so
    the decision, once due, need not (at 1,000 peers on 2 cores such pings were 0.05-0.3 s of a decision)."""
    look, live, asked = Look(), recs("a", "slow", "late"), list[float]()

    def proven(now: float, them: set[str]) -> Callable[[], set[str]]:
        return lambda: asked.append(now) or them  # type: ignore[func-returns-value]

    assert look.poll(live, 0.0, proven(0.0, {"a", "slow", "late"}), due=False) == (Waiting(Why.NOT_DUE), [])
    assert started(*look.poll(live, 0.5, proven(0.5, {"a", "late"}), due=False)) == ["slow"]
    look.pinged(0.6, ["slow"], ok=["slow"])
    assert look.poll(live, 1.0, proven(1.0, {"a"}), due=False) == (Waiting(Why.NOT_DUE), []), "within recheck_s"
    assert asked == [0.0, 0.5], "not even looked at"
    assert started(*look.poll(live, 1.5, proven(1.5, {"a"}), due=False)) == ["late"]
    look.pinged(1.6, ["late"], ok=["late"])
    polled, actions = look.poll(live, 2.0, proven(2.0, {"a"}))
    assert polled == Answer(live, began=0.0) and actions == [], "once due, nobody left to ping"


def test_a_newcomer_that_did_not_answer_or_moved_or_answered_long_ago_is_pinged_by_the_decision() -> None:
    """A primed ping that failed proves nothing; nor does an answer at another address (the peer restarted
    elsewhere) or one older than primed_s. Those are pinged by the decision, the others are not."""
    look = Look()
    look.heard = {**heard(0.0, "old"), **heard(10.0, "ok", "moved"), **heard(10.0, "silent", address="")}
    live = [rec("ok"), rec("silent"), rec("moved", "h:2", seq=2), rec("old")]
    assert started(*look.poll(live, 10.5)) == ["silent", "moved", "old"]
    look.pinged(11.0, ["silent", "moved", "old"], ok=["moved", "old"])
    assert look.poll(live, 11.0)[0] == Answer([live[0], live[2], live[3]], began=10.5)


def test_a_kept_answer_older_than_max_age_is_dropped_and_the_peers_pinged_again() -> None:
    look = Look()
    assert started(*look.poll(recs("a"), 0.0, due=False)) == ["a"]
    look.pinged(1.0, ["a"], ok=["a"])
    assert look.poll(recs("a"), 11.0, due=False) == (Waiting(Why.NOT_DUE), []), "its age counts from its pings' end"
    assert started(*look.poll(recs("a"), 11.5)) == ["a"], "past max_age_s: pinged again"
    assert look.state.kept == Kept(began=11.5, aged_from=11.5)


def test_a_fresh_start_short_of_min_peers_keeps_its_answer_and_pings_only_the_peers_it_lacks() -> None:
    """The first round after 1,000 joins was short of ``min_peers`` on its first answer (the last joiners' own pings
    still ran): taken, its answer spent every newcomer's too, and all 960 were pinged again (1.2 s more). Kept, those
    that answered are not pinged again; a silent one is, by itself, once in ping_timeout_s; a newcomer is in on its
    own first answer; and once ``short`` says go on, the answer is taken with those that answered."""
    look, live, waits = Look(), recs("a", "b", "silent"), list[int]()

    def short(answered: int) -> bool:
        waits.append(answered)
        return answered < 3

    assert started(*look.poll(live, 0.0, short=short)) == ["a", "b", "silent"]
    look.pinged(0.5, ["a", "b", "silent"], ok=["a", "b"])
    assert look.poll(live, 0.6, short=short) == (Waiting(Why.SHORT), [Prime((rec("silent"),))]) and waits == [2]
    look.priming.add("silent")
    assert look.poll(live, 0.7, short=short) == (Waiting(Why.SHORT), []), "its own ping is on its way"
    look.priming.clear()
    look.heard |= heard(0.8, "silent", address="")
    assert look.poll(live, 2.0, short=short) == (Waiting(Why.SHORT), []), "not again within ping_timeout_s"
    assert look.poll(live, 2.7, short=short) == (Waiting(Why.SHORT), [Prime((rec("silent"),))]), "then again"
    look.heard |= heard(2.8, "new")  # (a newcomer's first answer)
    polled, actions = look.poll([*live, rec("new")], 3.0, short=short)
    assert polled == Answer(recs("a", "b", "new"), began=0.0) and actions == [] and waits == [2, 2, 2, 2, 3]
    assert look.poll(live[:2], 3.5, lambda: {"a", "b"})[0] == Answer(live[:2], 3.5), "taken: the next starts anew"


def test_a_newcomers_answer_wakes_a_fresh_start_short_of_min_peers_at_most_each_wake_s() -> None:
    """Each answer woke it at first: 23 ticks in the 0.35 s the last 86 answers of a 1,000-peer join burst took."""
    state = PingerState(RULES)
    assert wakes(state, 0.0) == (state, False), "nobody waits"
    state = PingerState(RULES, kept=Kept(began=0.0, aged_from=0.0, short=True))
    state, woke = wakes(state, 1.0)
    assert woke and state.woke == 1.0
    assert wakes(state, 1.04) == (state, False) and wakes(state, 1.05)[1]


def test_a_fresh_start_with_everyone_primed_keeps_their_answers_until_it_is_due() -> None:
    """Pings warm up once 4 in 5 of ``min_peers`` are live; if every one of them had just answered its own first
    ping, there was nobody to ping, and by the time the round was due (a second or more later) the first joiners'
    answers were older than ``primed_s``: the decision pinged them. The answer is kept from when the pings would
    have begun."""
    look = Look()
    look.heard = heard(0.0, "a", "b")
    assert look.poll(recs("a", "b"), 0.1, due=False) == (Waiting(Why.NOT_DUE), [])
    assert look.poll(recs("a", "b"), 5.0) == (Answer(recs("a", "b"), began=0.1), []), "primed_s from 0.1, not 5.0"


def test_a_newcomer_whose_first_ping_is_in_flight_is_not_pinged_twice() -> None:
    look = Look()
    look.priming = {"x"}
    assert started(*look.poll(recs("x", "y"), 1.0, due=False)) == ["y"]
    look.pinged(1.1, ["y"], ok=["y"])
    assert look.poll(recs("x", "y"), 1.2, due=False) == (Waiting(Why.NOT_DUE), [])
    look.priming.clear()
    look.heard = heard(1.3, "x")  # (its answer)
    assert look.poll(recs("x", "y"), 1.4) == (Answer(recs("x", "y"), began=1.0), []), "each pinged once"


def test_a_peer_evicted_while_the_decisions_pings_ran_is_not_in_the_round() -> None:
    """A lie proven in the tick that decides the rerun: the pings began before the proof, and the liar answered
    them. The rerun named it as a member and shard owner, and every honest peer then waited 4.6 s for a shard
    nobody would reduce (in a lying owner's run)."""
    look = Look()
    assert started(*look.poll(recs("a", "b", "liar"), 1.0)) == ["a", "b", "liar"]
    look.pinged(1.5, ["a", "b", "liar"], ok=["a", "b", "liar"])
    assert look.poll(recs("a", "b"), 1.6)[0] == Answer(recs("a", "b"), began=1.0)


def test_the_answers_held_are_those_not_yet_spent_nor_stale_once_past_the_pruning_bound() -> None:
    """Each newcomer's answer is held until a decision spends it (or it is stale, older than any decision to come
    could count); the bound doubles with what is left, so the pass over them is amortised (each answer comes alone)."""
    state = PingerState(RULES, taken=100.0, prune_at=4)
    held = {**heard(99.0, "spent1", "spent2"), **heard(101.0, "new1", "new2")}
    assert pruned(state, held, now=101.0) is None, "within the bound: all held"
    held |= heard(101.5, "new3")
    assert pruned(state, held, now=101.5) == (PingerState(RULES, taken=100.0, prune_at=64), heard(101.0, "new1", "new2")
                                              | heard(101.5, "new3"))
    stale = PingerState(RULES, taken=NEVER, prune_at=1)  # (no decision yet: the stale go)
    out = pruned(stale, {**heard(0.0, "old"), **heard(20.0, "recent")}, now=20.0)
    assert out is not None and set(out[1]) == {"recent"}, "older than primed_s + max_age_s + ping_timeout_s"


def test_a_decisions_time_counts_from_when_it_was_due_not_from_pings_that_began_before() -> None:
    health = Health()
    assert not health.due(False, now=5.0) and health.decision_began(5.5) == 5.5  # (nothing due: its pings' start)
    assert health.due(True, now=10.0) and health.due(True, now=11.0)
    assert health.decision_began(9.0) == 10.0, "pinged while the round before settled: from when it was due"
    assert health.decision_began(10.5) == 10.5, "pinged after it was due: from the pings"
    health.due(False, now=12.0)  # (decided: the next one is due from its own time)
    assert health.due(True, now=20.0) and health.decision_began(9.0) == 20.0


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




# The threaded Pinger that carries it out: waiting on conditions, not on time.


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


def primed(pinger: Pinger, *pids: str) -> Mapping[str, Heard]:
    """Wait for these peers' first pings to be answered (or not), and nobody else's still on its way."""
    until(lambda: set(pids) <= set((s := pinger.snapshot()).heard) and not s.priming, f"{pids}' first pings")
    return pinger.snapshot().heard


def test_a_pinger_primes_newcomers_and_pings_whom_a_decision_lacks_off_the_loop() -> None:
    """The whole round trip on threads: newcomers answer their first pings, the decision takes those answers without
    a ping of its own; the one after pings off the loop, wakes it when the answers are in, and leaves out the dead."""
    client, done = Client({"a": "h:1", "b": "h:1"}), threading.Event()
    pinger = Pinger(client, "run", "me", done=done.set)  # type: ignore[arg-type]
    for r in recs("a", "b"):
        pinger.prime(r)
    assert set(primed(pinger, "a", "b")) == {"a", "b"}
    answer = pinger.poll(recs("a", "b"))
    assert isinstance(answer, Answer) and ids(answer.records) == ["a", "b"] and len(client.pinged) == 2
    del client.up["b"]  # (then killed)
    assert pinger.poll(recs("a", "b")) == Waiting(Why.STARTED) and done.wait(10)
    answer = pinger.poll(recs("a", "b"))
    assert isinstance(answer, Answer) and ids(answer.records) == ["a"] and sorted(client.pinged) == ["a", "a", "b", "b"]


def test_a_short_fresh_start_has_the_peers_it_lacks_primed_and_is_woken_by_their_answers() -> None:
    client, done = Client({"a": "h:1", "late": "elsewhere"}), threading.Event()  # ("late": busy when first pinged)
    pinger = Pinger(client, "run", "me", done=done.set)  # type: ignore[arg-type]
    live = recs("a", "late")
    assert pinger.poll(live, short=lambda n: n < 2) == Waiting(Why.STARTED) and done.wait(10)
    done.clear()
    client.up["late"] = "h:1"  # (it answers now)
    assert pinger.poll(live, short=lambda n: n < 2) == Waiting(Why.SHORT) and done.wait(10), "its answer wakes the loop"
    primed(pinger, "late")
    answer = pinger.poll(live, short=lambda n: n < 2)
    assert isinstance(answer, Answer) and ids(answer.records) == ["a", "late"]
    assert client.pinged == ["a", "late", "late"], "only the one it lacked was pinged again"


def test_the_answers_a_pinger_holds_are_those_not_yet_spent_at_four_times_its_pruning_bound() -> None:
    """Each newcomer's answer is held until a decision spends it (or it is stale): 256 newcomers, a decision, and
    256 more leave the second 256 held, not 512 (each answer comes alone; the pass over them is amortised)."""
    first, second = [rec(f"a{i}") for i in range(256)], [rec(f"b{i}") for i in range(256)]
    client = Client({r.peer_id: r.address for r in first + second})
    pinger = Pinger(client, "run", "me")  # type: ignore[arg-type]
    for r in first:
        pinger.prime(r)
    primed(pinger, *ids(first))
    answer = pinger.poll(first)
    assert isinstance(answer, Answer) and len(answer.records) == 256 and len(client.pinged) == 256, "on their own"
    for r in second:
        pinger.prime(r)
    assert set(primed(pinger, *ids(second))) == set(ids(second))


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
    done = threading.Event()
    pinger = Pinger(coordinator.client, RUN, coordinator.id, done=done.set)
    try:
        live = [rec(fast.id, f"127.0.0.1:{servers[0].port}"), rec(slow.id, f"127.0.0.1:{servers[1].port}"),
                rec("12D3KooWdead", "127.0.0.1:1")]
        for r in live:
            pinger.prime(r)
        until(lambda: {fast.id, "12D3KooWdead"} <= set(pinger.snapshot().heard), "the fast and dead answers")
        now = pinger.snapshot()
        assert now.heard[fast.id].address == live[0].address and now.heard["12D3KooWdead"].address == ""
        assert slow.id in now.priming and slow.id not in now.heard, "the stalled one is still on its way"
        stalled.go.set()
        assert primed(pinger, slow.id)[slow.id].address == live[1].address
        assert pinger.poll(live) == Waiting(Why.STARTED) and done.wait(20)  # (a decision: the dead one is pinged)
        answer = pinger.poll(live)
        assert isinstance(answer, Answer) and ids(answer.records) == [fast.id, slow.id]
    finally:
        stalled.go.set()
        coordinator.client.close()
        for server in servers:
            server.stop(0)
